"""`speculant bench spec`: what speculative decoding buys on this machine, per method and workload.

    speculant bench spec --max-tokens 96 --methods none,ngram,suffix --concurrency 4 --out results/

For every method (always with `none`, plain decoding, as the baseline) and prompt category it
runs generation at batch 1 (prompts one at a time) and under concurrency (the category's
prompts submitted together, `--concurrency` at a time), and reports the mean acceptance length
(vLLM's AL = 1 + accepted / drafts, over verify steps that had drafts), per-position acceptance,
output tokens/s, the speedup over the baseline on the same prompts, whether the output tokens
equal the baseline's (greedy speculation must be lossless), and where a step's time goes
(forward, proposer, the rest of the Python step). Greedy by default; `--temperature` above 0 samples
(every request seeded with `--seed`), and then outputs are not compared: speculation with rejection
sampling keeps the distribution, not the tokens (the tests check the distribution).

Fairness: one engine per method, built once; every engine is warmed up on every prompt first
(JIT compiled, prompt KV in the prefix cache), each method's block runs between two baseline
blocks on the same prompts (`spec_pairs`: the *paired* speedup, the median over `--repeats` of a
block's tok/s over its two neighbours', which the targets use; `speedup` is the fastest repeat of
the method over the fastest of the baseline's blocks), and
each block starts from a fresh proposer, so a suffix cache only holds responses of the same
block (cross-request reuse inside a category, nothing from earlier blocks or repeats). All
speculative engines share one verify curve (the per-T median of their start-up measurements), so
the draft-length choices of two methods never differ because one engine measured a noisier curve.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping
from types import SimpleNamespace

import msgspec
import numpy as np

from benchmarks import report, spec_pairs
from benchmarks.cpu_share import OtherLoad
from benchmarks.prompts import BenchPrompt, builtin_prompts, by_category, load_prompts, select
from benchmarks.spec_timing import block_raw, instrument, reset_proposer
from engine.serving.protocol import Generate, SamplingParams

DEFAULT_METHODS = "none,naive,ngram,suffix"
WARMUP_TOKENS = 16


def parse(argv):
    p = argparse.ArgumentParser(prog="speculant bench spec", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--methods", default=DEFAULT_METHODS, help="comma list of proposer names (default configs)")
    p.add_argument("--method", action="append", default=[], metavar="JSON",
                   help='a full speculative config, repeatable: \'{"method":"ngram","num_speculative_tokens":3}\'')
    p.add_argument("--num-speculative-tokens", type=int, default=None, help="K for the --methods entries")
    p.add_argument("--concurrency", type=int, default=4, help="requests at once in the concurrent mode (<= 1: skip it)")
    p.add_argument("--categories", default=None,
                   help="comma list (default: every category of the file, or the built-in suite's four; "
                        "long_code, long_chat: its ~1,400-token prompts)")
    p.add_argument("--prompts", default=None, help="JSONL file of your own prompts")
    p.add_argument("--per-category", type=int, default=None, help="use at most this many prompts per category")
    p.add_argument("--repeats", type=int, default=1,
                   help="blocks per method and category (paired: their median; speedup: the fastest)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-memory", type=float, default=0.5, help="GiB per engine")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above: sampled, every request seeded")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (with --temperature above 0)")
    p.add_argument("--seed", type=int, default=0, help="the seed of every sampled request")
    p.add_argument("--out", default=None, help="directory for spec.json, spec.md (and plots)")
    return p.parse_args(argv)


# ---------------------------------------------------------------- methods


def method_configs(names: str, json_methods: list[str], num_speculative_tokens: int | None) -> dict[str, dict | None]:
    """label -> speculative config dict (None = plain decoding); the baseline `none` comes first."""
    from engine.spec_decode.spec_config import parse_speculative_config

    configs: dict[str, dict | None] = {"none": None}
    for name in [n.strip() for n in names.split(",") if n.strip()]:
        if name == "none":
            continue
        cfg = {"method": name}
        if num_speculative_tokens is not None:
            cfg["num_speculative_tokens"] = num_speculative_tokens
        configs[_unique(name, configs)] = cfg
    for text in json_methods:
        try:
            cfg = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"method: invalid JSON ({exc.msg}): {text}") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"method: expected a JSON object: {text}")
        extras = ",".join(f"{k}={v}" for k, v in cfg.items() if k != "method")
        label = f"{cfg.get('method')}({extras})" if extras else str(cfg.get("method"))
        configs[_unique(label, configs)] = cfg
    for cfg in configs.values():
        if cfg is not None:
            parse_speculative_config(cfg)  # a bad name or option fails here, naming the field
    return configs


def _unique(label: str, taken) -> str:
    out, i = label, 2
    while out in taken:
        out, i = f"{label}#{i}", i + 1
    return out


def build_engine(args, spec: dict | None, max_num_seqs: int):
    from engine.llm_engine import LLMEngine

    return LLMEngine.from_args(SimpleNamespace(
        model=args.model, max_model_len=args.max_model_len, kv_cache_memory=args.kv_cache_memory, block_size=16,
        max_num_seqs=max(16, max_num_seqs), max_num_batched_tokens=512, threads=args.threads, device="cpu",
        speculative_config=json.dumps(spec) if spec is not None else None, served_model_name=None,
    ))


# ---------------------------------------------------------------- driving


def drive(engine, prompts: list[BenchPrompt], params: SamplingParams) -> list[dict]:
    """Submit prompts together and step to completion; per request: tokens, steps, timings."""
    start = time.perf_counter()
    reqs = {}
    for p in prompts:
        rid = f"bench-{p.prompt_id}-{time.perf_counter_ns()}"
        engine.add_request(Generate(rid, constrained(engine, params, p.grammar), messages=list(p.messages)))
        reqs[rid] = {"prompt_id": p.prompt_id, "token_ids": [], "num_steps": 0, "first_s": None, "done_s": None,
                     "drafts": [], "seen": (0, 0, 0), "grammar_tokens": 0}
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter() - start
        for out in outs:
            r = reqs[out.request_id]
            r["token_ids"] += out.token_ids
            r["num_steps"] += 1
            seen = (out.num_drafts, out.num_draft_tokens, out.num_accepted_tokens)
            if seen[0] > r["seen"][0]:  # this step verified drafts: (draft length, accepted)
                r["drafts"].append((seen[1] - r["seen"][1], seen[2] - r["seen"][2]))
            r["seen"] = seen
            r["grammar_tokens"] = out.num_grammar_tokens
            if r["first_s"] is None:
                r["first_s"] = now
            if out.finish_reason is not None:
                r["done_s"] = now
    return list(reqs.values())


def constrained(engine, params: SamplingParams, grammar: str | None) -> SamplingParams:
    """The prompt's params under its grammar; the baseline (no proposer) also drafts nothing from the
    grammar, so it is plain constrained decoding."""
    if grammar is None:
        return params
    cap = 0 if engine.proposer is None else params.num_speculative_tokens
    return msgspec.structs.replace(params, grammar=grammar, num_speculative_tokens=cap)


def run_block(engine, prompts: list[BenchPrompt], params: SamplingParams, group: int) -> dict:
    """One method on one category in one mode, from a fresh proposer: raw counts and timings."""
    if engine.has_unfinished():
        raise ValueError("engines: an engine still has unfinished requests")
    reset_proposer(engine)
    with instrument(engine) as timers:
        start = time.perf_counter()
        results = []
        for i in range(0, len(prompts), group):
            results += drive(engine, prompts[i: i + group], params)
        wall_s = time.perf_counter() - start
    return block_raw(results, wall_s, timers)


def warm_up(engine, prompts: list[BenchPrompt], concurrency: int, max_tokens: int) -> None:
    """Compile the kernels for every path a block takes and put every prompt's KV in the prefix cache."""
    drive(engine, prompts, SamplingParams(max_tokens=1, temperature=0.0))
    first = next(iter(by_category(prompts).values()))
    warm = SamplingParams(max_tokens=min(WARMUP_TOKENS, max_tokens), temperature=0.0)
    drive(engine, first[:1], warm)
    drive(engine, first[: max(concurrency, 1)], warm)


