"""Build an engine's parts from command-line style arguments: model, cache, runner, proposer."""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.core.block_manager import BlockManager
from engine.core.scheduler import Scheduler
from engine.model.cpu_runner import CacheConfig, CpuRunner, ForwardBatch
from engine.model.gguf_loader import GGUFModel
from engine.model.model_files import resolve_model
from engine.model.runner_api import ModelRunner
from engine.model.tokenizer import Tokenizer
from engine.spec_decode.spec_control import DraftController

log = logging.getLogger("speculant.engine")


@dataclass
class EngineParts:
    model_name: str
    cache: CacheConfig
    tokenizer: Any
    runner: CpuRunner
    scheduler: Scheduler
    proposer: Any
    spec: Any
    controller: DraftController
    bind: Any  # bind(proposer): hand a proposer the target (for proposers built later)


def cache_config(args, model: GGUFModel) -> CacheConfig:
    cfg = model.config
    if args.max_model_len < 2:
        raise ValueError("max_model_len must be >= 2")
    if args.block_size < 1 or args.max_num_seqs < 1 or args.max_num_batched_tokens < 1:
        raise ValueError("block_size, max_num_seqs and max_num_batched_tokens must be >= 1")
    max_model_len = min(args.max_model_len, cfg.context_length)
    per_block = CpuRunner.kv_bytes_per_block(cfg, args.block_size, getattr(args, "numerics", "int8"),
                                             getattr(args, "kv_cache_dtype", "auto"))
    num_blocks = int(args.kv_cache_memory * 2**30) // per_block
    needed = -(-max_model_len // args.block_size) + 1
    if num_blocks < needed:
        raise ValueError(
            f"kv_cache_memory={args.kv_cache_memory} GiB holds {num_blocks} blocks; one request of "
            f"max_model_len={max_model_len} needs {needed}: raise --kv-cache-memory or lower --max-model-len"
        )
    return CacheConfig(args.block_size, num_blocks, max_model_len, args.max_num_seqs, args.max_num_batched_tokens)


def measure_verify_curve(runner: CpuRunner, max_t: int, repeats: int = 7, context: int = 256) -> tuple[np.ndarray, float]:
    """(cost, t1): cost[T] = forward time with T appended tokens / with 1 token, at a realistic
    context; t1 = the seconds of a T = 1 forward.

    Samples are interleaved across T and the minimum kept (noise only ever adds time), and
    the curve is made non-decreasing: verifying more tokens never costs less. Also warms the JIT.
    """
    fb = ForwardBatch(runner.cache)
    context = max(1, min(context, runner.cache.max_model_len - max_t - 2))
    table = list(range(-(-(context + max_t + 1) // runner.cache.block_size)))
    fb.add(np.zeros(context, np.int32), 0, table, 1)  # fills the context's KV (blocks are free at start-up)
    runner.forward(fb)
    best = np.full(max_t + 2, np.inf)
    for _ in range(repeats):
        for t in range(1, max_t + 2):
            fb.clear()
            fb.add(np.zeros(t, np.int32), context, table, t)
            start = time.perf_counter()
            runner.forward(fb)
            best[t] = min(best[t], time.perf_counter() - start)
    best[0] = best[1]
    return np.maximum.accumulate(best / best[1]), float(best[1])


def make_runner(model: GGUFModel, cache: CacheConfig, args):
    """The CPU runner, or the GPU runner for --device cuda (or auto with a device present)."""
    device = getattr(args, "device", "cpu")
    if device == "auto":
        from engine.gpu import cuda_available

        device = "cuda" if cuda_available() else "cpu"
    if device == "cuda":
        from engine.gpu import make_gpu_runner

        return make_gpu_runner(model, cache, args)
    from engine.spec_decode.verify import compile_kernels

    return CpuRunner(model, cache, getattr(args, "threads", 0), numerics=getattr(args, "numerics", "int8"),
                     kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"), compile_also=(compile_kernels,))


def bind_proposer(proposer, model: GGUFModel, runner: ModelRunner, cache: CacheConfig) -> None:
    """Give a proposer the target (model-based ones load weights here); turn on hidden-state capture."""
    from proposers.base import TargetModel

    proposer.bind_target(TargetModel(model, runner, cache, runner.numerics))
    if proposer.uses_hidden_states:
        if not runner.provides_hidden_states:
            raise ValueError(f"speculative_config.method: {type(proposer).__name__} needs the target's hidden "
                             f"states, which the {type(runner).__name__} backend does not provide")
        runner.capture_hidden = True


def build_engine_parts(args) -> EngineParts:
    spec = None
    if getattr(args, "speculative_config", None):
        from engine.spec_decode.spec_config import parse_speculative_config

        spec = parse_speculative_config(args.speculative_config)
    path = resolve_model(args.model)
    model = GGUFModel(path)
    tokenizer = Tokenizer.from_gguf(path, model.metadata)
    cache = cache_config(args, model)
    proposer, max_k, budget = None, 0, 0
    if spec is not None:  # options are checked before the (slow) weight packing
        from proposers.registry import load_proposer_class

        proposer = load_proposer_class(spec.method)(spec, model.config.vocab_size)
        proposer.check_target(model)
    runner = make_runner(model, cache, args)
    cache = runner.cache  # a GPU runner sizes num_blocks from free device memory
    blocks = BlockManager(cache.num_blocks, cache.block_size)
    scheduler = Scheduler(blocks, cache.max_num_seqs, cache.max_num_batched_tokens, cache.max_model_len,
                          getattr(args, "scheduling_policy", "fcfs"))
    if spec is not None:
        bind_proposer(proposer, model, runner, cache)
        max_k = spec.num_speculative_tokens
        budget = spec.max_draft_tokens_per_step
    max_k = min(max_k, max(cache.max_num_batched_tokens - 1, 0), 16)
    curve, t1 = measure_verify_curve(runner, min(max_k, 16)) if max_k else (None, 0.0)
    if curve is not None:
        log.info("verify curve (cost relative to T=1 = %.2f ms): %s", t1 * 1e3, np.round(curve[1:], 2).tolist())
    name = getattr(args, "served_model_name", None) or args.model
    log.info("model %s: %s, %d KV blocks of %d tokens", name, model.config.name, cache.num_blocks, cache.block_size)
    bind = functools.partial(bind_proposer, model=model, runner=runner, cache=cache)
    return EngineParts(name, cache, tokenizer, runner, scheduler, proposer, spec,
                       DraftController(max_k, budget, curve, t1, spec.adaptive if spec else True), bind)
