"""Shared fixtures: the default model file and its tokenizer, resolved once per session."""

from __future__ import annotations

import pathlib
from types import SimpleNamespace

import pytest

from engine.model.model_files import resolve_model
from engine.model.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def model_path() -> pathlib.Path:
    """The default GGUF (downloaded into the cache on first use)."""
    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def tokenizer(model_path: pathlib.Path) -> Tokenizer:
    return Tokenizer.from_gguf(model_path)


# ---------------------------------------------------------------- a module's HTTP cluster (its own `cluster` fixture)


@pytest.fixture(scope="module")
def client(cluster):
    """The openai client on the module's gateway (tests/servers.py `Cluster`)."""
    import openai

    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    """The name the module's gateway serves."""
    (entry,) = client.models.list().data
    return entry.id


# ---------------------------------------------------------------- engines (real model, loaded once per session)


def engine_args(**overrides) -> SimpleNamespace:
    args = dict(
        model="smollm2-135m", max_model_len=1024, kv_cache_memory=0.25, block_size=16, max_num_seqs=16,
        max_num_batched_tokens=256, threads=0, device="cpu", speculative_config=None, served_model_name=None,
        numerics="int8", kv_cache_dtype="auto",
    )
    args.update(overrides)
    return SimpleNamespace(**args)


@pytest.fixture(scope="session")
def engine(model_path):
    from engine.llm_engine import LLMEngine

    return LLMEngine.from_args(engine_args())


@pytest.fixture(scope="session")
def runner(engine):
    return engine.runner


@pytest.fixture(scope="session")
def exact_engine(model_path):
    """The same model under --numerics exact (strict float32 products, float32 KV cache)."""
    from engine.llm_engine import LLMEngine

    return LLMEngine.from_args(engine_args(numerics="exact"))


@pytest.fixture(scope="session")
def int8_kv_engine(model_path):
    """The default engine with --kv-cache-dtype int8 (q8_0 blocks in the KV cache)."""
    from engine.llm_engine import LLMEngine

    return LLMEngine.from_args(engine_args(kv_cache_dtype="int8"))


@pytest.fixture(scope="session", params=["int8", "exact", "int8-kv"])
def any_engine(request):
    """Each numerics mode in turn (the default int8 engine, then the exact one), then int8 with an int8 KV cache."""
    return request.getfixturevalue({"int8": "engine", "exact": "exact_engine", "int8-kv": "int8_kv_engine"}[request.param])


@pytest.fixture(scope="session")
def small_budget_engine(model_path):
    from engine.llm_engine import LLMEngine

    return LLMEngine.from_args(engine_args(max_num_batched_tokens=16))


@pytest.fixture(scope="session")
def tiny_cache_engine(model_path):
    """Eight KV blocks for six requests: the scheduler must preempt."""
    from engine.model.cpu_runner import CpuRunner
    from engine.llm_engine import LLMEngine

    per_block = CpuRunner.kv_bytes_per_block(_smollm_config(model_path), 16)
    return LLMEngine.from_args(engine_args(max_model_len=64, kv_cache_memory=8 * per_block / 2**30))


def _smollm_config(path):
    from engine.model.gguf_loader import GGUFModel

    return GGUFModel(path).config


@pytest.fixture(scope="session")
def make_engine(model_path):
    """Build an extra engine with some flags changed (each costs a model load: use sparingly)."""
    from engine.llm_engine import LLMEngine

    return lambda **overrides: LLMEngine.from_args(engine_args(**overrides))
