"""The i-quants (IQ1_S ... IQ4_XS) and the ternary TQ1_0 / TQ2_0 as 4- or 3-bit indices into a table of values.

Their weights are grid entries (with signs, and for IQ1 a +-1/8 shift) times a scale per 32 or 16 weights
and a d per super-block. At unit scales a tensor's weights take at most 16 distinct integer values (IQ4:
IQ4_NL's 16, IQ3_XXS +-4..62 and IQ3_S +-1..15 (16), IQ2 +-8, 25, 43 and IQ1 +-1, 7, 9 (6), TQ -1, 0, 1), so
each weight is kept as its index into that table (4 bits, in q4_0's nibble layout; 3 bits where the table has
at most 8 values (IQ2, IQ1, TQ), in Q3_K's planes: 2 bits + a third); the tiles look the values up
(simd_paths.lut_values). The values come from gguf-py's own dequantizer run once at load on the blocks
with d = 1 and unit scales: grids and signs are decoded by gguf, not here.

  iq4_nl   w = d * table[q], d fp16 per block (as in the file)
  lut32    w = (d * sc) * table[q], d float32 per super-block (the file's fp16 d times a power of 2: exact),
           sc int8 per 32 weights (lut16: per 16): IQ4_XS ls - 32; IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S (4-bit
           ls), IQ1_S, IQ1_M (3-bit ls) 2 * ls + 1; TQ1_0, TQ2_0 1. IQ4_XS, IQ3_XXS, IQ3_S: lut32; IQ2_XXS, IQ1_S,
           TQ1_0, TQ2_0: lut32_3 (3-bit indices); IQ2_XS, IQ2_S, IQ1_M: lut16_3.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np

from engine.kernels.int_layout import NO_BITS, ONE_F16, QK, QK_K, f16_field, high_bits, high_pairs, lanes, nibbles

Q = gguf.GGMLQuantizationType


def _iq4_xs_scales(blocks: np.ndarray) -> np.ndarray:
    """ls - 32 of each block of 32 [n, k / 32]: ls = 4 low bits (scales_l) | 2 high bits (scales_h) << 4."""
    n, nsb = blocks.shape[:2]
    high = np.ascontiguousarray(blocks[:, :, 2:4]).view(np.uint16)  # [n, nsb, 1]
    high = (high >> (2 * np.arange(8, dtype=np.uint16))) & np.uint16(3)  # [n, nsb, 8]
    low = blocks[:, :, 4:8, None] >> np.array([0, 4], np.uint8)  # [n, nsb, 4, 2]: blocks 2j, 2j + 1
    ls = (low.reshape(n, nsb, 8) & np.uint8(15)) | (high.astype(np.uint8) << np.uint8(4))
    return ls.astype(np.int16).reshape(n, -1) - 32


def _nibbles_of(blocks: np.ndarray, at: int, count: int) -> np.ndarray:
    """The 2 * count nibbles of bytes at..at+count-1 of each block, low nibble first: [n, blocks * 2 * count]."""
    b = blocks[:, :, at : at + count, None] >> np.array([0, 4], np.uint8)
    return (b & np.uint8(15)).reshape(blocks.shape[0], -1).astype(np.int16)


def _bits_of(blocks: np.ndarray, at: int, step: int, shift: int, width: int) -> np.ndarray:
    """Bits shift..shift+width-1 of the byte at `at` of each `step` bytes: [n, blocks * 256 / 32] (one per 32)."""
    b = blocks[:, :, at::step][:, :, : QK_K // QK]
    return ((b >> np.uint8(shift)) & np.uint8((1 << width) - 1)).reshape(blocks.shape[0], -1).astype(np.int16)


def _iq1_m_d(blocks: np.ndarray) -> np.ndarray:
    """IQ1_M's fp16 d, kept in the top nibbles of its four 16-bit scale words: [n, super-blocks] uint16."""
    words = np.ascontiguousarray(blocks[:, :, 48:56]).view(np.uint16)  # [n, nsb, 4]
    return ((words >> np.uint16(12)) << np.array([0, 4, 8, 12], np.uint16)).sum(axis=2, dtype=np.uint16)


