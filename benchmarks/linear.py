"""`python -m benchmarks.linear`: ms per whole-model set of weight products, per weight format.

One "forward" is every weight product of the default model at T tokens: 30 layers x (q, k, v, o,
gate, up, down) plus the LM head, each a separate `linear` call. "f32" runs the weights
dequantized to float32, "native" keeps the GGUF's own Q4_1 layers and Q8_0 head. The floor is
the bytes one forward streams divided by a nominal 30 GB/s. Timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import engine  # noqa: F401  (sets NUMBA_SLP_VECTORIZE before numba is imported)

TOKEN_COUNTS = (1, 2, 4, 6, 8, 16)
LAYER_TENSORS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
FLOOR_GBS = 30.0


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.linear")
    p.add_argument("--model", default="smollm2-135m", help="GGUF path or known model name")
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKEN_COUNTS))
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=0, help="numba threads (0 = all)")
    p.add_argument("--kinds", nargs="+", default=["f32", "native"], choices=["f32", "native"])
    return p.parse_args(argv)


def load_weight_sets(model: str, kinds) -> dict[str, list]:
    """{kind: [PackedWeight, ...]} in forward order, packed from the real GGUF."""
    import gguf

    from engine.kernels.linear import pack_f32, pack_gguf_tensor
    from engine.model.model_files import resolve_model

    reader = gguf.GGUFReader(resolve_model(model))
    tensors = {t.name: t for t in reader.tensors}
    num_layers = 1 + max(int(name.split(".")[1]) for name in tensors if name.startswith("blk."))
    names = [f"blk.{i}.{n}.weight" for i in range(num_layers) for n in LAYER_TENSORS]
    names.append("output.weight" if "output.weight" in tensors else "token_embd.weight")
    sets = {}
    for kind in kinds:
        packed = [pack_gguf_tensor(tensors[n]) for n in names]
        if kind == "f32":
            packed = [pack_f32(w.dequantize()) if w.kind != "f32" else w for w in packed]
        sets[kind] = packed
    return sets


def time_forward(weights, num_tokens: int, repeats: int) -> tuple[float, float]:
    """(median, min) seconds of one pass over every product at num_tokens tokens."""
    from engine.kernels.linear import linear

    rng = np.random.default_rng(0)
    xs = {k: rng.standard_normal((num_tokens, k)).astype(np.float32) for k in {w.k for w in weights}}
    outs = [np.empty((num_tokens, w.n), np.float32) for w in weights]

    def forward():
        for w, out in zip(weights, outs):
            linear(xs[w.k], w, out)

    forward()  # compile / warm up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        forward()
        times.append(time.perf_counter() - t)
    return float(np.median(times)), float(np.min(times))


def main(argv=None) -> int:
    args = parse(argv if argv is not None else [])
    import numba

    if args.threads > 0:
        numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    sets = load_weight_sets(args.model, args.kinds)
    print(
        f"# whole-model weight products, {numba.get_num_threads()} threads, "
        f"median (min) ms of {args.repeats}; shared machine, expect +-10-20% noise"
    )
    header = "kind     MB streamed  floor ms @30GB/s | " + " | ".join(f"T={t:<3d}" for t in args.tokens)
    print(header)
    for kind, weights in sets.items():
        nbytes = sum(w.nbytes for w in weights)
        cells = []
        for t in args.tokens:
            med, best = time_forward(weights, t, args.repeats)
            cells.append(f"{med * 1e3:.1f} ({best * 1e3:.1f})")
        floor_ms = nbytes / (FLOOR_GBS * 1e9) * 1e3
        print(f"{kind:<8s} {nbytes / 1e6:11.1f}  {floor_ms:16.1f} | " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
