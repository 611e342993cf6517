"""GGUF integer weights repacked once at load for the integer kernels (int_tiles), losslessly.

A strip is 16 output rows (the vector lanes, see simd). Per 32-weight block b of a strip:
  nibbles  4 x 64 bytes; vector g, byte 4r+e = (q[r, 32b+4g+e] & 15) | (q[r, 32b+16+4g+e] & 15) << 4
           (low nibbles: k 0..15 of the block, high nibbles: k 16..31)
  qh       5-bit formats, 64 bytes; byte 4r+e, bit g / 4+g = bit 4 of the low / high weight of group g
  qh2      Q6_K, 2 x 64 bytes; vector h, byte 4r+e, bits 2g..2g+1 = bits 4..5 of q[r, 32b+16h+4g+e]
  crumbs   Q3_K / Q2_K, 2 x 64 bytes; as qh2, of bits 0..1 (Q3_K: bit 2 in a qh laid out as the 5-bit formats')
  q8       Q8_0, 8 x 64 bytes; vector g, byte 4r+e = q[r, 32b+4g+e] (int8)
The i-quants (IQ1_S ... IQ4_XS) and the ternary TQ1_0 / TQ2_0 keep, as `nibbles`, 4-bit indices into a
table of their values (int_lut).
Scales are kept in their GGUF widths (fp16, 6-bit ints as uint8, int8), one 16-lane row per strip
and block (or super-block). Integer quant values come from gguf-py's own dequantizer run on the
blocks with their scales set to 1 and their minimums to 0, so they are gguf's values by construction.

What each format means (q: the unsigned quant, per row r and block; D, M exact in float32):
  q4_0 / q5_0   w = d * (q - 8 | 16)          q4_1 / q5_1   w = d * q + m
  q8_0          w = d * q (q signed)           q4_k / q5_k   w = (d * sc) * q - (dmin * mn)
  q6_k          w = (d * sc16) * (q - 32), a scale per 16 weights (int8)
  q3_k          w = (d * sc16) * (q - 4), sc16 = the 6-bit scale - 32 (int8)
  q2_k          w = (d * sc16) * q - (dmin * m16), sc16 | m16 << 4 one byte per 16 weights, as in the file
  iq4_nl, lut32, lut32_3, lut16_3   w = (d * sc) * table[q] (int_lut)
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np

from engine.kernels import huge_pages
from engine.kernels.int_layout import (
    NO_BITS,
    ONE_F16,
    QK,
    QK_K,
    STRIP,
    f16_field,
    groups,
    high_bits,
    high_pairs,
    lanes,
    nibbles,
)
from engine.kernels.int_lut import pack_lut
from engine.kernels.weights import matrix_shape

Q = gguf.GGMLQuantizationType
# type: (format name, bytes per block, weights per block)
FORMATS = {
    Q.Q4_0: ("q4_0", 18, QK), Q.Q4_1: ("q4_1", 20, QK), Q.Q5_0: ("q5_0", 22, QK), Q.Q5_1: ("q5_1", 24, QK),
    Q.Q8_0: ("q8_0", 34, QK), Q.Q4_K: ("q4_k", 144, QK_K), Q.Q5_K: ("q5_k", 176, QK_K), Q.Q6_K: ("q6_k", 210, QK_K),
    Q.Q3_K: ("q3_k", 110, QK_K), Q.Q2_K: ("q2_k", 84, QK_K), Q.IQ4_NL: ("iq4_nl", 18, QK),
    Q.IQ4_XS: ("lut32", 136, QK_K), Q.IQ3_XXS: ("lut32", 98, QK_K), Q.IQ3_S: ("lut32", 110, QK_K),
    Q.IQ2_XXS: ("lut32_3", 66, QK_K), Q.IQ2_XS: ("lut16_3", 74, QK_K), Q.IQ2_S: ("lut16_3", 82, QK_K),
    Q.IQ1_S: ("lut32_3", 50, QK_K), Q.IQ1_M: ("lut16_3", 56, QK_K), Q.TQ1_0: ("lut32_3", 54, QK_K),
    Q.TQ2_0: ("lut32_3", 66, QK_K),
}


@dataclass(frozen=True, eq=False)
class IntWeight:
    """One weight matrix [n, k] for the integer kernels; `arrays` as the format's tile reads them."""

    n: int
    k: int
    fmt: str
    arrays: tuple
    nbytes: int

    @property
    def num_strips(self) -> int:
        return -(-self.n // STRIP)


def _quants(blocks: np.ndarray, kind, unit_scales: dict, offset: int) -> np.ndarray:
    """Integer quants [n, k]: gguf's dequantize of the blocks with scales 1 and minimums 0, + offset."""
    unit = blocks.copy()
    for at, value in unit_scales.items():
        unit[:, :, at : at + len(value)] = value
    values = gguf.quants.dequantize(unit.reshape(blocks.shape[0], -1), kind) + offset
    return values.astype(np.int16).astype(np.uint8 if offset >= 0 else np.int8)


_ZERO2 = np.zeros(2, np.uint8)
_K_UNIT = np.array([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1], np.uint8)  # 6-bit scales 1, minimums 0


# Q3_K with d 1 and every 6-bit scale 33 (low nibbles 1, high bit pairs 2): gguf gives q - 4
_Q3_UNIT = {96: np.array([0x11] * 8 + [0xAA] * 4, np.uint8), 108: ONE_F16}
# ... and with quants 1 (every crumb 1, every hmask bit set: no - 4): gguf gives the scales - 32
_Q3_SCALES = {0: np.full(32, 0xFF, np.uint8), 32: np.full(64, 0x55, np.uint8), 108: ONE_F16}


def _pack_low_bits(kind, blocks: np.ndarray, n: int) -> tuple:
    """Q3_K as (crumbs, qh, d, sc int8 per 16); Q2_K as (crumbs, d, dmin, sc | m << 4 per 16)."""
    if kind == Q.Q3_K:
        q = _quants(blocks, kind, _Q3_UNIT, 4)
        scales = _quants(blocks, kind, _Q3_SCALES, 0).view(np.int8)[:, ::16]  # [n, k / 16]
        return high_pairs(q, n, 0), high_bits(q, n, 2), lanes(f16_field(blocks, 108), n), lanes(scales, n)
    q = _quants(blocks, kind, {0: np.ones(16, np.uint8), 80: ONE_F16, 82: _ZERO2}, 0)  # scales 1, minimums 0
    scales = np.ascontiguousarray(blocks[:, :, :16]).reshape(n, -1)
    return high_pairs(q, n, 0), lanes(f16_field(blocks, 80), n), lanes(f16_field(blocks, 82), n), lanes(scales, n)


_OFFSETS = {"q4_0": np.array([8], np.uint16), "q5_0": np.array([16], np.uint16)}  # stand in for m


def _pack_blocks(fmt: str, kind, blocks: np.ndarray, n: int) -> tuple:
    """The arrays in the order the format's tile reads them (int_tiles), from blocks [n, nblocks, bytes]."""
    if fmt in ("iq4_nl", "lut32", "lut32_3", "lut16_3"):
        return pack_lut(kind, blocks, n, 3 if fmt.endswith("_3") else 4)
    if fmt in ("q3_k", "q2_k"):
        return _pack_low_bits(kind, blocks, n)
    if fmt == "q8_0":
        q = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(n, -1)
        return groups(q, n).reshape(-1), lanes(f16_field(blocks, 0), n)
    if fmt == "q6_k":  # ql (128) | qh (64) | 16 int8 scales | fp16 d
        q = _quants(blocks, kind, {192: np.ones(16, np.uint8), 208: ONE_F16}, 32)
        scales = np.ascontiguousarray(blocks[:, :, 192:208]).view(np.int8).reshape(n, -1)
        return nibbles(q, n), high_pairs(q, n), lanes(f16_field(blocks, 208), n), lanes(scales, n)
    five_bit = fmt in ("q5_0", "q5_1", "q5_k")
    if fmt in ("q4_k", "q5_k"):
        q = _quants(blocks, kind, {0: ONE_F16, 2: _ZERO2, 4: _K_UNIT}, 0)
        sc, mn = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, :, 4:16]).reshape(-1, 12))
        scales = (lanes(f16_field(blocks, 0), n), lanes(f16_field(blocks, 2), n),
                  lanes(sc.reshape(n, -1).astype(np.uint8), n), lanes(mn.reshape(n, -1).astype(np.uint8), n))
    elif fmt in _OFFSETS:
        q = _quants(blocks, kind, {0: ONE_F16}, int(_OFFSETS[fmt][0]))
        scales = (lanes(f16_field(blocks, 0), n), _OFFSETS[fmt])
    else:  # q4_1, q5_1
        q = _quants(blocks, kind, {0: ONE_F16, 2: _ZERO2}, 0)
        scales = (lanes(f16_field(blocks, 0), n), lanes(f16_field(blocks, 2), n))
    return (nibbles(q, n), high_bits(q, n) if five_bit else NO_BITS) + scales


def pack_int(t) -> IntWeight | None:
    """Repack a 2-D GGUF tensor (ggml shape [k, n]) for the integer kernels; None for other types."""
    kind = gguf.GGMLQuantizationType(t.tensor_type)
    if kind not in FORMATS:
        return None
    name, k, n = matrix_shape(t)
    fmt, block_bytes, per_block = FORMATS[kind]
    raw = np.asarray(t.data)
    if k % per_block or raw.dtype != np.uint8 or raw.size != n * (k // per_block) * block_bytes:
        raise ValueError(f"{name}: data does not hold {n} rows of {k} {kind.name} weights")
    arrays = tuple(huge_pages.place(a) for a in _pack_blocks(fmt, kind, raw.reshape(n, k // per_block, block_bytes), n))
    return IntWeight(n=n, k=k, fmt=fmt, arrays=arrays, nbytes=sum(a.nbytes for a in arrays))
