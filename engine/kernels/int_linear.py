"""y = x @ W.T on integer weights: activations quantized per row, exact integer block sums.

Each row of x is quantized on its own (blocks of 32: scale = max|x| / 127, q = round-half-even(
x / scale), as llama.cpp's Q8_1), then every strip of 16 weight rows runs its format's tile
(int_tiles) over tiles of 8 (AVX-512) or 4 tokens, then the last few as a pair of tiles in one pass
(4 + 1, 4 + 2), one padded tile (a last 3 or 7) or tiles of 2 and 1 (see `_gemm`). Whatever the token count, the tile width, the thread or the ISA
path, row t of the output is the same bits: it depends only on x[t].

The ISA path is the best the CPU has (simd.PATHS), or $SPECULANT_KERNEL_PATH if set.
"""

from __future__ import annotations

import functools
import os
import threading

import llvmlite.binding as llvm
import numba as nb
import numpy as np

from engine.kernels import int_tiles
from engine.kernels.int_pack import IntWeight
from engine.kernels.ops import _pick, _twice
from engine.kernels.simd_quant import quantize_blocks
from engine.kernels.simd import PATHS, specialize, specialize_family, store_first_rows, store_rows

# format -> the prefix of its int_tiles functions (a block's update, and the prefetch of its weights)
BLOCKS = {"q4_0": "legacy", "q4_1": "legacy", "q5_0": "legacy", "q5_1": "legacy", "q8_0": "q8_0", "q4_k": "kquant",
          "q5_k": "kquant", "q6_k": "k16", "q3_k": "k16", "q2_k": "q2_k", "iq4_nl": "lut",
          "lut32": "lut", "lut32_3": "lut", "lut16_3": "lut"}
_SHARED = ("_ask_ahead", "_nibble_sum", "_block_isum", "_q6_half", "_crumb_half", "_per_16_at", "_lut_dots", "tile",
           "pair")
_kernels: dict = {}
EIGHT_TOKEN_PATHS = ("avx512",)  # 32 vector registers of 16 lanes hold a tile of 8 tokens
PAIR_PATHS = ("avx512", "vnni", "avx2")  # paths that run a last 5 or 6 tokens as a pair of tiles
_lock = threading.Lock()
_scratch = threading.local()


def _path_ok(features: dict) -> dict:
    has = lambda *names: all(features.get(n, False) for n in names)  # noqa: E731
    return {"avx512": has("avx512vnni", "avx512vl", "avx512bw"), "vnni": has("avxvnni") or has("avx512vnni", "avx512vl"),
            "avx2": has("avx2"), "portable": True}


@functools.cache
def runnable_paths() -> list[str]:
    """Every path this CPU can execute, fastest first (portable always)."""
    ok = _path_ok(llvm.get_host_cpu_features())
    return [p for p in PATHS if ok[p]]


@functools.cache
def host_path() -> str:
    """The fastest path this CPU runs, or $SPECULANT_KERNEL_PATH (one of simd.PATHS) if set."""
    forced = os.environ.get("SPECULANT_KERNEL_PATH", "")
    if forced and forced not in runnable_paths():
        raise ValueError(f"SPECULANT_KERNEL_PATH: this CPU runs {', '.join(runnable_paths())}, got {forced!r}")
    return forced or runnable_paths()[0]


def _quantize_rows(x, xq, xd, xm, xs):
    """Per row and block of 32: xq = round(x / xd) with xd = max|x| / 127; xm = xd * sum(xq); xs = per-16 sums
    (simd_quant.quantize_blocks: 8 blocks per call, then 4, 2, 1; flat indices, no row views)."""
    blocks = x.shape[1] // 32
    stride = x.strides[0] // 4  # x's rows may be wider than k (a view); every other array is [T, k]
    for t in nb.prange(x.shape[0]):
        b = 0
        while blocks - b >= 8:
            quantize_blocks(x, t * stride + 32 * b, xq, xd, xm, xs, t * blocks + b, 8)
            b += 8
        if blocks - b >= 4:
            quantize_blocks(x, t * stride + 32 * b, xq, xd, xm, xs, t * blocks + b, 4)
            b += 4
        if blocks - b >= 2:
            quantize_blocks(x, t * stride + 32 * b, xq, xd, xm, xs, t * blocks + b, 2)
            b += 2
        if blocks - b == 1:
            quantize_blocks(x, t * stride + 32 * b, xq, xd, xm, xs, t * blocks + b, 1)


