"""GGUF integer weights repacked once at load for the integer kernels (int_tiles), losslessly.

A strip is 16 output rows (the vector lanes, see simd). Per 32-weight block b of a strip:
  nibbles  4 x 64 bytes; vector g, byte 4r+e = (q[r, 32b+4g+e] & 15) | (q[r, 32b+16+4g+e] & 15) << 4
           (low nibbles: k 0..15 of the block, high nibbles: k 16..31)
  qh       5-bit formats, 64 bytes; byte 4r+e, bit g / 4+g = bit 4 of the low / high weight of group g
  qh2      Q6_K, 2 x 64 bytes; vector h, byte 4r+e, bits 2g..2g+1 = bits 4..5 of q[r, 32b+16h+4g+e]
  crumbs   Q3_K / Q2_K, 2 x 64 bytes; as qh2, of bits 0..1 (Q3_K: bit 2 in a qh laid out as the 5-bit formats')
  q8       Q8_0, 8 x 64 bytes; vector g, byte 4r+e = q[r, 32b+4g+e] (int8)
IQ4_NL / IQ4_XS keep their 4-bit indices into IQ4_NL's 16-value table as `nibbles`; the tiles look the
values up (simd_paths.iq4_values).
Scales are kept in their GGUF widths (fp16, 6-bit ints as uint8, int8), one 16-lane row per strip
and block (or super-block). Integer quant values come from gguf-py's own dequantizer run on the
blocks with their scales set to 1 and their minimums to 0, so they are gguf's values by construction.

What each format means (q: the unsigned quant, per row r and block; D, M exact in float32):
  q4_0 / q5_0   w = d * (q - 8 | 16)          q4_1 / q5_1   w = d * q + m
  q8_0          w = d * q (q signed)           q4_k / q5_k   w = (d * sc) * q - (dmin * mn)
  q6_k          w = (d * sc16) * (q - 32), a scale per 16 weights (int8)
  q3_k          w = (d * sc16) * (q - 4), sc16 = the 6-bit scale - 32 (int8)
  q2_k          w = (d * sc16) * q - (dmin * m16), sc16 | m16 << 4 one byte per 16 weights, as in the file
  iq4_nl        w = d * q                      iq4_xs        w = (d * (ls - 32)) * q, ls 6 bits per block
  (both as their table indices in q4_0's nibble layout; iq4_xs's ls - 32 as int8, its d per super-block)
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np

from engine.kernels.simd_paths import IQ4_NL_VALUES
from engine.kernels.weights import matrix_shape

Q = gguf.GGMLQuantizationType
STRIP = 16
QK = 32
QK_K = 256
ONE_F16 = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)  # the two bytes of fp16 1.0
# type: (format name, bytes per block, weights per block)
FORMATS = {
    Q.Q4_0: ("q4_0", 18, QK), Q.Q4_1: ("q4_1", 20, QK), Q.Q5_0: ("q5_0", 22, QK), Q.Q5_1: ("q5_1", 24, QK),
    Q.Q8_0: ("q8_0", 34, QK), Q.Q4_K: ("q4_k", 144, QK_K), Q.Q5_K: ("q5_k", 176, QK_K), Q.Q6_K: ("q6_k", 210, QK_K),
    Q.IQ4_NL: ("iq4_nl", 18, QK), Q.IQ4_XS: ("iq4_xs", 136, QK_K), Q.Q3_K: ("q3_k", 110, QK_K), Q.Q2_K: ("q2_k", 84, QK_K),
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


def _rows(a: np.ndarray, n: int) -> np.ndarray:
    """[n, ...] -> [S * 16, ...], zero-padded to whole strips."""
    padded = np.zeros((-(-n // STRIP) * STRIP,) + a.shape[1:], a.dtype)
    padded[:n] = a
    return padded


def _lanes(a: np.ndarray, n: int) -> np.ndarray:
    """Per-row values [n, blocks] -> [S, blocks, 16] flat: one 16-lane row per strip and block."""
    p = _rows(a, n)
    return np.ascontiguousarray(p.reshape(-1, STRIP, a.shape[1]).transpose(0, 2, 1)).reshape(-1)


def _groups(q: np.ndarray, n: int) -> np.ndarray:
    """[n, k] bytes -> [S, nb, 8 groups, 16 rows, 4] flat: group g is k 4g..4g+3 of each block."""
    p = _rows(q, n)
    s, k = p.shape[0] // STRIP, p.shape[1]
    return np.ascontiguousarray(p.reshape(s, STRIP, k // QK, 8, 4).transpose(0, 2, 3, 1, 4))


def _nibbles(q: np.ndarray, n: int) -> np.ndarray:
    g = _groups(q & np.uint8(15), n)  # [S, nb, 8, 16, 4]
    return (g[:, :, :4] | (g[:, :, 4:] << np.uint8(4))).reshape(-1)


def _high_bits(q: np.ndarray, n: int, bit: int = 4) -> np.ndarray:
    """Bit `bit` of each weight: one byte per (row, e) holds the 8 groups' bits."""
    g = (_groups(q, n) >> np.uint8(bit)) & np.uint8(1)  # [S, nb, 8, 16, 4]
    weights = (np.uint8(1) << np.arange(8, dtype=np.uint8)).reshape(1, 1, 8, 1, 1)
    return (g * weights).sum(axis=2, dtype=np.uint8).reshape(-1)