def _clear(at: int, step: int, mask: int):
    """A unit-scale edit: AND `mask` into the byte at `at` of each `step` bytes (the 8 per super-block)."""
    def edit(blocks):
        blocks[:, :, at : at + step * (QK_K // QK) : step] &= np.uint8(mask)
    return edit


def _put(at: int, value: np.ndarray):
    """A unit-scale edit: bytes at.. of each block set to `value`."""
    def edit(blocks):
        blocks[:, :, at : at + len(value)] = value
    return edit


@dataclass(frozen=True)
class _Lut:
    """A type kept as 4-bit indices into a table of at most 16 integers v: w = (d * p) * sc * v.

    `unit` edits a block copy to d = 1 and unit scales, for which gguf's dequantizer gives p * v; `scales`
    gives sc per 32 or 16 weights (ints, [n, k / 32 | 16]), `d` the fp16 bits of d per super-block."""

    p: float
    unit: tuple
    scales: object
    d: object = lambda blocks: f16_field(blocks, 0)


def _iq1_m_scales(blocks: np.ndarray) -> np.ndarray:
    """IQ1_M's 3-bit scales, 4 per 16-bit word (bits 0..11): [n, k / 16]."""
    words = np.ascontiguousarray(blocks[:, :, 48:56]).view(np.uint16)[..., None]  # [n, nsb, 4, 1]
    return ((words >> np.array([0, 3, 6, 9], np.uint16)) & np.uint16(7)).reshape(blocks.shape[0], -1).astype(np.int16)


def _ones(blocks: np.ndarray) -> np.ndarray:
    """Scale 1 for every 32 weights (the ternary types have d alone)."""
    return np.ones((blocks.shape[0], blocks.shape[1] * QK_K // QK), np.int16)


_D1 = _put(0, ONE_F16)
LUTS = {
    Q.IQ4_XS: _Lut(1.0, (_D1, _put(2, np.array([0xAA, 0xAA], np.uint8)), _put(4, np.full(4, 0x11, np.uint8))),
                   _iq4_xs_scales),  # every ls 33: sc ls - 32
    Q.IQ3_XXS: _Lut(0.25, (_D1, _clear(69, 4, 0x0F)), lambda b: 2 * _bits_of(b, 69, 4, 4, 4) + 1),
    Q.IQ3_S: _Lut(1.0, (_D1, _put(106, np.zeros(4, np.uint8))), lambda b: 2 * _nibbles_of(b, 106, 4) + 1),
    Q.IQ2_XXS: _Lut(0.125, (_D1, _clear(9, 8, 0x0F)), lambda b: 2 * _bits_of(b, 9, 8, 4, 4) + 1),
    Q.IQ2_XS: _Lut(0.125, (_D1, _put(66, np.zeros(8, np.uint8))), lambda b: 2 * _nibbles_of(b, 66, 8) + 1),
    Q.IQ2_S: _Lut(0.125, (_D1, _put(74, np.zeros(8, np.uint8))), lambda b: 2 * _nibbles_of(b, 74, 8) + 1),
    Q.IQ1_S: _Lut(0.125, (_D1, _clear(35, 2, 0x8F)), lambda b: 2 * _bits_of(b, 35, 2, 4, 3) + 1),
    Q.IQ1_M: _Lut(0.125, (_put(48, np.array([0, 0, 0, 0, 0, 0xC0, 0, 0x30], np.uint8)),),
                  lambda b: 2 * _iq1_m_scales(b) + 1, _iq1_m_d),
    Q.TQ1_0: _Lut(1.0, (_put(52, ONE_F16),), _ones, lambda blocks: f16_field(blocks, 52)),
    Q.TQ2_0: _Lut(1.0, (_put(64, ONE_F16),), _ones, lambda blocks: f16_field(blocks, 64)),
}


def _table(values: np.ndarray, kind, bits: int) -> tuple:
    """values [n, k] float32 (integers) -> (indices [n, k] uint8, the table as 64 bytes: its 16 int8 values in
    each 16-byte lane); a table by counting, not sorting (a 7B model has 7e9 weights)."""
    ints = values.astype(np.int16)
    if not np.array_equal(ints, values) or np.abs(ints).max(initial=0) > 127:
        raise ValueError(f"{kind.name}: weights at unit scale are not integers of int8 range")
    present = np.bincount((ints + 128).ravel(), minlength=256) > 0  # [256]
    table = np.flatnonzero(present) - 128
    if len(table) > 2**bits:
        raise ValueError(f"{kind.name}: weights take {len(table)} values, more than a table of {2**bits}")
    index_of = (np.cumsum(present) - 1).astype(np.uint8)  # [256]: value + 128 -> its index in table
    lane = np.full(16, table[-1], np.int8)  # unused entries repeat the last value
    lane[: len(table)] = table
    return index_of[ints + 128], np.tile(lane, 4).view(np.uint8)


def pack_lut(kind, blocks: np.ndarray, n: int, bits: int) -> tuple:
    """IQ4_NL (d fp16 per block), the other i-quants and the ternary types (d float32 per super-block, sc int8)
    as (lo, hi, d, sc, table): 4-bit indices as nibbles (hi unused) or 3-bit ones as crumbs and third bits."""
    spec = LUTS.get(kind)
    unit = blocks.copy()
    for edit in spec.unit if spec else (_D1,):
        edit(unit)
    values = gguf.quants.dequantize(unit.reshape(n, -1), kind) * np.float32(1 / spec.p if spec else 1.0)  # exact
    q, table = _table(values, kind, bits)
    indices = (nibbles(q, n), NO_BITS) if bits == 4 else (high_pairs(q, n, 0), high_bits(q, n, 2))
    if spec is None:  # IQ4_NL: d per block of 32
        return indices + (lanes(f16_field(blocks, 0), n), NO_BITS, table)
    d = (spec.d(blocks).view(np.float16).astype(np.float32) * np.float32(spec.p))  # exact: p is a power of 2
    return indices + (lanes(d, n), lanes(spec.scales(blocks).astype(np.int8), n), table)