def run_spec_bench(engines: Mapping[str, object], prompts: list[BenchPrompt], *, max_tokens: int = 128,
                   concurrency: int = 4, repeats: int = 1, progress: bool = True, temperature: float = 0.0,
                   top_p: float = 1.0, seed: int = 0) -> dict:
    """Benchmark already-built engines (label -> LLMEngine; exactly one without speculation); temperature 0:
    greedy, else sampled with top_p, every request seeded with `seed` (each repeat draws the same tokens)."""
    baselines = [label for label, e in engines.items() if e.proposer is None]
    if len(baselines) != 1:
        raise ValueError(f"engines: need exactly one engine without speculation as the baseline, got {len(baselines)}")
    if not prompts:
        raise ValueError("prompts: empty")
    ids = [p.prompt_id for p in prompts]
    if len(set(ids)) != len(ids):
        raise ValueError(f"prompts: duplicate id {next(i for i in ids if ids.count(i) > 1)!r}")
    if max_tokens < 1:
        raise ValueError("max_tokens: must be >= 1")
    if repeats < 1:
        raise ValueError("repeats: must be >= 1")
    if not 0.0 <= temperature <= 100.0:
        raise ValueError("temperature: must be in [0, 100]")
    if not 0.0 < top_p <= 1.0:
        raise ValueError("top_p: must be in (0, 1]")
    modes = [("batch1", 1)] + ([("concurrent", concurrency)] if concurrency > 1 else [])
    groups = by_category(prompts)
    share_verify_curve(engines.values())
    for engine in engines.values():
        warm_up(engine, prompts, concurrency, max_tokens)
    sampled = temperature > 0.0
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed if sampled else None)
    # every method block runs between two baseline blocks (spec_pairs), so a slow spell hits both sides of a pair
    blocks = spec_pairs.block_order(modes, list(groups), repeats, list(engines), baselines[0])
    raw, runs, others = {}, [], OtherLoad()
    for mode, n, cat, label, r in _progress(blocks, progress):
        run = run_block(engines[label], groups[cat], params, n)
        runs.append(((mode, cat, label, r), run))
        if (mode, cat, label) not in raw or run["wall_s"] < raw[(mode, cat, label)]["wall_s"]:
            raw[(mode, cat, label)] = run  # the fastest repeat
    ratios = spec_pairs.paired_ratios(runs, baselines[0], list(groups))
    return {
        "config": {
            "max_tokens": max_tokens, "concurrency": concurrency, "repeats": repeats, "temperature": temperature,
            "top_p": top_p, "seed": seed if sampled else None,
            "categories": {c: [p.prompt_id for p in ps] for c, ps in groups.items()},
            "modes": {mode: n for mode, n in modes}, "machine": machine_info(),
            "other_cpu_cores": _rounded(others.cores()),
        },
        "baseline": baselines[0],
        "methods": {label: _spec_dict(e) for label, e in engines.items()},
        "rows": report.make_rows(raw, baselines[0], [m for m, _ in modes], list(groups), list(engines),
                                 spec_pairs.paired_speedups(ratios)),
        "paired_ratios": {"/".join(key): [round(r, 4) for r in vals] for key, vals in ratios.items()},
    }


