"""Run as a subprocess by test_int_kernels: some (format, ISA path) pairs' weight products over the
test's quantized inputs, saved for the test to compare with the portable path's.

Why a subprocess: a cold kernel cache compiles every format on every path the CPU runs (~30 kernels of
5-15 s each), and LLVM compiles on one core. Children compile the paths other than the host's, on the
other core, while the test process compiles the host path; the test then runs those paths itself,
loading them from Numba's cache, and compares the children's results as well.

A child compiles only these pairs' products: each (format, path) pair is a clone of its own
(int_linear.kernel, named after both), and the inputs arrive quantized, so no other kernel compiles
here and no two processes write one cache entry at once (see engine/jit_cache.compile_lock).

Usage: int_paths_child.py WEIGHTS.gguf INPUTS.npz OUT_DIR FORMAT:PATH [FORMAT:PATH ...]
"""

from __future__ import annotations

import sys

import gguf
import numpy as np

import engine  # noqa: F401  (points NUMBA_CACHE_DIR at the source version's folder, as in the parent)
from engine.kernels import int_linear
from engine.kernels.linear import pack_gguf_tensor

# Token counts of the path test: every tile shape (see test_every_isa_path_gives_the_portable_paths_bits)
ISA_TOKENS = (9, 5, 6, 7, 14)


def input_key(fmt: str, num_tokens: int, part: int) -> str:
    """The INPUTS.npz key of one of the four QuantRows arrays (xq, xd, xm, xs) of one input."""
    return f"{fmt}_{num_tokens}_{part}"


def outputs_file(out_dir: str, fmt: str, path: str) -> str:
    return f"{out_dir}/{fmt}_{path}.npz"


def main(argv: list[str]) -> None:
    weights, inputs_file, out_dir, *pairs = argv
    tensors = {t.name: t for t in gguf.GGUFReader(weights).tensors}
    inputs = np.load(inputs_file)
    for pair in pairs:
        fmt, path = pair.split(":")
        w = pack_gguf_tensor(tensors[fmt], "int8")
        outs = {}
        for num_tokens in ISA_TOKENS:
            xq = tuple(inputs[input_key(fmt, num_tokens, part)] for part in range(4))
            out = np.full((num_tokens, w.n), np.nan, np.float32)
            int_linear.matmul(xq, w, out, 0, path)
            outs[f"T{num_tokens}"] = out
        np.savez(outputs_file(out_dir, fmt, path), **outs)


if __name__ == "__main__":
    main(sys.argv[1:])
