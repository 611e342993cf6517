"""`speculant bench model`: the CPU model runtime's numbers, printed side by side.

Prints prefill tokens/s (a fresh `--prefill-tokens` prompt), decode tokens/s at batch 1 and 8,
the verify curve (ms per forward for T appended tokens at a `--context`-token context), a decode
step at `--long-context` cached tokens against one at `--context` and that step's attention from cold
caches against a plain read of its K/V (benchmarks/attention_rate.py), the compute rate the weight
products reach against the CPU's peak for their integer 4-dot (benchmarks/compute_rate.py), peak RSS,
and the floor:
bytes of weights streamed per step / this machine's measured read bandwidth. It names the CPU
and the kernel path taken (`--numerics int8`: integer products; `exact`: float32).

With `--peers`, llama.cpp (llama-cpp-python, same GGUF, same threads) takes the same
measurements in its own process (benchmarks/model_peer.py) and the report gives our ratio to
it; transformers fp32 decode is timed too when it is installed.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from types import SimpleNamespace

import numpy as np

import engine  # noqa: F401

VERIFY_TS = (1, 2, 4, 6, 8, 16)
BURST = 8  # forwards per case and round, back to back; the first half is not timed (see step_rounds)


def parse(argv):
    p = argparse.ArgumentParser(prog="speculant bench model")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--prefill-tokens", type=int, default=500, help="prompt length of the prefill measurement")
    p.add_argument("--long-context", type=int, default=2000, help="cached tokens of the long decode step (0: skip)")
    p.add_argument("--numerics", choices=("int8", "exact"), default="int8")
    p.add_argument("--kv-cache-dtype", choices=("auto", "float16", "float32", "int8"), default="auto")
    p.add_argument("--peers", action="store_true", help="also time llama.cpp (and transformers fp32) if installed")
    p.add_argument("--json", default=None, help="write the results here as JSON")
    args = p.parse_args(argv)
    for name, least in (("context", 1), ("decode_tokens", 1), ("repeats", 1), ("threads", 0), ("prefill_tokens", 1),
                        ("long_context", 0)):
        if getattr(args, name) < least:
            p.error(f"--{name.replace('_', '-')} must be >= {least}, got {getattr(args, name)}")
    return args


def read_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Best-of-3 read bandwidth over a 1 GiB float32 array: each thread sums its contiguous share in
    16-lane vectors, four independent sums, so the loads set the rate. (The previous probe, a float64
    `+=` over the elements, was bound by its own conversions and adds: on the Xeon it read 21.8 GB/s
    where this one reads 32, so the floor came out 1.5x too high and T = 1 ran at "0.84x floor".)"""
    import numba as nb

    from engine.kernels.simd import f32_add, f32_hsum, f32_zero, row_f32

    @nb.njit(parallel=True)
    def total(a, threads):
        parts = np.zeros(threads, np.float32)
        n = a.shape[0] // 64
        for t in nb.prange(threads):
            s0, s1, s2, s3 = f32_zero(1), f32_zero(1), f32_zero(1), f32_zero(1)
            for i in range(t * n // threads * 64, (t + 1) * n // threads * 64, 64):
                s0 = f32_add(s0, row_f32(a, i))
                s1 = f32_add(s1, row_f32(a, i + 16))
                s2 = f32_add(s2, row_f32(a, i + 32))
                s3 = f32_add(s3, row_f32(a, i + 48))
            parts[t] = f32_hsum(f32_add(f32_add(s0, s1), f32_add(s2, s3)))
        return parts.sum()

    a = np.ones(nbytes // 4 // 64 * 64, np.float32)
    threads = nb.get_num_threads()
    total(a[:4096], threads)
    best = min(_timed(lambda: total(a, threads)) for _ in range(3))
    return a.nbytes / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def engine_args(args, max_tokens):
    longest = max(args.context, args.long_context, args.prefill_tokens)
    return SimpleNamespace(
        model=args.model, max_model_len=max(2048, longest + max_tokens + 64), kv_cache_memory=1.0,
        block_size=16, max_num_seqs=16, max_num_batched_tokens=max(512, args.prefill_tokens), threads=args.threads,
        speculative_config=None, served_model_name=None, numerics=args.numerics, kv_cache_dtype=args.kv_cache_dtype,
    )


def verify_curve(runner, context: int, repeats: int, ts=VERIFY_TS) -> dict[int, float]:
    """Median ms of a forward that appends T tokens on top of `context` cached tokens."""
    times = step_rounds(runner, [(context, t) for t in ts], repeats)
    return {t: times[(context, t)] for t in ts}


def step_rounds(runner, cases: list[tuple[int, int]], repeats: int) -> dict[tuple[int, int], float]:
    """Median ms of each (context, T) case: a forward appending T tokens on top of `context` cached tokens.

    Each context is prefilled once into blocks of its own. The cases are timed in rounds (each case once
    per round, the order turned by one each round), so a slow phase of the machine weighs on every case
    alike. A case runs as a burst of BURST forwards back to back and only its second half counts, as in
    decoding, where each step repeats the one before: forwards right after a different case start with
    that case's data in the caches and would not time what a user's steady stream of steps costs (on the
    Xeon, after the 2,000-token case the 300-token step took 3.76, 3.53, 3.33, 3.27, 3.16 ms, then ~3.05
    from the sixth forward on)."""
    from engine.model.cpu_runner import ForwardBatch

    fb = ForwardBatch(runner.cache)
    tables = prefill_contexts(runner, cases)
    times = {case: [] for case in cases}
    for r in range(repeats):
        for context, t in cases[r % len(cases):] + cases[: r % len(cases)]:
            fb.clear()
            fb.add(np.arange(t, dtype=np.int32) + 7, context, tables[context], t)
            burst = [_timed(lambda: runner.forward(fb)) for _ in range(BURST)]
            times[(context, t)] += burst[BURST // 2:]
    return {case: 1000 * float(np.median(v)) for case, v in times.items()}


def context_tables(cases: list[tuple[int, int]], block_size: int) -> dict[int, list[int]]:
    """context -> its own blocks, in order of context, with room for the largest T of its (context, T) cases."""
    tables, first = {}, 0
    for context in sorted({c for c, _ in cases}):
        blocks = -(-(context + max(t for c, t in cases if c == context)) // block_size)
        tables[context] = list(range(first, first + blocks))
        first += blocks
    return tables


def prefill_contexts(runner, cases: list[tuple[int, int]]) -> dict[int, list[int]]:
    """Each context of the cases prefilled into its blocks (context_tables); returns the tables."""
    from engine.model.cpu_runner import ForwardBatch

    fb = ForwardBatch(runner.cache)
    chunk = runner.cache.max_num_batched_tokens
    tables = context_tables(cases, runner.cache.block_size)
    for context, table in tables.items():
        for start in range(0, context, chunk):  # prefilled in chunks the runner's buffers hold
            fb.clear()
            fb.add(np.arange(start, min(context, start + chunk), dtype=np.int32) % 1000, start, table, 1)
            runner.forward(fb)
    return tables


def model_steps(runner, args) -> dict:
    """The verify curve at --context and, in the same rounds, the decode step at --long-context."""
    cases = [(args.context, t) for t in VERIFY_TS] + ([(args.long_context, 1)] if args.long_context else [])
    times = step_rounds(runner, cases, args.repeats)
    out = {"verify_ms": {t: times[(args.context, t)] for t in VERIFY_TS}}
    if args.long_context:
        from benchmarks import attention_rate

        out["long_decode_ms"] = times[(args.long_context, 1)]
        table = context_tables(cases, runner.cache.block_size)[args.long_context]  # the blocks the long step read
        out["long_attention"] = attention_rate.measure(runner, args.long_context, table)
    return out


def decode_rate(eng, prompt_ids, batch: int, num_tokens: int) -> float:
    from engine.generate import generate
    from engine.serving.protocol import SamplingParams

    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    generate(eng, [prompt_ids], SamplingParams(max_tokens=2, temperature=0.0))  # prefix cache + JIT warm
    start = time.perf_counter()
    done = generate(eng, [prompt_ids] * batch, params)
    elapsed = time.perf_counter() - start
    return sum(len(c.token_ids) for c in done) / elapsed


def prefill_rate(eng, num_tokens: int, repeats: int = 3) -> float:
    """Tokens/s of prefilling a fresh prompt (best of `repeats`, after one untimed warm-up)."""
    from engine.generate import generate
    from engine.serving.protocol import SamplingParams

    rng = np.random.default_rng(0)
    times = []
    for i in range(repeats + 1):
        ids = rng.integers(100, 40000, num_tokens).tolist()  # fresh tokens: no prefix-cache hits
        t = _timed(lambda ids=ids: generate(eng, [ids], SamplingParams(max_tokens=1, temperature=0.0)))
        times += [t] if i else []
    return num_tokens / min(times)


def transformers_decode_rate(path, prompt_ids, num_tokens: int) -> float | None:
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=torch.float32)
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False)
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False)
    return (out.shape[1] - ids.shape[1]) / (time.perf_counter() - start)


def run(args, progress: bool = False) -> dict:
    """Every measurement of this benchmark, as one dict (`progress`: a tqdm bar over the stages)."""
    from benchmarks import compute_rate
    from benchmarks.spec import machine_info
    from engine.llm_engine import LLMEngine
    from engine.model.model_files import resolve_model

    eng = LLMEngine.from_args(engine_args(args, args.decode_tokens))
    runner = eng.runner
    prompt_ids = (np.arange(args.context) * 37 % 30000 + 100).tolist()
    res = {"machine": machine_info(), "machine_threads": runner_threads(), "numerics": args.numerics,
           "kv_cache_dtype": runner.kv_cache_dtype, "weight_bytes": int(runner.weight_bytes),
           "context": args.context, "prefill_tokens": args.prefill_tokens, "long_context": args.long_context}
    stages = [
        ("read_bandwidth_gbs", read_bandwidth_gbs),
        ("steps", lambda: model_steps(runner, args)),
        ("prefill_tok_s", lambda: prefill_rate(eng, args.prefill_tokens)),
        ("decode_tok_s_b1", lambda: decode_rate(eng, prompt_ids, 1, args.decode_tokens)),
        ("decode_tok_s_b8", lambda: decode_rate(eng, prompt_ids, 8, args.decode_tokens)),
        ("compute_rate", lambda: compute_rate.measure(runner, args.prefill_tokens)),
    ]
    if args.peers:
        from benchmarks.model_peer_run import llama_cpp_side

        stages.append(("llama_cpp", lambda: llama_cpp_side(args, resolve_model(args.model), prompt_ids, runner_threads(),
                                                         VERIFY_TS)))
        stages.append(("transformers_fp32_decode_tok_s_b1",
                       lambda: transformers_decode_rate(resolve_model(args.model), prompt_ids, 32)))
    for key, measure in _stages(stages, progress):
        res[key] = measure()
    res.update(res.pop("steps"))
    res["floor_ms"] = runner.weight_bytes / (res["read_bandwidth_gbs"] * 1e9) * 1000
    res["verify_ratio"] = {t: v / res["verify_ms"][1] for t, v in res["verify_ms"].items()}
    res["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return res


def _stages(stages: list, progress: bool):
    if not progress:
        return stages
    from tqdm import tqdm

    return tqdm(stages, desc="bench model", unit="stage", file=sys.stderr)


def main(argv=None) -> int:
    args = parse(argv or [])
    res = run(args)
    report(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


def runner_threads() -> int:
    import numba

    return numba.get_num_threads()


def report(res: dict) -> None:
    m = res["machine"]
    print(f"CPU                     {m['cpu_model']} ({m['llvm_cpu']}; {' '.join(m['cpu_flags'])})")
    print(f"kernels                 numerics {res['numerics']}, path {m['kernel_path']}, KV {res['kv_cache_dtype']}")
    print(f"threads                 {res['machine_threads']}")
    print(f"weights streamed/step   {res['weight_bytes'] / 1e6:.1f} MB")
    print(f"read bandwidth          {res['read_bandwidth_gbs']:.1f} GB/s")
    print(f"floor (T=1)             {res['floor_ms']:.2f} ms")
    print(f"verify curve (ms per forward, {res['context']} tokens cached):")
    for t, ms in res["verify_ms"].items():
        print(f"  T={t:<3d} {ms:8.2f} ms   {res['verify_ratio'][t]:.2f}x T=1   {ms / res['floor_ms']:.2f}x floor")
    print(f"prefill ({res['prefill_tokens']} tokens)   {res['prefill_tok_s']:.0f} tok/s")
    print(f"decode batch 1          {res['decode_tok_s_b1']:.1f} tok/s")
    print(f"decode batch 8          {res['decode_tok_s_b8']:.1f} tok/s")
    if "long_decode_ms" in res:
        from benchmarks import attention_rate

        print(f"decode step at {res['long_context']} ctx {res['long_decode_ms']:.2f} ms "
              f"({res['long_decode_ms'] / res['verify_ms'][1]:.2f}x the step at {res['context']})")
        attention_rate.report(res.get("long_attention"))
    from benchmarks import compute_rate

    compute_rate.report(res["compute_rate"], res["numerics"])
    print(f"peak RSS                {res['peak_rss_mb']:.0f} MB")
    if "llama_cpp" in res:
        from benchmarks.model_peer_run import report_llama_cpp

        report_llama_cpp(res)
    if "transformers_fp32_decode_tok_s_b1" in res:
        hf = res["transformers_fp32_decode_tok_s_b1"]
        print("transformers fp32 b1    " + ("not installed" if hf is None else f"{hf:.1f} tok/s (ours {res['decode_tok_s_b1'] / hf:.2f}x as fast)"))


if __name__ == "__main__":
    raise SystemExit(main())
