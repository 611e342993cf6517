"""`speculant bench all`: the model, spec and serve benchmarks in one run, written as one report.

    speculant bench all --out bench-report/            # the full sizes (tens of minutes on 2 cores)
    speculant bench all --quick --out /tmp/quick/       # tiny sizes: a check that everything runs

Runs, one after another, with progress bars:
- model: the verify curve (ms per forward for T appended tokens) against the memory floor
  (weight bytes per step / measured read bandwidth), prefill and decode speed (`benchmarks.model`);
- spec: every installed model-free proposer (or `--methods`) on every prompt category, at batch 1
  and under concurrency: speedup, mean acceptance length, per-position acceptance (`benchmarks.spec`);
- serve: tokens/s, TTFT and inter-token latency against the number of concurrent HTTP clients,
  through a gateway and worker started for the run (`benchmarks.serve`).
Writes `report.json` (every number), `report.md` (every table, with the plots linked) and, when
matplotlib is installed (`speculant[bench]`), the PNG plots, into `--out`. A section that fails
is reported in both files and the exit status is 1; the other sections still run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from types import SimpleNamespace

from benchmarks import model as model_bench
from benchmarks import serve as serve_bench
from benchmarks import spec as spec_bench
from benchmarks.all_report import write_report

SECTIONS = ("model", "spec", "serve")
# name: (full, --quick, what it sizes)
SIZES = {
    "context": (300, 64, "model: cached tokens under the verify curve"),
    "decode_tokens": (64, 8, "model: tokens per decode measurement"),
    "repeats": (7, 3, "model: forwards per verify-curve point (the median is kept)"),
    "prefill_tokens": (500, 64, "model: prompt length of the prefill measurement"),
    "long_context": (2000, 256, "model: cached tokens of the long decode step"),
    "max_tokens": (96, 8, "spec: output tokens per prompt"),
    "per_category": (3, 1, "spec and serve: prompts per category"),
    "concurrency": (4, 2, "spec: requests at once in the concurrent mode"),
    "levels": ("1,4,16", "1,2", "serve: comma list of concurrent clients"),
    "requests": (32, 2, "serve: requests per level"),
    "serve_max_tokens": (64, 8, "serve: output tokens per request"),
}


def parse(argv):
    p = argparse.ArgumentParser(prog="speculant bench all", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench-report", help="directory for report.json, report.md and the plots")
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks that every part runs (numbers are noise)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    p.add_argument("--model", default="smollm2-135m", help="GGUF path or known name")
    p.add_argument("--threads", type=int, default=0, help="compute threads (0 = all cores)")
    p.add_argument("--methods", default=None,
                   help="spec: comma list of proposers (default: every installed model-free one)")
    p.add_argument("--categories", default=None, help="spec: comma list of prompt categories (default: all)")
    p.add_argument("--prompts", default=None, help="spec and serve: JSONL file of your own prompts")
    for name, (full, quick, what) in SIZES.items():
        kind = str if isinstance(full, str) else int
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None,
                       help=f"{what} (default {full}, --quick {quick})")
    return p.parse_args(argv)


def check(args) -> list[str]:
    """Fill the sizes in; bad flags -> ValueError naming the flag. Returns the sections to run."""
    for name, (full, quick, _) in SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
        elif not isinstance(full, str) and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1")
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    for s in sections:
        if s not in SECTIONS:
            raise ValueError(f"--sections: unknown section {s!r} (known: {', '.join(SECTIONS)})")
    if args.methods is None:
        args.methods = ",".join(model_free_methods())
    spec_bench.method_configs(args.methods, [], None)  # an unknown method or option fails here, named
    serve_bench.check(serve_args(args))
    spec_bench.load_suite(args)  # a bad --prompts or --categories fails before anything runs
    return sections


def model_free_methods() -> list[str]:
    """Installed proposers that need no weights: neither a bound target model nor its hidden states."""
    from proposers.base import Proposer
    from proposers.registry import default_registry

    registry, names = default_registry(), []
    for name in registry.names():
        try:
            cls = registry.load_proposer_class(name)
        except ValueError:
            continue  # broken plugins are listed by `speculant proposers`
        if cls.bind_target is Proposer.bind_target and not cls.uses_hidden_states:
            names.append(name)
    return names


# ---------------------------------------------------------------- sections


def run_model(args) -> dict:
    margs = model_bench.parse(["--model", args.model, "--context", str(args.context), "--threads", str(args.threads),
                               "--decode-tokens", str(args.decode_tokens), "--repeats", str(args.repeats),
                               "--prefill-tokens", str(args.prefill_tokens), "--long-context", str(args.long_context)])
    return model_bench.run(margs, progress=True)


def run_spec(args) -> dict:
    """Every method that builds (a method whose engine fails to build is listed as skipped)."""
    configs = spec_bench.method_configs(args.methods, [], None)
    engine_args = SimpleNamespace(model=args.model, max_model_len=2048, kv_cache_memory=0.25, threads=args.threads)
    engines, skipped = {}, {}
    for label, cfg in configs.items():
        try:
            engines[label] = spec_bench.build_engine(engine_args, cfg, args.concurrency)
        except Exception as exc:  # e.g. a learned head whose weights are not installed
            skipped[label] = f"{type(exc).__name__}: {exc}"
            print(f"speculant bench all: spec: skipping {label}: {skipped[label]}", file=sys.stderr)
    load_before = os.getloadavg()[0]
    result = spec_bench.run_spec_bench(engines, spec_bench.load_suite(args), max_tokens=args.max_tokens,
                                       concurrency=args.concurrency)
    result["config"].update(model=args.model, threads=args.threads, load_avg_1m_before=round(load_before, 2),
                            skipped_methods=skipped)
    return result


def serve_args(args):
    return serve_bench.parse(["--model", args.model, "--levels", args.levels, "--requests", str(args.requests),
                              "--max-tokens", str(args.serve_max_tokens), "--threads", str(args.threads),
                              "--kv-cache-memory", "0.25", *(["--prompts", args.prompts] if args.prompts else [])])


def run_serve(args) -> dict:
    sargs = serve_args(args)
    prompts = [p.messages for p in spec_bench.load_suite(args)]
    return serve_bench.run(sargs, serve_bench.check(sargs), prompts)


RUNNERS = {"model": run_model, "spec": run_spec, "serve": run_serve}


def run(args, sections: list[str]) -> dict:
    """Each section in turn; a failing section leaves {"error": ...} and the rest still run."""
    from tqdm import tqdm

    result = {"config": {"model": args.model, "quick": args.quick, "threads": args.threads, "sections": sections,
                         "methods": args.methods, "cpu_count": os.cpu_count(),
                         "load_avg_1m_before": round(os.getloadavg()[0], 2),
                         "started": time.strftime("%Y-%m-%d %H:%M:%S")}}
    for section in tqdm(sections, desc="bench all", unit="section", file=sys.stderr):
        start = time.perf_counter()
        try:
            result[section] = RUNNERS[section](args)
        except Exception as exc:
            traceback.print_exc()
            result[section] = {"error": f"{type(exc).__name__}: {exc}"}
        result[section]["elapsed_s"] = round(time.perf_counter() - start, 1)
    result["config"]["load_avg_1m_after"] = round(os.getloadavg()[0], 2)
    return result


def main(argv=None) -> int:
    args = parse(argv or [])
    try:
        sections = check(args)
    except ValueError as exc:
        print(f"speculant bench all: error: {exc}", file=sys.stderr)
        return 2
    result = run(args, sections)
    for path in write_report(result, args.out):
        print(f"wrote {path}", file=sys.stderr)
    failed = [s for s in sections if "error" in result[s]]
    if failed:
        print(f"speculant bench all: failed sections: {', '.join(failed)} (see report.md)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