def _high_pairs(q: np.ndarray, n: int, low: int = 4) -> np.ndarray:
    """Bits low..low+1 of each weight: vector h holds groups 4h..4h+3, two bits each."""
    g = (_groups(q, n) >> np.uint8(low)) & np.uint8(3)  # [S, nb, 8, 16, 4]
    g = g.reshape(g.shape[0], g.shape[1], 2, 4, STRIP, 4)
    shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 1, 4, 1, 1)
    return (g << shifts).sum(axis=3, dtype=np.uint8).reshape(-1)


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The fp16 field at byte `offset` of each block, as uint16 bits [n, blocks]."""
    return np.ascontiguousarray(blocks[:, :, offset : offset + 2]).view(np.uint16)[:, :, 0]


def _quants(blocks: np.ndarray, kind, unit_scales: dict, offset: int) -> np.ndarray:
    """Integer quants [n, k]: gguf's dequantize of the blocks with scales 1 and minimums 0, + offset."""
    unit = blocks.copy()
    for at, value in unit_scales.items():
        unit[:, :, at : at + len(value)] = value
    values = gguf.quants.dequantize(unit.reshape(blocks.shape[0], -1), kind) + offset
    return values.astype(np.int16).astype(np.uint8 if offset >= 0 else np.int8)


_ZERO2 = np.zeros(2, np.uint8)
_K_UNIT = np.array([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1], np.uint8)  # 6-bit scales 1, minimums 0


_XS_UNIT = {0: ONE_F16, 2: np.array([0xAA, 0xAA], np.uint8), 4: np.full(4, 0x11, np.uint8)}  # d 1, every ls 33


def _iq4_xs_scales(blocks: np.ndarray) -> np.ndarray:
    """ls - 32 of each block of 32 [n, k / 32] int8: ls = 4 low bits (scales_l) | 2 high bits (scales_h) << 4."""
    n, nsb = blocks.shape[:2]
    high = np.ascontiguousarray(blocks[:, :, 2:4]).view(np.uint16)  # [n, nsb, 1]
    high = (high >> (2 * np.arange(8, dtype=np.uint16))) & np.uint16(3)  # [n, nsb, 8]
    low = blocks[:, :, 4:8, None] >> np.array([0, 4], np.uint8)  # [n, nsb, 4, 2]: blocks 2j, 2j + 1
    ls = (low.reshape(n, nsb, 8) & np.uint8(15)) | (high.astype(np.uint8) << np.uint8(4))
    return (ls.astype(np.int16) - 32).astype(np.int8).reshape(n, -1)


def _pack_iq4(kind, blocks: np.ndarray, n: int) -> tuple:
    """IQ4_NL / IQ4_XS: the table indices as nibbles, d (per block / super-block) and sc (per block; none for IQ4_NL)."""
    xs = kind == Q.IQ4_XS
    values = _quants(blocks, kind, _XS_UNIT if xs else {0: ONE_F16}, 0).view(np.int8)  # [n, k] gguf's table values
    q = np.searchsorted(np.array(IQ4_NL_VALUES, np.int8), values).astype(np.uint8)  # their indices
    d = _f16(blocks, 0)  # [n, super-blocks or blocks]
    return _nibbles(q, n), _lanes(d, n), _lanes(_iq4_xs_scales(blocks), n) if xs else _NO_BITS


