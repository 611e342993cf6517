"""The weight products' prefetch distance (int_tiles.AHEAD), A/B in one process: for tuning it on a new CPU.

Across processes this VM's step times move by +-30%, more than a prefetch distance changes them. Here the
model loads once; every format's kernel is built again for each distance (its clones named apart, so
Numba's cache keeps them apart), and each of `--rounds` rounds times every weight product of the model
(each layer's q|k|v, o, gate|up, down and the LM head, the rows already rounded) at each T, distance after
distance, the order turned each round. Prints the medians per T and the total. The forty-second session
chose 12 on the Zen 4 this way (journal):

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.prefetch_distance --aheads 8,12,16,32 --tokens 1,4,8

The bits do not depend on the distance (it only asks for lines earlier or later).
"""

from __future__ import annotations

import argparse
import sys

import numba as nb
import numpy as np

from benchmarks import model as bench_model
from benchmarks.compute_rate import _timed


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.prefetch_distance")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--aheads", default="8,12,16,32",
                   help="prefetch settings, comma-separated: A (A blocks ahead into every cache level), A:l2 (into the L2 "
                        "only), A/B@F (tiles under F tokens A into every level, from F tokens B into the L2)")
    p.add_argument("--tokens", default="1,4,8", help="token counts T, comma-separated")
    p.add_argument("--rounds", type=int, default=10)
    return p.parse_args(argv)


@nb.njit
def _products(kernel, ws, xq, out, n):
    """kernel(w, xq, out, 0, n) for each w of ws (one shape's weights)."""
    for w in ws:
        kernel(w, xq, out, 0, n)


def main(argv=None) -> int:
    from engine.kernels import int_linear
    from engine.llm_engine import LLMEngine

    args = parse(sys.argv[1:] if argv is None else argv)
    aheads, tokens = args.aheads.split(","), [int(t) for t in args.tokens.split(",")]
    model_args = bench_model.parse(["--model", args.model])
    runner = LLMEngine.from_args(bench_model.engine_args(model_args, 64)).runner
    weights = [w for layer in runner.layers for w, _ in runner.layer_products(layer)] + [runner.lm_head]
    if any(not hasattr(w, "fmt") for w in weights):
        raise SystemExit("prefetch_distance: every product must be an integer one (numerics int8, one part each)")
    path = int_linear.host_path()
    kernels = {(a, fmt): int_linear.build_kernel(fmt, path, *_variant(a)) for a in aheads
               for fmt in {w.fmt for w in weights}}
    groups: dict[tuple, list] = {}
    for w in weights:
        groups.setdefault((w.fmt, w.k, w.n), []).append(w.arrays)
    rng = np.random.default_rng(0)
    runs = {}  # (T, fmt, k, n) -> the group's arguments
    for t in tokens:
        for (fmt, k, n), ws in groups.items():
            x = rng.standard_normal((t, k)).astype(np.float32)  # [T, k]
            xq = tuple(np.array(v) for v in int_linear.quantize(x, spare=True))
            runs[(t, fmt, k, n)] = (tuple(ws), xq, np.empty((t, n), np.float32), n)

    def one_pass(ahead: str, t: int) -> float:
        keys = [key for key in runs if key[0] == t]
        return sum(_timed(lambda key=key: _products(kernels[(ahead, key[1])], *runs[key])) for key in keys)

    for a in aheads:  # compiled and warm
        for t in tokens:
            one_pass(a, t)
    got = {(a, t): [] for a in aheads for t in tokens}
    for r in range(args.rounds):
        for a in aheads[r % len(aheads):] + aheads[: r % len(aheads)]:
            for t in tokens:
                got[(a, t)].append(one_pass(a, t))
    print(f"every weight product of {args.model}, path {path}, median of {args.rounds} rounds (ms):")
    for t in tokens:
        print(f"  T={t:<3d} " + "  ".join(f"AHEAD={a} {1000 * np.median(got[(a, t)]):.3f}" for a in aheads))
    return 0


def _variant(spec: str) -> tuple[int, tuple[int, int]]:
    """(AHEAD, (L2_FROM, L2_AHEAD)) of a setting: "12" -> (12, (9, 12)), "24:l2" -> (24, (1, 24)), "12/24@4" -> (12, (4,
    24)) (int_tiles._ask_ahead; 9 tokens: no tile)."""
    try:
        if spec.endswith(":l2"):
            return int(spec[:-3]), (1, int(spec[:-3]))
        if "/" in spec:
            l1, rest = spec.split("/")
            l2, first = rest.split("@")
            return int(l1), (int(first), int(l2))
        return int(spec), (9, int(spec))
    except ValueError:
        raise SystemExit(f"prefetch_distance: --aheads entry {spec!r}: not A, A:l2 or A/B@F") from None


if __name__ == "__main__":
    raise SystemExit(main())
