"""Any Llama-architecture GGUF loads the same way: a tiny random model written here, checked
against an independent float64 NumPy forward on the *unpermuted* (Hugging Face layout) weights
with rotate-half RoPE, so the GGUF Q/K permutation convention is checked too."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from engine.model.cpu_runner import CacheConfig, CpuRunner, ForwardBatch
from engine.model.gguf_loader import GGUFModel

HP = dict(layers=2, hidden=64, inter=96, heads=4, kv_heads=2, vocab=300, theta=10000.0, eps=1e-5)


def to_gguf_order(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: reorder each head's rows so RoPE pairs become adjacent."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def make_weights(rng) -> dict[str, np.ndarray]:
    h, i, hd = HP["hidden"], HP["inter"], HP["hidden"] // HP["heads"]
    w = {"token_embd.weight": rng.standard_normal((HP["vocab"], h)), "output_norm.weight": 1 + 0.1 * rng.standard_normal(h)}
    for layer in range(HP["layers"]):
        p = f"blk.{layer}."
        w[p + "attn_norm.weight"] = 1 + 0.1 * rng.standard_normal(h)
        w[p + "ffn_norm.weight"] = 1 + 0.1 * rng.standard_normal(h)
        w[p + "attn_q.weight"] = rng.standard_normal((HP["heads"] * hd, h)) / 8
        w[p + "attn_k.weight"] = rng.standard_normal((HP["kv_heads"] * hd, h)) / 8
        w[p + "attn_v.weight"] = rng.standard_normal((HP["kv_heads"] * hd, h)) / 8
        w[p + "attn_output.weight"] = rng.standard_normal((h, HP["heads"] * hd)) / 8
        w[p + "ffn_gate.weight"] = rng.standard_normal((i, h)) / 8
        w[p + "ffn_up.weight"] = rng.standard_normal((i, h)) / 8
        w[p + "ffn_down.weight"] = rng.standard_normal((h, i)) / 8
    return {k: v.astype(np.float32) for k, v in w.items()}


QTYPES = {"attn_q": "Q8_0", "ffn_up": "Q4_1", "ffn_down": "F16", "token_embd": "Q8_0"}


def write_gguf(path, hf: dict[str, np.ndarray], arch: str = "llama") -> dict[str, np.ndarray]:
    """Write the model; returns the exact (dequantized) weights the file holds, in HF layout."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(HP["layers"])
    writer.add_embedding_length(HP["hidden"])
    writer.add_feed_forward_length(HP["inter"])
    writer.add_head_count(HP["heads"])
    writer.add_head_count_kv(HP["kv_heads"])
    writer.add_rope_freq_base(HP["theta"])
    writer.add_layer_norm_rms_eps(HP["eps"])
    writer.add_context_length(256)
    writer.add_vocab_size(HP["vocab"])
    stored = {}
    for name, w in hf.items():
        g = w
        if name.endswith("attn_q.weight"):
            g = to_gguf_order(w, HP["heads"])
        elif name.endswith("attn_k.weight"):
            g = to_gguf_order(w, HP["kv_heads"])
        qtype = next((getattr(gguf.GGMLQuantizationType, t) for k, t in QTYPES.items() if k in name),
                     gguf.GGMLQuantizationType.F32)
        data = g.astype(np.float16) if qtype == gguf.GGMLQuantizationType.F16 else g
        if qtype not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            data = gguf.quants.quantize(g, qtype)
        writer.add_tensor(name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
        exact = gguf.quants.dequantize(data, qtype).reshape(g.shape).astype(np.float32)
        if name.endswith("attn_q.weight") or name.endswith("attn_k.weight"):  # back to HF layout
            n = HP["heads"] if "attn_q" in name else HP["kv_heads"]
            exact = exact.reshape(n, exact.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(exact.shape)
        stored[name] = exact
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def reference_forward(w: dict[str, np.ndarray], ids: np.ndarray) -> np.ndarray:
    """Float64 Llama forward, Hugging Face style (rotate-half RoPE on the unpermuted weights)."""
    f = {k: v.astype(np.float64) for k, v in w.items()}
    n, hd = len(ids), HP["hidden"] // HP["heads"]
    inv = 1.0 / HP["theta"] ** (np.arange(0, hd, 2) / hd)
    ang = np.outer(np.arange(n), inv)
    cos, sin = np.cos(np.concatenate([ang, ang], 1)), np.sin(np.concatenate([ang, ang], 1))

    def norm(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + HP["eps"]) * g

    def rope(x):  # [n, heads, hd]
        rot = np.concatenate([-x[..., hd // 2 :], x[..., : hd // 2]], -1)
        return x * cos[:, None] + rot * sin[:, None]

    x = f["token_embd.weight"][ids]
    mask = np.triu(np.full((n, n), -np.inf), 1)
    for layer in range(HP["layers"]):
        p = f"blk.{layer}."
        h = norm(x, f[p + "attn_norm.weight"])
        q = rope((h @ f[p + "attn_q.weight"].T).reshape(n, HP["heads"], hd))
        k = rope((h @ f[p + "attn_k.weight"].T).reshape(n, HP["kv_heads"], hd))
        v = (h @ f[p + "attn_v.weight"].T).reshape(n, HP["kv_heads"], hd)
        rep = HP["heads"] // HP["kv_heads"]
        k, v = np.repeat(k, rep, 1), np.repeat(v, rep, 1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + mask
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", a, v).reshape(n, -1) @ f[p + "attn_output.weight"].T
        h = norm(x, f[p + "ffn_norm.weight"])
        g, u = h @ f[p + "ffn_gate.weight"].T, h @ f[p + "ffn_up.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ f[p + "ffn_down.weight"].T
    return norm(x, f["output_norm.weight"]) @ f["token_embd.weight"].T


def test_random_llama_gguf_matches_float64_reference(tmp_path):
    rng = np.random.default_rng(0)
    stored = write_gguf(tmp_path / "tiny.gguf", make_weights(rng))
    model = GGUFModel(tmp_path / "tiny.gguf")
    assert (model.config.num_layers, model.config.num_kv_heads, model.config.head_dim) == (2, 2, 16)
    assert model.config.tied_embeddings
    runner = CpuRunner(model, CacheConfig(block_size=4, num_blocks=32, max_model_len=64, max_num_seqs=4,
                                          max_num_batched_tokens=64), numerics="exact")  # float32 products
    ids = rng.integers(0, HP["vocab"], 21).astype(np.int32)
    fb = ForwardBatch(runner.cache)
    fb.add(ids, 0, list(range(6)), len(ids))
    ours = runner.forward(fb)  # [21, vocab]
    ref = reference_forward(stored, ids)
    rel = np.linalg.norm(ours - ref) / np.linalg.norm(ref)
    assert rel < 1e-5, rel
    assert np.array_equal(ours.argmax(-1), ref.argmax(-1))


def test_other_architecture_is_refused_by_name(tmp_path):
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="mamba"):
        GGUFModel(path)


@pytest.mark.parametrize("half", ["F16", "BF16"])
@pytest.mark.parametrize("numerics", ["int8", "exact"])
def test_half_weights_give_the_logits_of_their_float32_values(tmp_path, model_path, half, numerics):
    """A model stored in F16 / BF16 runs at 2 bytes a weight, widened exactly as loaded: its logits are
    bit-identical to those of an F32 file holding the same values, in both numerics."""
    from tiny_models import write_tiny_llama

    cache = CacheConfig(block_size=4, num_blocks=32, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64)
    ids = np.random.default_rng(1).integers(0, 1000, 13).astype(np.int32)
    logits = {}
    for stored in (half, "F32"):
        path = write_tiny_llama(tmp_path / f"{stored}.gguf", model_path, weights=stored, values_of=half)
        runner = CpuRunner(GGUFModel(path), cache, numerics=numerics)
        fb = ForwardBatch(runner.cache)
        fb.add(ids, 0, list(range(4)), len(ids))
        logits[stored] = runner.forward(fb).copy()
        if stored == half:
            assert {runner.lm_head.kind} | {w.kind for w in runner.layers[0][1:3]} == {half.lower()}
    np.testing.assert_array_equal(logits[half], logits["F32"])
