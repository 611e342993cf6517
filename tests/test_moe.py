"""Mixture-of-experts parts: the router's top-k, the grouping of tokens by expert, and what the loader reads
and refuses. The whole forward is checked against transformers on the qwen3moe and qwen2moe fixtures, and its
batch invariance, in tests/test_architectures.py."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from engine.kernels import moe
from engine.model.gguf_loader import GGUFModel

FIXTURES = Path(__file__).parent / "fixtures" / "arch"


def _reference_route(logits: np.ndarray, top_k: int, renorm: bool) -> tuple[np.ndarray, np.ndarray]:
    p = np.exp(logits.astype(np.float64) - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    sel = np.argsort(-p, axis=-1, kind="stable")[:, :top_k]  # ties: the lower id first
    w = np.take_along_axis(p, sel, -1)
    return sel, w / w.sum(-1, keepdims=True) if renorm else w


@pytest.mark.parametrize("renorm", [True, False])
def test_route_picks_the_top_k_by_softmax(renorm):
    """Over the experts' columns only: a column after them (a shared expert's gate) is neither picked nor in the
    softmax, however large."""
    logits = np.random.default_rng(1).standard_normal((33, 17)).astype(np.float32)
    logits[0, 3] = logits[0, 9] = 9.0  # a tie: expert 3 first
    logits[:, 16] = 50.0
    sel, wts = np.zeros((33, 4), np.int64), np.zeros((33, 4), np.float32)
    moe.route(logits, 16, 4, renorm, sel, wts)
    want_sel, want_w = _reference_route(logits[:, :16], 4, renorm)
    np.testing.assert_array_equal(sel, want_sel)
    np.testing.assert_allclose(wts, want_w, rtol=1e-5)
    assert list(sel[0, :2]) == [3, 9]


def test_group_lists_each_experts_tokens_in_order():
    sel = np.array([[2, 0], [0, 1], [2, 1], [0, 2]], np.int64)
    wts = np.arange(8, dtype=np.float32).reshape(4, 2)
    start, fill = np.zeros(4, np.int64), np.zeros(3, np.int64)
    order_t, order_w = np.zeros(8, np.int64), np.zeros(8, np.float32)
    moe.group(sel, wts, start, fill, order_t, order_w)
    assert list(start) == [0, 3, 5, 8]
    assert list(order_t) == [0, 1, 3, 1, 2, 0, 2, 3]  # expert 0: tokens 0, 1, 3; expert 1: 1, 2; expert 2: 0, 2, 3
    assert list(order_w) == [1, 2, 6, 3, 5, 0, 4, 7]


def test_loader_reads_the_experts():
    model = GGUFModel(FIXTURES / "qwen3moe.gguf")
    cfg = model.config
    assert (cfg.num_experts, cfg.num_experts_used, cfg.expert_intermediate_size, cfg.expert_weights_norm) == (8, 3, 64, True)
    router, gate_up, down, shared = model.experts(1)
    assert shared is None and cfg.shared_expert_intermediate_size == 0
    assert [int(d) for d in router.shape] == [64, 8] and len(gate_up) == len(down) == 8
    gate, up = gate_up[5]
    assert (gate.shape, up.shape, down[5].shape) == ((64, 64), (64, 64), (64, 64))
    stacked = model.tensor("blk.1.ffn_up_exps.weight")
    np.testing.assert_array_equal(up.data, np.asarray(stacked.data)[5])  # expert 5's rows of the stack
    assert GGUFModel(FIXTURES / "qwen3.gguf").experts(0) is None


def test_loader_reads_a_shared_expert_and_qwen2moe_keeps_the_top_k_weights():
    """Qwen2-MoE: llama.cpp does not renormalize its chosen experts' weights (the file says nothing), and each
    layer has a shared expert 96 wide with its gate's row."""
    model = GGUFModel(FIXTURES / "qwen2moe.gguf")
    cfg = model.config
    assert (cfg.num_experts, cfg.num_experts_used, cfg.expert_intermediate_size, cfg.expert_weights_norm,
            cfg.shared_expert_intermediate_size) == (8, 2, 64, False, 96)
    *_, (gate_row, gate, up, down) = model.experts(0)
    shapes = [tuple(int(d) for d in t.shape) for t in (gate, up, down)]  # ggml order: [in, out]
    assert gate_row.shape == (64,) and shapes == [(64, 96), (64, 96), (96, 64)]
    np.testing.assert_array_equal(gate_row, model.dense("blk.0.ffn_gate_inp_shexp.weight").reshape(-1))