_QUANTIZE = _twice(_quantize_rows)


def _gemm(w, x, out, col0, n):
    """out[:, col0:col0+n] = x @ W.T for every strip (prange) and token tile; `_tile`, `_pair` are bound per format.

    Passes over each strip as `_next_pass` plans them: tiles of 8 tokens (`EIGHT`: paths with 32 vector
    registers) or 4, then the last few. Odd vector widths (3 x 16 lanes) compile to slow code, so a rest
    of 5 or 6 runs as a pair of tiles (4 + 1, 4 + 2) in one pass, and a rest of 3 (or 7) as one padded
    tile of 4 (or 8) when x holds a spare row after the rows computed (`QuantRows.quantize(spare=True)`
    and the layers' `_quantized` give one); the padded row is not stored. Each row's sums and combine are
    its own, so every plan gives the same bits per row. One call site per kind of pass keeps the
    compile short. Xeon, whole forward at 300 tokens of context: T = 3 5.39 -> 4.89 ms and T = 7 8.93 ->
    7.57 from the padded tiles (T = 4: 5.04, T = 8: 7.33); T = 5 6.53-6.75 -> 5.87-6.25 ms and T = 6
    7.10-7.31 -> 6.38-6.84 from the pairs (T = 4: 5.18-5.61).
    """
    num_tokens = min(out.shape[0], x[0].shape[0])
    room = x[0].shape[0]  # rows of x that may be read
    stride = out.shape[1]
    for s in nb.prange((n + 15) // 16):
        rows = min(16, n - 16 * s)
        t0 = 0
        while t0 < num_tokens:
            kind, count = _next_pass(num_tokens - t0, room - t0, EIGHT, PAIRS)  # noqa: F821  (bound per path)
            at = t0 * stride + col0 + 16 * s
            if kind == 8:
                if EIGHT:  # noqa: F821  (a constant: other paths compile no tile of 8)
                    f8 = _tile(w, x, s, t0, 8)  # noqa: F821
                    if count == 8:
                        store_rows(out, at, stride, f8, rows)
                    else:
                        store_first_rows(out, at, stride, f8, rows, 7)
            elif kind == 4:
                f4 = _tile(w, x, s, t0, 4)  # noqa: F821
                if count == 4:
                    store_rows(out, at, stride, f4, rows)
                else:
                    store_first_rows(out, at, stride, f4, rows, 3)
            elif kind == 2:
                store_rows(out, at, stride, _tile(w, x, s, t0, 2), rows)  # noqa: F821
            elif kind == 1:
                store_rows(out, at, stride, _tile(w, x, s, t0, 1), rows)  # noqa: F821
            elif kind == 5:
                if PAIRS:  # noqa: F821  (a constant: the portable path compiles no pairs)
                    fa, fb = _pair(w, x, s, t0, 4, 1)  # noqa: F821
                    store_rows(out, at, stride, fa, rows)
                    store_rows(out, at + 4 * stride, stride, fb, rows)
            elif PAIRS:  # noqa: F821
                fa, fb = _pair(w, x, s, t0, 4, 2)  # noqa: F821
                store_rows(out, at, stride, fa, rows)
                store_rows(out, at + 4 * stride, stride, fb, rows)
            t0 += count


@nb.njit(cache=True, inline="always")
def _next_pass(left, room, eight, pairs):
    """(kind, tokens it stores) of the next pass over a strip with `left` tokens to go and `room` rows of x
    readable from the first: kind 8, 4, 2, 1 = a tile that wide (8 and 4 maybe padded), 5 / 6 = the pair
    4 + 1 / 4 + 2 (`pairs`: the vector paths; the portable one, a fallback, saves their compile time)."""
    if eight and (left >= 8 or (left == 7 and room >= 8)):
        return 8, min(left, 8)
    if pairs and (left == 5 or left == 6):
        return left, left
    if left >= 4:
        return 4, 4
    if left == 3 and room >= 4:
        return 4, 3
    if left >= 2:
        return 2, 2
    return 1, 1


def _traits(fmt: str) -> dict:
    """int_tiles' per-format constants."""
    return {"HIGH_BIT": fmt in ("q5_0", "q5_1", "q5_k", "q3_k"), "OFFSET": fmt in ("q4_0", "q5_0"),
            "K16_OFFSET": 4 if fmt == "q3_k" else 32, "LUT_SCALES": {"lut32": 32, "lut32_3": 32, "lut16_3": 16}.get(fmt, 0),
            "LUT_BITS": 3 if fmt.endswith("_3") else 4}


def kernel(fmt: str, path: str):
    """The compiled weight product for one format on one ISA path (built on first use)."""
    key = (fmt, path)
    with _lock:
        if key not in _kernels:
            _kernels[key] = build_kernel(fmt, path)
        return _kernels[key]


def build_kernel(fmt: str, path: str, ahead: int | None = None, l2: tuple[int, int] | None = None):
    """A new build of the weight product for `fmt` on `path`; `ahead` overrides int_tiles.AHEAD and `l2` =
    (L2_FROM, L2_AHEAD) int_tiles' L2 prefetch (benchmarks/prefetch_distance.py builds one per setting, named
    apart for Numba's cache)."""
    functions = {name: getattr(int_tiles, name) for name in _SHARED}  # the format's block as _block
    functions.update(_block=getattr(int_tiles, BLOCKS[fmt] + "_block"), _ahead=getattr(int_tiles, BLOCKS[fmt] + "_ahead"))
    constants, tag = _traits(fmt), fmt
    if ahead is not None:
        constants, tag = {**constants, "AHEAD": ahead}, f"{tag}_ahead{ahead}"
    if l2 is not None:
        constants, tag = {**constants, "L2_FROM": l2[0], "L2_AHEAD": l2[1]}, f"{tag}_l2from{l2[0]}_{l2[1]}"
    family = specialize_family(functions, path, constants, tag=tag)
    bind = {"_tile": family["tile"], "_pair": family["pair"], "EIGHT": path in EIGHT_TOKEN_PATHS,
            "PAIRS": path in PAIR_PATHS}
    return specialize(_gemm, path, bind, tag=tag)


class QuantRows:
    """Quantized activations of up to `capacity` rows of width k (buffers grown, never shrunk)."""

    def __init__(self, k: int, capacity: int):
        if k % 32:
            raise ValueError(f"the integer kernels need k to be a multiple of 32, got {k}")
        self.k, self.capacity = k, capacity
        self.xq = np.zeros((capacity, k), np.int8)  # [rows, k]
        self.xd = np.zeros((capacity, k // 32), np.float32)  # [rows, k / 32] block scales
        self.xm = np.zeros((capacity, k // 32), np.float32)  # [rows, k / 32] scale * block sum
        self.xs = np.zeros((capacity, k // 16), np.int32)  # [rows, k / 16] per-16 sums

    def quantize(self, x: np.ndarray, spare: bool = False) -> tuple:
        """(xq, xd, xm, xs) for x [T, k] (views, valid until the next call); `spare`: one row more where
        the capacity allows, not written (it lets `_gemm` run a last 3 or 7 tokens as a padded tile)."""
        t = x.shape[0]
        have = min(t + spare, self.capacity)
        views = (self.xq[:have], self.xd[:have], self.xm[:have], self.xs[:have])
        _pick(_QUANTIZE, t)(np.ascontiguousarray(x), *views)  # the vector loads read rows as flat memory
        return views


def _rows_for(k: int, t: int) -> QuantRows:
    cache = getattr(_scratch, "by_k", None)
    if cache is None:
        cache = _scratch.by_k = {}
    rows = cache.get(k)
    if rows is None or rows.capacity < t:
        rows = cache[k] = QuantRows(k, max(t, 16))
    return rows


def quantize(x: np.ndarray, spare: bool = False) -> tuple:
    """x [T, k] float32 -> (xq, xd, xm, xs) for the kernels (this thread's buffers, valid until its next call)."""
    return _rows_for(x.shape[1], x.shape[0] + spare).quantize(x, spare)


def matmul(xq: tuple, w: IntWeight, out: np.ndarray, col0: int = 0, path: str | None = None) -> None:
    """out[:, col0:col0+w.n] = x @ W.T from quantized rows (out: C-contiguous [T, >= col0 + n] float32)."""
    kernel(w.fmt, path or host_path())(w.arrays, xq, out, col0, w.n)
