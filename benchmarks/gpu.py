"""`speculant bench gpu`: the GPU runner's numbers (needs a CUDA device; see benchmarks/gpu_notes.md).

Prints, for one model on one GPU:
  * step latency (ms) of a decode step at batch 1, 8 and 64 over a `--context`-token cache,
    with the host logits copy and without it (device logits, as verify_device uses them);
  * the verify curve: ms per forward appending T tokens (T = 1..16) to one request;
  * decode tokens/s through the engine at batch 1 and 8, plain and with n-gram speculation;
  * the attention kernel's achieved bandwidth (KV bytes read / kernel time, CUDA events) next to
    the device's measured copy bandwidth, the ceiling for a memory-bound kernel;
  * with `--peers` and torch + transformers installed: transformers fp16 on the same GPU,
    plain greedy and with prompt_lookup_num_tokens (its n-gram speculation), batch 1.
"""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import numpy as np

BATCHES = (1, 8, 64)
VERIFY_TS = (1, 2, 4, 8, 16)


def parse(argv):
    p = argparse.ArgumentParser(prog="speculant bench gpu")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context", type=int, default=512, help="cached tokens per request")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--batch-invariant", action="store_true")
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--peers", action="store_true", help="also time transformers on this GPU if installed")
    p.add_argument("--json", default=None, help="write the results here as JSON")
    return p.parse_args(argv)


def engine_args(args, **overrides):
    values = dict(
        model=args.model, max_model_len=max(4160, args.context + args.decode_tokens + 64), kv_cache_memory=4.0,
        block_size=16,
        max_num_seqs=max(BATCHES), max_num_batched_tokens=1024, threads=0, device="cuda",
        speculative_config=None, served_model_name=None, gpu_dtype=args.dtype, gpu_memory_utilization=None,
        gpu_batch_invariant=args.batch_invariant, no_cuda_graphs=args.no_cuda_graphs,
    )
    values.update(overrides)
    return SimpleNamespace(**values)