def _small_moe(path: Path, **keys) -> Path:
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    for add, value in ((writer.add_block_count, 1), (writer.add_embedding_length, 64), (writer.add_head_count, 4),
                       (writer.add_feed_forward_length, 128), (writer.add_layer_norm_rms_eps, 1e-5),
                       (writer.add_expert_count, 8)):
        add(value)
    for key, value in keys.items():
        writer.add_uint32(f"qwen3moe.{key}", value)
    writer.add_tensor("token_embd.weight", np.zeros((300, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_loader_refuses_what_it_cannot_route(tmp_path):
    with pytest.raises(ValueError, match="expert_used_count must be in 1..8, got 9"):
        GGUFModel(_small_moe(tmp_path / "nine.gguf", expert_used_count=9))
    with pytest.raises(ValueError, match="expert_gating_func 2"):
        GGUFModel(_small_moe(tmp_path / "sigmoid.gguf", expert_used_count=2, expert_gating_func=2))
    assert GGUFModel(_small_moe(tmp_path / "ok.gguf", expert_used_count=2)).config.expert_intermediate_size == 128


def test_gpu_backend_refuses_experts():
    """Also a llama file with experts (Mixtral), whose architecture the GPU backend otherwise runs."""
    import dataclasses

    from engine.gpu.runner import _check_config
    from engine.model.architectures import ARCHITECTURES

    cfg = GGUFModel(FIXTURES / "qwen3moe.gguf").config
    with pytest.raises(ValueError, match="architecture 'qwen3moe'"):
        _check_config(cfg, "float16", None, 256, False)
    with pytest.raises(ValueError, match="8 experts: the GPU backend runs dense models"):
        _check_config(dataclasses.replace(cfg, arch=ARCHITECTURES["llama"]), "float16", None, 256, False)


@pytest.fixture(scope="module")
def moe_engines():
    """The qwen3moe fixture served plain and with each method (several requests at once, so that the experts
    run on tokens of different requests in one step)."""
    import json

    from conftest import engine_args

    from engine.llm_engine import LLMEngine

    def make(spec=None, arch="qwen3moe"):
        return LLMEngine.from_args(engine_args(model=str(FIXTURES / f"{arch}.gguf"), max_model_len=128,
                                               speculative_config=json.dumps(spec) if spec else None))

    return make


@pytest.mark.parametrize("arch, spec", [("qwen3moe", {"method": "ngram", "num_speculative_tokens": 4}),
                                        ("qwen3moe", {"method": "draft_model", "draft_layers": 1,
                                                      "num_speculative_tokens": 3}),
                                        ("qwen2moe", {"method": "ngram", "num_speculative_tokens": 4})],
                         ids=lambda v: v if isinstance(v, str) else v["method"])
def test_greedy_speculation_on_experts_equals_plain_decoding(moe_engines, arch, spec):
    """Verifying a step's drafts routes each of its tokens alone (and runs Qwen2-MoE's shared expert on each
    row alone), so the outputs are plain decoding's, token for token, with drafts accepted along the way."""
    from engine.generate import generate
    from engine.serving.protocol import SamplingParams

    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [40, 41, 42, 43, 40, 41], [200, 3, 200, 3, 200]]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = generate(moe_engines(arch=arch), prompts, params)
    spec_out = generate(moe_engines(spec, arch), prompts, params)
    assert [c.token_ids for c in spec_out] == [c.token_ids for c in plain]
    assert sum(c.num_accepted_tokens for c in spec_out) > 0
