"""y = x @ W.T on integer weights: activations quantized per row, exact integer block sums.

Each row of x is quantized on its own (blocks of 32: scale = max|x| / 127, q = round-half-even(
x / scale), as llama.cpp's Q8_1), then every strip of 16 weight rows runs its format's tile
(int_tiles) over tiles of 8 (AVX-512) or 4 tokens and last tiles of 2 and 1, or one padded tile
for a last 3 or 7 (see `_gemm`). Whatever the token count, the tile width, the thread or the ISA
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

TILES = {"q4_0": "legacy_tile", "q4_1": "legacy_tile", "q5_0": "legacy_tile", "q5_1": "legacy_tile",
         "q8_0": "q8_0_tile", "q4_k": "kquant_tile", "q5_k": "kquant_tile", "q6_k": "q6_k_tile"}
_TILE_FUNCTIONS = {name: getattr(int_tiles, name) for name in
                   ("_ask_ahead", "_nibble_sum", "_block_isum", "_q6_half", "legacy_tile", "q8_0_tile", "kquant_tile", "q6_k_tile")}
_kernels: dict = {}
EIGHT_TOKEN_PATHS = ("avx512",)  # 32 vector registers of 16 lanes hold a tile of 8 tokens
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
    (simd_quant.quantize_blocks: 4 blocks per call, then 2, then 1; flat indices, no row views)."""
    blocks = x.shape[1] // 32
    stride = x.strides[0] // 4  # x's rows may be wider than k (a view); every other array is [T, k]
    for t in nb.prange(x.shape[0]):
        b = 0
        while blocks - b >= 4:
            quantize_blocks(x, t * stride + 32 * b, xq, xd, xm, xs, t * blocks + b, 4)
            b += 4
        if blocks - b >= 2:
            quantize_blocks(x, t * stride + 32 * b, xq, xd, xm, xs, t * blocks + b, 2)
            b += 2
        if blocks - b == 1:
            quantize_blocks(x, t * stride + 32 * b, xq, xd, xm, xs, t * blocks + b, 1)


_QUANTIZE = _twice(_quantize_rows)


def _gemm(w, x, out, col0, n):
    """out[:, col0:col0+n] = x @ W.T for every strip (prange) and token tile; `_tile` is bound per format.

    Tiles of 8 tokens (`EIGHT`: paths with 32 vector registers), 4, then 2, then 1: odd vector widths
    (3 x 16 lanes) compile to slow code. The rows computed are out's; x may hold a spare row after
    them (`QuantRows.quantize(spare=True)` and the layers' `_quantized` give one), and then a last 3
    (or 7) tokens run as one padded tile of 4 (or 8) whose last row is not stored: the same bits per
    row (each row's sums and combine are its own), one pass over the strip instead of 2 + 1 (or
    4 + 2 + 1). Xeon, whole forward at 300 tokens of context: T = 3 5.39 -> 4.89 ms (T = 4: 5.04),
    T = 7 8.93 -> 7.57 ms (T = 8: 7.33).
    """
    num_tokens = min(out.shape[0], x[0].shape[0])
    room = x[0].shape[0]  # rows of x that may be read
    stride = out.shape[1]
    for s in nb.prange((n + 15) // 16):
        rows = min(16, n - 16 * s)
        o = col0 + 16 * s
        t0 = 0
        if EIGHT:  # noqa: F821  (bound per path by specialize)
            while num_tokens - t0 >= 8:
                store_rows(out, t0 * stride + o, stride, _tile(w, x, s, t0, 8), rows)  # noqa: F821
                t0 += 8
            if num_tokens - t0 == 7 and room - t0 >= 8:
                store_first_rows(out, t0 * stride + o, stride, _tile(w, x, s, t0, 8), rows, 7)  # noqa: F821
                t0 += 7
        while num_tokens - t0 >= 4:
            store_rows(out, t0 * stride + o, stride, _tile(w, x, s, t0, 4), rows)  # noqa: F821
            t0 += 4
        if num_tokens - t0 == 3 and room - t0 >= 4:
            store_first_rows(out, t0 * stride + o, stride, _tile(w, x, s, t0, 4), rows, 3)  # noqa: F821
            t0 += 3
        if num_tokens - t0 >= 2:
            store_rows(out, t0 * stride + o, stride, _tile(w, x, s, t0, 2), rows)  # noqa: F821
            t0 += 2
        if num_tokens - t0 == 1:
            store_rows(out, t0 * stride + o, stride, _tile(w, x, s, t0, 1), rows)  # noqa: F821


def _traits(fmt: str) -> dict:
    """int_tiles' per-format constants."""
    return {"HIGH_BIT": fmt in ("q5_0", "q5_1", "q5_k"), "OFFSET": fmt in ("q4_0", "q5_0")}


def kernel(fmt: str, path: str):
    """The compiled weight product for one format on one ISA path (built on first use)."""
    key = (fmt, path)
    with _lock:
        if key not in _kernels:
            family = specialize_family(_TILE_FUNCTIONS, path, _traits(fmt), tag=fmt)
            _kernels[key] = specialize(_gemm, path, {"_tile": family[TILES[fmt]], "EIGHT": path in EIGHT_TOKEN_PATHS}, tag=fmt)
        return _kernels[key]


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
