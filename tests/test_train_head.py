"""`speculant train-head` end to end on a tiny random Llama GGUF (with a byte-level tokenizer in its
metadata), and the torch EAGLE head checked against an independent float64 NumPy evaluation of the
semantics in proposers/heads/head_file.py, read back from the exported file."""

from __future__ import annotations

import itertools
import json

import gguf
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from test_gguf_llama import HP, make_weights, to_gguf_order

from engine.tokenizer import _byte_decoder
from proposers.heads.head_file import load_head
from proposers.training import cli
from proposers.training.export import export_head, head_config
from proposers.training.modules import DraftHead, HeadShape

KINDS = {"eagle": [], "mtp": ["--num-modules", "2"], "medusa": ["--num-modules", "3"]}
MAX_FILE_BYTES = 16 * 10**6


def write_tiny_chat_model(path) -> None:
    """A random 2-layer Llama whose GGUF carries a byte-level BPE vocabulary of exactly HP['vocab'] tokens."""
    specials = ["<|im_start|>", "<|im_end|>"]
    byte_chars = sorted(_byte_decoder(), key=_byte_decoder().get)
    tokens = specials + byte_chars + [f"<x{i}>" for i in range(HP["vocab"] - len(specials) - len(byte_chars))]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(HP["layers"])
    writer.add_embedding_length(HP["hidden"])
    writer.add_feed_forward_length(HP["inter"])
    writer.add_head_count(HP["heads"])
    writer.add_head_count_kv(HP["kv_heads"])
    writer.add_rope_freq_base(HP["theta"])
    writer.add_layer_norm_rms_eps(HP["eps"])
    writer.add_context_length(512)
    writer.add_vocab_size(HP["vocab"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    for name, w in make_weights(np.random.default_rng(0)).items():
        if name.endswith("attn_q.weight"):
            w = to_gguf_order(w, HP["heads"])
        elif name.endswith("attn_k.weight"):
            w = to_gguf_order(w, HP["kv_heads"])
        writer.add_tensor(name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Train every kind once on the tiny model (the first run builds the dataset, the others reuse it)."""
    root = tmp_path_factory.mktemp("train_head")
    write_tiny_chat_model(root / "tiny.gguf")
    dataset = root / "data.npz"
    common = ["--model", str(root / "tiny.gguf"), "--out", str(root / "heads"), "--dataset", str(dataset),
              "--num-prompts", "12", "--max-tokens", "16", "--held-out", "0.25", "--epochs", "4", "--lr", "3e-3",
              "--batch-size", "2", "--seq-len", "64", "--draft-vocab-size", "128", "--eval-drafts", "3", "--threads", "2",
              "--temperature", "1.0"]
    runs = {}
    for kind, extra in KINDS.items():
        assert cli.main(["--kind", kind, *common, *extra]) == 0
        runs[kind] = dataset.stat().st_mtime_ns
    return root, runs


@pytest.mark.parametrize("kind", list(KINDS))
def test_train_head_writes_a_loadable_head_and_the_loss_goes_down(trained, kind):
    root, _ = trained
    path = root / "heads" / f"tiny-{kind}.safetensors"
    assert path.is_file() and path.with_suffix(".json").is_file()
    assert path.stat().st_size <= MAX_FILE_BYTES
    head = load_head(path, hidden_size=HP["hidden"], vocab_size=HP["vocab"])
    assert head.kind == kind
    assert head.config["num_modules"] == {"eagle": 1, "mtp": 2, "medusa": 3}[kind]
    assert head.tensors["draft_vocab"].shape == (128,)
    report = head.config["training"]
    assert report["data"]["prompts"] == 12 and report["data"]["held_out_prompts"] == 3
    assert report["steps"] > 0
    assert report["train_loss_last"] < report["train_loss_first"]
    assert report["held_out_loss"] < report["held_out_loss_before"]
    acceptance = report["acceptance"]
    assert acceptance["num_starts"] > 0 and len(acceptance["per_position"]) == 3
    rates = acceptance["per_position"]
    assert all(0.0 <= b <= a <= 1.0 for a, b in itertools.pairwise(rates))  # cumulative: never rises
    assert acceptance["mean_acceptance_length"] == pytest.approx(1 + sum(rates), abs=1e-3)


def test_dataset_is_built_once_and_reused(trained):
    _, mtimes = trained
    assert mtimes["eagle"] == mtimes["mtp"] == mtimes["medusa"]


def test_prompts_file_takes_prompts_and_conversations(tmp_path):
    from proposers.training.corpus import builtin_prompts, load_prompts

    path = tmp_path / "p.jsonl"
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    path.write_text(json.dumps({"prompt": "Name a prime."}) + "\n\n" + json.dumps({"messages": chat}) + "\n")
    assert load_prompts(path) == [[{"role": "user", "content": "Name a prime."}], chat]
    path.write_text('{"text": "no"}\n')
    with pytest.raises(ValueError, match="prompts: line 1"):
        load_prompts(path)
    prompts = [c[0]["content"] for c in builtin_prompts(300, seed=0)]
    assert len(prompts) == len(set(prompts)) == 300  # distinct
    assert sum("```" in p for p in prompts) > 0 and sum("JSON" in p for p in prompts) > 0


def test_bad_flag_is_reported_by_name(tmp_path, capsys):
    assert cli.main(["--kind", "eagle", "--epochs", "0", "--out", str(tmp_path)]) == 2
    assert "--epochs" in capsys.readouterr().err
    assert cli.main(["--kind", "eagle", "--num-modules", "2", "--out", str(tmp_path)]) == 2
    assert "--num-modules" in capsys.readouterr().err


# ---------------------------------------------------------------- the EAGLE module vs a float64 NumPy reference


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, pos, theta):  # x [n, heads, hd], rotate-half, row i at position pos[i]
    hd = x.shape[-1]
    ang = np.outer(pos, theta ** (-np.arange(0, hd, 2) / hd))
    cos, sin = np.cos(np.concatenate([ang, ang], 1))[:, None], np.sin(np.concatenate([ang, ang], 1))[:, None]
    return x * cos + np.concatenate([-x[..., hd // 2:], x[..., : hd // 2]], -1) * sin


def reference_eagle(t: dict, cfg: dict, emb: np.ndarray, feat: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """z of each row: layer(fc([e, f])), rows attending causally to rows before them (float64)."""
    n, nh, nkv, hd, eps = len(emb), cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"], cfg["rms_eps"]
    x = np.concatenate([emb, feat], 1) @ t["fc"].T
    h = _rms(x, t["attn_norm"], eps)
    q = _rope((h @ t["q"].T).reshape(n, nh, hd), pos, cfg["rope_theta"])
    k = np.repeat(_rope((h @ t["k"].T).reshape(n, nkv, hd), pos, cfg["rope_theta"]), nh // nkv, 1)
    v = np.repeat((h @ t["v"].T).reshape(n, nkv, hd), nh // nkv, 1)
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + np.triu(np.full((n, n), -np.inf), 1)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    x = x + np.einsum("hqk,khd->qhd", a, v).reshape(n, -1) @ t["o"].T
    h = _rms(x, t["ffn_norm"], eps)
    g = h @ t["gate"].T
    return x + (g / (1 + np.exp(-g)) * (h @ t["up"].T)) @ t["down"].T


def test_eagle_module_matches_float64_numpy_reference_of_the_exported_file(tmp_path):
    from engine.gguf_loader import ModelConfig
    from proposers.training.objectives import causal_mask

    shape = HeadShape("eagle", 1, hidden_size=48, num_heads=6, num_kv_heads=2, head_dim=8, intermediate_size=80,
                      rms_eps=1e-5, rope_theta=500.0)
    rng = np.random.default_rng(1)
    vocab, n = 90, 11
    embed, lm_head = rng.standard_normal((vocab, 48)), rng.standard_normal((vocab, 48))
    draft_vocab = np.sort(rng.choice(vocab, 40, replace=False)).astype(np.int32)
    head = DraftHead(shape, torch.tensor(embed, dtype=torch.float32),
                     torch.tensor(lm_head[draft_vocab], dtype=torch.float32))
    with torch.no_grad():  # random weights everywhere, rounded to what the float16 file holds
        for p in head.parameters():
            p.copy_((torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0)).half().float())
    target = ModelConfig("llama", "t", 2, 48, 80, 6, 2, 8, 8, 500.0, 1.0, 1e-5, vocab, 64, True)
    path = export_head(head, head_config(head, "t", target, draft_vocab, {}), draft_vocab, tmp_path, "h")
    loaded = load_head(path, hidden_size=48, vocab_size=vocab)
    t = {k: v.astype(np.float64) for k, v in loaded.module(0).items()}
    cfg = loaded.config

    tokens, feats = rng.integers(0, vocab, n + 1), rng.standard_normal((n, 48))
    pos = np.arange(n)
    with torch.no_grad():
        m = head.m[0]
        z, (k1, v1) = m(head.embed[torch.tensor(tokens[1:])][None], torch.tensor(feats, dtype=torch.float32)[None],
                        torch.tensor(pos)[None])
        drafts = torch.tensor(rng.integers(0, vocab, (2, n)))  # two draft tokens continuing each start
        z2, kv2 = m(head.embed[drafts[:1]], z, torch.tensor(pos + 1)[None], (k1, v1, causal_mask(n)))
        z3, _ = m(head.embed[drafts[1:]], z2, torch.tensor(pos + 2)[None], (k1, v1, causal_mask(n)), [kv2])
        logits = head.logits(z)[0].numpy()

    ref = reference_eagle(t, cfg, embed[tokens[1:]], feats, pos)
    assert np.abs(z[0].numpy() - ref).max() < 1e-4 * np.abs(ref).max()
    ref_logits = ref @ lm_head[loaded.tensors["draft_vocab"]].T
    assert np.abs(logits - ref_logits).max() < 1e-4 * np.abs(ref_logits).max()
    for p in (0, 4, n - 1):  # drafting from start p: rows 0..p teacher-forced, then draft rows at p+1, p+2
        emb2 = np.concatenate([embed[tokens[1: p + 2]], embed[drafts[0, p].item()][None]])
        feat2 = np.concatenate([feats[: p + 1], ref[p][None]])
        ref2 = reference_eagle(t, cfg, emb2, feat2, np.arange(p + 2))[-1]
        assert np.abs(z2[0, p].numpy() - ref2).max() < 1e-4 * np.abs(ref2).max()
        emb3 = np.concatenate([emb2, embed[drafts[1, p].item()][None]])
        ref3 = reference_eagle(t, cfg, emb3, np.concatenate([feat2, ref2[None]]), np.arange(p + 3))[-1]
        assert np.abs(z3[0, p].numpy() - ref3).max() < 1e-4 * np.abs(ref3).max()
    assert json.loads(path.with_suffix(".json").read_text())["kind"] == "eagle"
