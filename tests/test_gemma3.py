"""The real Gemma 3 270M (Q4_K_M GGUF from PyPI chunk wheels): a second architecture end to end.

- exact numerics reproduce transformers float32 loading the same GGUF (top-1 identical at every
  position of three prompts of 100-812 tokens, the longest past the 512-key sliding window); int8
  agrees on top-1 at >= 95% of them (llama.cpp on the same file: 93.5 / 97.0 / 99.6%);
- a request's logits are the same bits one token per step, T per step, in prefill chunks, alone or in
  a ragged batch, on a prompt longer than the sliding window;
- through HTTP, greedy output with ngram, suffix and draft_layers speculation equals plain decoding,
  alone and under concurrency.
Reference logits: tests/fixtures/make_gemma3_golden.py (transformers; the test needs no torch).
"""

from __future__ import annotations

import concurrent.futures
import json
from pathlib import Path

import numpy as np
import openai
import pytest
from conftest import engine_args
from servers import Cluster
from test_runtime_invariance import feed

from engine.model.cpu_runner import CacheConfig, CpuRunner, ForwardBatch
from engine.model.gguf_loader import GGUFModel
from engine.model.model_files import resolve_model

pytestmark = pytest.mark.slow
GOLDEN = Path(__file__).parent / "fixtures" / "gemma3_logits_golden.npz"


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    return resolve_model("gemma3-270m")


@pytest.fixture(scope="session")
def gemma_engine(gemma_path):
    from engine.llm_engine import LLMEngine

    return LLMEngine.from_args(engine_args(model=str(gemma_path), max_model_len=1024, max_num_batched_tokens=320))


def golden_logits(runner: CpuRunner, ids: np.ndarray) -> np.ndarray:
    batch = ForwardBatch(runner.cache)
    batch.add(ids, 0, np.arange(runner.cache.max_blocks_per_seq, dtype=np.int32), len(ids))
    return runner.forward(batch)


@pytest.mark.parametrize("numerics", ["exact", "int8"])
def test_logits_match_transformers(gemma_path, numerics):
    golden = np.load(GOLDEN)
    cache = CacheConfig(block_size=16, num_blocks=64, max_model_len=1024, max_num_seqs=1, max_num_batched_tokens=1024)
    runner = CpuRunner(GGUFModel(gemma_path), cache, num_threads=2, numerics=numerics)
    for i in range(3):
        ids = golden[f"ids_{i}"]
        assert len(ids) >= 100
        logits = golden_logits(runner, ids)  # [n, vocab]
        same_top1 = logits.argmax(-1) == golden[f"top1_{i}"]
        if numerics == "exact":
            assert same_top1.all(), np.flatnonzero(~same_top1)
            assert np.abs(logits[:, golden["probe_ids"]] - golden[f"probe_logits_{i}"]).max() < 2e-3
        else:
            assert same_top1.mean() >= 0.95, same_top1.mean()


def test_batching_never_changes_logits_past_the_window(gemma_engine):
    config = gemma_engine.runner.config
    assert config.sliding_window == 512 and len(config.local_layers) == 15
    tokens = np.random.default_rng(3).integers(0, config.vocab_size, 560).astype(np.int32)
    columns = np.random.default_rng(4).choice(config.vocab_size, 2048, replace=False)
    others = {f"o{i}": np.random.default_rng(i).integers(0, config.vocab_size, 200).astype(np.int32) for i in range(2)}
    reference = feed(gemma_engine, tokens, [256, 256] + [1] * 48, columns=columns)
    for chunks, with_others in (([256, 256] + [4] * 12, False), ([200, 250, 62, 3, 5, 8, 32], False),
                                ([256, 256] + [1, 4, 2, 8] * 3 + [3], True)):
        got = feed(gemma_engine, tokens, chunks, others if with_others else None, columns=columns)
        assert np.array_equal(got, reference), chunks


PROMPTS = [
    "Copy this list exactly: alpha, beta, gamma, delta, alpha, beta, gamma, delta, alpha, beta,",
    "def square(x):\n    return x * x\n\ndef cube(x):\n    return x * x * x\n\ndef fourth(x):\n",
    "Write one sentence about the sea.",
]
METHODS = [{"method": "ngram", "num_speculative_tokens": 4, "max_ngram_size": 3, "min_ngram_size": 1},
           {"method": "suffix", "num_speculative_tokens": 5},
           {"method": "draft_model", "draft_layers": 6, "num_speculative_tokens": 3}]


@pytest.mark.parametrize("spec", METHODS, ids=lambda m: m["method"] + ("_layers" if "draft_layers" in m else ""))
def test_greedy_speculation_over_http_equals_plain_decoding(tmp_path, gemma_path, spec):
    cluster = Cluster(tmp_path, gemma_path)
    cluster.start("gateway", "gateway")
    cluster.start_worker("w1", "--speculative-config", json.dumps(spec), "--max-model-len", "1024")
    try:
        cluster.wait_workers(1)
        client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id

        def complete(prompt: str, n_max: int | None):
            extra = {} if n_max is None else {"speculative": {"n_max": n_max}}
            return client.completions.create(model=model, prompt=prompt, max_tokens=40, temperature=0,
                                             extra_body=extra)

        plain = [complete(p, 0) for p in PROMPTS]
        alone = [complete(p, None) for p in PROMPTS]
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS) * 2) as pool:
            together = list(pool.map(complete, PROMPTS * 2, [None] * len(PROMPTS) * 2))
        want = [r.choices[0].text for r in plain]
        assert [r.choices[0].text for r in alone] == want
        assert [r.choices[0].text for r in together] == want * 2
        assert sum(r.usage.model_extra["speculative"]["num_drafts"] for r in alone) > 0
    finally:
        cluster.stop_all()