def median_ms(fn, repeats: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return 1000 * float(np.median(times))


def prefill(runner, num_reqs: int, context: int) -> list[list[int]]:
    """Give `num_reqs` requests `context` cached tokens each (disjoint blocks); returns their tables."""
    from engine.model.cpu_runner import ForwardBatch

    per = -(-(context + 32) // runner.cache.block_size)
    if per * num_reqs > runner.cache.num_blocks:
        raise ValueError(f"--context {context} x {num_reqs} requests needs {per * num_reqs} KV blocks")
    tables = [list(range(r * per, (r + 1) * per)) for r in range(num_reqs)]
    ids = (np.arange(context) * 37 % 30000 + 100).astype(np.int32)
    budget = runner.cache.max_num_batched_tokens
    fb = ForwardBatch(runner.cache)
    for r in range(num_reqs):
        for start in range(0, context, budget):  # chunked prefill, one request per forward
            fb.clear()
            fb.add(ids[start : start + budget], start, tables[r], 1)
            runner.forward(fb)
    return tables


def step_latency(runner, context: int, repeats: int) -> dict:
    from engine.model.cpu_runner import ForwardBatch

    out, sync = {}, runner.stream.synchronize
    tables = prefill(runner, max(BATCHES), context)
    for b in BATCHES:
        fb = ForwardBatch(runner.cache)
        for r in range(b):
            fb.add(np.array([7], np.int32), context, tables[r], 1)
        out[b] = {"with_logits_copy_ms": median_ms(lambda: runner.forward(fb), repeats, sync),
                  "device_only_ms": median_ms(lambda: runner.forward_device(fb), repeats, sync)}
    return out


def verify_curve(runner, context: int, repeats: int) -> dict:
    from engine.model.cpu_runner import ForwardBatch

    (table,) = prefill(runner, 1, context)
    out = {}
    for t in VERIFY_TS:
        fb = ForwardBatch(runner.cache)
        fb.add(np.arange(t, dtype=np.int32) + 7, context, table, t)
        out[t] = median_ms(lambda: runner.forward(fb), repeats, runner.stream.synchronize)
    return {"ms": out, "ratio": {t: v / out[1] for t, v in out.items()}}


def copy_bandwidth_gbs(cp, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy: reads + writes 2 * nbytes; best of 5."""
    a, b = cp.ones(nbytes // 4, np.float32), cp.empty(nbytes // 4, np.float32)
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    best = float("inf")
    for _ in range(5):
        start.record()
        cp.copyto(b, a)
        stop.record()
        stop.synchronize()
        best = min(best, cp.cuda.get_elapsed_time(start, stop) / 1000)
    return 2 * nbytes / best / 1e9


def attention_bandwidth(runner, cp, context: int, batch: int, repeats: int) -> dict:
    """Layer-0 append attention for `batch` decode queries over `context` keys each."""
    from engine.model.cpu_runner import ForwardBatch

    tables = prefill(runner, batch, context)
    fb = ForwardBatch(runner.cache)
    for r in range(batch):
        fb.add(np.array([7], np.int32), context, tables[r], 1)
    runner.forward(fb)  # stages the batch and builds the token metadata the kernel reads
    cfg, b, (k_cache, v_cache) = runner.config, runner.bufs, runner.kv_layers[0]
    splits = -(-(context + 1) // runner.partition_size)

    def launch():
        with runner.stream:
            runner.kernels.attention(b.qkv, k_cache, v_cache, b.block_tables, b.meta, cfg, runner.cache.block_size,
                                     runner.partition_size, b.max_splits, splits, b.attn, b.part_acc, b.part_ml, batch)

    launch()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record(runner.stream)
    for _ in range(repeats):
        launch()
    stop.record(runner.stream)
    stop.synchronize()
    seconds = cp.cuda.get_elapsed_time(start, stop) / 1000 / repeats
    kv_bytes = batch * (context + 1) * cfg.kv_size * 2 * k_cache.itemsize  # K and V of every key, once
    return {"batch": batch, "context": context, "us": seconds * 1e6, "gbs": kv_bytes / seconds / 1e9}


def decode_rate(eng, prompt_ids, batch: int, num_tokens: int) -> float:
    from engine.generate import generate
    from engine.serving.protocol import SamplingParams

    # warm-up at the timed batch: the first batched (and speculative) steps compile the CPU-side kernels
    generate(eng, [prompt_ids] * batch, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    start = time.perf_counter()
    done = generate(eng, [prompt_ids] * batch, SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True))
    return sum(len(c.token_ids) for c in done) / (time.perf_counter() - start)


def transformers_rates(path, prompt_ids, num_tokens: int) -> dict | None:
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=torch.float16)
    model = model.to("cuda").eval()
    ids = torch.tensor([prompt_ids], device="cuda")
    out = {}
    for name, extra in (("plain", {}), ("prompt_lookup_10", {"prompt_lookup_num_tokens": 10})):
        with torch.no_grad():
            model.generate(ids, max_new_tokens=4, do_sample=False, **extra)
            torch.cuda.synchronize()
            start = time.perf_counter()
            gen = model.generate(ids, max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False, **extra)
            torch.cuda.synchronize()
        out[name] = (gen.shape[1] - ids.shape[1]) / (time.perf_counter() - start)
    return out


def main(argv=None) -> int:
    args = parse(argv or [])
    import cupy as cp

    from engine.llm_engine import LLMEngine
    from engine.model.model_files import resolve_model
    from engine.spec_decode.verify import compile_kernels

    eng = LLMEngine.from_args(engine_args(args))
    compile_kernels()  # as the served engine's warm-up does: no timed step compiles the batched verifier
    runner = eng.runner
    prompt_ids = (np.arange(args.context) * 37 % 30000 + 100).tolist()
    res = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "dtype": args.dtype,
           "weight_bytes": int(runner.weight_bytes), "graph_sizes": sorted(runner.graphs)}
    res["step_latency"] = step_latency(runner, args.context, args.repeats)
    res["verify_curve"] = verify_curve(runner, args.context, args.repeats)
    res["copy_bandwidth_gbs"] = copy_bandwidth_gbs(cp)
    res["attention"] = [attention_bandwidth(runner, cp, c, b, args.repeats) for b, c in ((1, 4096), (64, args.context))
                        if c + 1 <= runner.cache.max_model_len]
    res["decode_tok_s"] = {b: decode_rate(eng, prompt_ids, b, args.decode_tokens) for b in (1, 8)}
    spec = LLMEngine.from_args(engine_args(args, speculative_config=json.dumps(
        {"method": "ngram", "num_speculative_tokens": 5, "max_ngram_size": 4, "min_ngram_size": 1})))
    res["decode_tok_s_ngram"] = {b: decode_rate(spec, prompt_ids, b, args.decode_tokens) for b in (1, 8)}
    if args.peers:
        res["transformers_fp16_tok_s_b1"] = transformers_rates(resolve_model(args.model), prompt_ids, args.decode_tokens)
    print(json.dumps(res, indent=2, default=str))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2, default=str)
    return 0
