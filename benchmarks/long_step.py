"""The long decode step alone, measured again and again in one process: for A/B runs of attention changes.

`speculant bench model` times the step at `--long-context` cached tokens, and its attention from cold caches,
once each; on this VM one such measure moves by ±20% from run to run, more than most attention changes
gain (thirty-ninth session, journal: six alternated `bench model` runs put two builds' attention at 3.01 and
3.03 ms, where this loop, three processes per build, put them at 3.54-3.80 and 2.85-2.98). Here the model
loads once, both contexts are prefilled once, and each of `--rounds` rounds measures the attention
(benchmarks/attention_rate.py) and times the steps at `--context` and `--long-context` in bursts
(benchmarks/model.step_rounds); the medians of the rounds are printed. Compare two builds by running this
in each checkout in turn, several times:

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.long_step [--kv-cache-dtype int8] [--rounds 4]

Takes `speculant bench model`'s options (`--long-context` must be above 0).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from benchmarks import attention_rate
from benchmarks import model as bench_model


def measure(args, rounds: int) -> dict[str, list[float]]:
    """Per round: the attention at --long-context from cold caches, and the steps at --context and --long-context."""
    from engine.llm_engine import LLMEngine

    runner = LLMEngine.from_args(bench_model.engine_args(args, args.decode_tokens)).runner
    cases = [(args.context, 1), (args.long_context, 1)]
    table = bench_model.prefill_contexts(runner, cases)[args.long_context]
    got = {"attention_ms": [], "step_ms": [], "long_step_ms": []}
    for _ in range(rounds):
        rate = attention_rate.measure(runner, args.long_context, table)
        got["attention_ms"].append(rate["attention_ms"] if rate else float("nan"))
        steps = bench_model.step_rounds(runner, cases, args.repeats)
        got["step_ms"].append(steps[cases[0]])
        got["long_step_ms"].append(steps[cases[1]])
    return got


def main(argv: list[str] | None = None) -> int:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--rounds", type=int, default=4)
    mine, rest = extra.parse_known_args(sys.argv[1:] if argv is None else argv)
    args, rounds = bench_model.parse(rest), mine.rounds
    if args.long_context <= 0 or rounds < 1:
        print("python -m benchmarks.long_step: error: --long-context and --rounds must be above 0", file=sys.stderr)
        return 2
    got = measure(args, rounds)
    med = {k: float(np.median(v)) for k, v in got.items()}
    print(f"attention at {args.long_context} ctx (cold) {med['attention_ms']:.2f} ms   "
          f"rounds: {' '.join(f'{v:.2f}' for v in got['attention_ms'])}")
    print(f"step at {args.context} {med['step_ms']:.2f} ms, at {args.long_context} {med['long_step_ms']:.2f} ms: "
          f"{med['long_step_ms'] / med['step_ms']:.2f}x   (medians of {rounds} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
