"""The strip layout of the integer kernels' weights (see int_pack): 16 rows a strip, blocks of 32 weights,
each block's bytes as the tiles load them (int_tiles)."""

from __future__ import annotations

import numpy as np

STRIP = 16
QK = 32
QK_K = 256
ONE_F16 = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)  # the two bytes of fp16 1.0
NO_BITS = np.zeros(1, np.uint8)  # stands in for an array a format does not have (the bit-4 plane of 4-bit formats)


def rows(a: np.ndarray, n: int) -> np.ndarray:
    """[n, ...] -> [S * 16, ...], zero-padded to whole strips."""
    padded = np.zeros((-(-n // STRIP) * STRIP,) + a.shape[1:], a.dtype)
    padded[:n] = a
    return padded


def lanes(a: np.ndarray, n: int) -> np.ndarray:
    """Per-row values [n, blocks] -> [S, blocks, 16] flat: one 16-lane row per strip and block."""
    p = rows(a, n)
    return np.ascontiguousarray(p.reshape(-1, STRIP, a.shape[1]).transpose(0, 2, 1)).reshape(-1)


def groups(q: np.ndarray, n: int) -> np.ndarray:
    """[n, k] bytes -> [S, nb, 8 groups, 16 rows, 4] flat: group g is k 4g..4g+3 of each block."""
    p = rows(q, n)
    s, k = p.shape[0] // STRIP, p.shape[1]
    return np.ascontiguousarray(p.reshape(s, STRIP, k // QK, 8, 4).transpose(0, 2, 3, 1, 4))


def nibbles(q: np.ndarray, n: int) -> np.ndarray:
    g = groups(q & np.uint8(15), n)  # [S, nb, 8, 16, 4]
    return (g[:, :, :4] | (g[:, :, 4:] << np.uint8(4))).reshape(-1)


def high_bits(q: np.ndarray, n: int, bit: int = 4) -> np.ndarray:
    """Bit `bit` of each weight: one byte per (row, e) holds the 8 groups' bits."""
    g = (groups(q, n) >> np.uint8(bit)) & np.uint8(1)  # [S, nb, 8, 16, 4]
    weights = (np.uint8(1) << np.arange(8, dtype=np.uint8)).reshape(1, 1, 8, 1, 1)
    return (g * weights).sum(axis=2, dtype=np.uint8).reshape(-1)


def high_pairs(q: np.ndarray, n: int, low: int = 4) -> np.ndarray:
    """Bits low..low+1 of each weight: vector h holds groups 4h..4h+3, two bits each."""
    g = (groups(q, n) >> np.uint8(low)) & np.uint8(3)  # [S, nb, 8, 16, 4]
    g = g.reshape(g.shape[0], g.shape[1], 2, 4, STRIP, 4)
    shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 1, 4, 1, 1)
    return (g << shifts).sum(axis=3, dtype=np.uint8).reshape(-1)


def f16_field(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The fp16 field at byte `offset` of each block, as uint16 bits [n, blocks]."""
    return np.ascontiguousarray(blocks[:, :, offset : offset + 2]).view(np.uint16)[:, :, 0]