# Q3_K with d 1 and every 6-bit scale 33 (low nibbles 1, high bit pairs 2): gguf gives q - 4
_Q3_UNIT = {96: np.array([0x11] * 8 + [0xAA] * 4, np.uint8), 108: ONE_F16}
# ... and with quants 1 (every crumb 1, every hmask bit set: no - 4): gguf gives the scales - 32
_Q3_SCALES = {0: np.full(32, 0xFF, np.uint8), 32: np.full(64, 0x55, np.uint8), 108: ONE_F16}


def _pack_low_bits(kind, blocks: np.ndarray, n: int) -> tuple:
    """Q3_K as (crumbs, qh, d, sc int8 per 16); Q2_K as (crumbs, d, dmin, sc | m << 4 per 16)."""
    if kind == Q.Q3_K:
        q = _quants(blocks, kind, _Q3_UNIT, 4)
        scales = _quants(blocks, kind, _Q3_SCALES, 0).view(np.int8)[:, ::16]  # [n, k / 16]
        return _high_pairs(q, n, 0), _high_bits(q, n, 2), _lanes(_f16(blocks, 108), n), _lanes(scales, n)
    q = _quants(blocks, kind, {0: np.ones(16, np.uint8), 80: ONE_F16, 82: _ZERO2}, 0)  # scales 1, minimums 0
    scales = np.ascontiguousarray(blocks[:, :, :16]).reshape(n, -1)
    return _high_pairs(q, n, 0), _lanes(_f16(blocks, 80), n), _lanes(_f16(blocks, 82), n), _lanes(scales, n)


_NO_BITS = np.zeros(1, np.uint8)  # stands in for the bit-4 plane of 4-bit formats
_OFFSETS = {"q4_0": np.array([8], np.uint16), "q5_0": np.array([16], np.uint16)}  # stand in for m


def _pack_blocks(fmt: str, kind, blocks: np.ndarray, n: int) -> tuple:
    """The arrays in the order the format's tile reads them (int_tiles), from blocks [n, nblocks, bytes]."""
    if fmt in ("iq4_nl", "iq4_xs"):
        return _pack_iq4(kind, blocks, n)
    if fmt in ("q3_k", "q2_k"):
        return _pack_low_bits(kind, blocks, n)
    if fmt == "q8_0":
        q = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(n, -1)
        return _groups(q, n).reshape(-1), _lanes(_f16(blocks, 0), n)
    if fmt == "q6_k":  # ql (128) | qh (64) | 16 int8 scales | fp16 d
        q = _quants(blocks, kind, {192: np.ones(16, np.uint8), 208: ONE_F16}, 32)
        scales = np.ascontiguousarray(blocks[:, :, 192:208]).view(np.int8).reshape(n, -1)
        return _nibbles(q, n), _high_pairs(q, n), _lanes(_f16(blocks, 208), n), _lanes(scales, n)
    five_bit = fmt in ("q5_0", "q5_1", "q5_k")
    if fmt in ("q4_k", "q5_k"):
        q = _quants(blocks, kind, {0: ONE_F16, 2: _ZERO2, 4: _K_UNIT}, 0)
        sc, mn = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, :, 4:16]).reshape(-1, 12))
        scales = (_lanes(_f16(blocks, 0), n), _lanes(_f16(blocks, 2), n),
                  _lanes(sc.reshape(n, -1).astype(np.uint8), n), _lanes(mn.reshape(n, -1).astype(np.uint8), n))
    elif fmt in _OFFSETS:
        q = _quants(blocks, kind, {0: ONE_F16}, int(_OFFSETS[fmt][0]))
        scales = (_lanes(_f16(blocks, 0), n), _OFFSETS[fmt])
    else:  # q4_1, q5_1
        q = _quants(blocks, kind, {0: ONE_F16, 2: _ZERO2}, 0)
        scales = (_lanes(_f16(blocks, 0), n), _lanes(_f16(blocks, 2), n))
    return (_nibbles(q, n), _high_bits(q, n) if five_bit else _NO_BITS) + scales


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
    arrays = _pack_blocks(fmt, kind, raw.reshape(n, k // per_block, block_bytes), n)
    return IntWeight(n=n, k=k, fmt=fmt, arrays=arrays, nbytes=sum(a.nbytes for a in arrays))