def share_verify_curve(engines) -> None:
    """Give every engine the per-T median of the verify curves they measured at start-up.

    Each engine's draft controller picks k from its own start-up measurement, which moves by a few
    percent from engine to engine on a noisy machine, enough to flip k between 1 and 3 at the same
    acceptance. One shared curve (same model, same threads) keeps that noise out of the comparison."""
    controllers = [e.controller for e in engines if e.controller.t1_seconds > 0]
    if len(controllers) < 2:
        return
    longest = max(len(c.verify_cost) for c in controllers)
    curve = np.array([np.median([c.verify_cost[t] for c in controllers if t < len(c.verify_cost)])
                      for t in range(longest)])
    t1 = float(np.median([c.t1_seconds for c in controllers]))
    for c in controllers:
        c.verify_cost, c.t1_seconds = np.maximum.accumulate(curve[: len(c.verify_cost)]), t1


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def _progress(items, enabled: bool):
    if not enabled:
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc="bench spec", unit="block", file=sys.stderr)


def _spec_dict(engine) -> dict | None:
    spec = engine.spec
    if spec is None:
        return None
    return {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens,
            "max_draft_tokens_per_step": spec.max_draft_tokens_per_step, "options": dict(spec.options),
            **({"verify_strategy": spec.verify_strategy} if spec.verify_strategy is not None else {})}


ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16",
             "amx_tile", "amx_int8")


def machine_info() -> dict:
    """The CPU (model, the vector extensions that matter here, LLVM's name) and Speculant's kernel path."""
    import numba
    from llvmlite import binding as llvm

    from engine.kernels.int_linear import host_path

    model, flags = "unknown", set()
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    return {"cpu_model": model, "cpu_flags": [f for f in ISA_FLAGS if f in flags], "llvm_cpu": llvm.get_host_cpu_name(),
            "kernel_path": host_path(), "cpu_count": os.cpu_count(), "numba_threads": numba.get_num_threads(),
            "load_avg_1m": round(os.getloadavg()[0], 2)}


# ---------------------------------------------------------------- CLI


def load_suite(args) -> list[BenchPrompt]:
    categories = [c.strip() for c in args.categories.split(",") if c.strip()] if args.categories else None
    prompts = load_prompts(args.prompts) if args.prompts else builtin_prompts(categories)
    return select(prompts, categories, args.per_category)


def main(argv=None) -> int:
    args = parse(argv or [])
    try:
        for flag in ("max_tokens", "repeats"):
            if getattr(args, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')}: must be >= 1")
        if not 0.0 <= args.temperature <= 100.0:
            raise ValueError("--temperature: must be in [0, 100]")
        if not 0.0 < args.top_p <= 1.0:
            raise ValueError("--top-p: must be in (0, 1]")
        if args.per_category is not None and args.per_category < 1:
            raise ValueError("--per-category: must be >= 1")
        configs = method_configs(args.methods, args.method, args.num_speculative_tokens)
        prompts = load_suite(args)
    except ValueError as exc:
        print(f"speculant bench spec: error: {exc}", file=sys.stderr)
        return 2
    load_before = os.getloadavg()[0]
    engines = {label: build_engine(args, cfg, args.concurrency) for label, cfg in configs.items()}
    result = run_spec_bench(engines, prompts, max_tokens=args.max_tokens, concurrency=args.concurrency,
                            repeats=args.repeats, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    result["config"].update(model=args.model, threads=args.threads, load_avg_1m_before=round(load_before, 2))
    print(report.format_table(result))
    if args.out:
        for path in report.write_all(result, args.out):
            print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
