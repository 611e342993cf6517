"""Weight products y = x @ W.T for small token counts, bit-invariant across T and batch rows.

Two numerics, chosen when a weight is packed:
  int8   GGUF integer formats (Q4_0 ... Q8_0, Q2_K ... Q6_K, IQ1_S ... IQ4_XS, TQ1_0, TQ2_0) stay in their blocks
         (the i-quants as indices into a table of their values, int_pack) and multiply int8-quantized
         activations with exact integer sums (int_linear); other types as exact.
  exact  strict float32: strips of 16 output rows stored k-major (float_tiles); Q4_1 and Q8_0
         keep their exact quants and scales, F16 and BF16 their 2-byte values (widened exactly as
         they are loaded), every other type is dequantized to float32.
F32, F16 and BF16 weights run as exact under both numerics (they have no integer blocks).
In both, row t of `linear`'s output depends only on x[t] and W, never on T, on which kernel the
token count selects, or on the other rows of the batch: speculative verification of T draft
tokens therefore reproduces plain T = 1 decoding bit for bit.
"""

import logging
from dataclasses import dataclass

import gguf
import numpy as np

from engine.kernels import float_tiles, huge_pages, int_linear
from engine.kernels.int_pack import IntWeight, pack_int
from engine.kernels.weights import bf16_bits_to_float32, concat_gguf_rows, matrix_shape

log = logging.getLogger(__name__)
NUMERICS = ("int8", "exact")
STRIP = 16  # output rows per strip
QK = 32  # weights per GGUF Q4_1 / Q8_0 block
# float strip element types: the file's F16 / BF16 values as their bits (see float_tiles)
FLOAT_KINDS = {"f32": np.float32, "f16": np.uint16, "bf16": np.int16}
_F32 = np.dtype(np.float32)
_HALF_TYPES = {gguf.GGMLQuantizationType.F16: "f16", gguf.GGMLQuantizationType.BF16: "bf16"}

_Q4_1_BLOCK_BYTES = 20  # fp16 d, fp16 m, 16 bytes of nibbles
_Q8_0_BLOCK_BYTES = 34  # fp16 d, 32 int8


def float_format(kind: str) -> str:
    """The float_tiles format that runs a PackedWeight kind."""
    return "float" if kind in FLOAT_KINDS else kind


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """One weight matrix W of logical shape [n, k] (out_features, in_features) in strip layout.

    kind "f32":  arrays = (w [S, k, 16] float32,)
    kind "f16" / "bf16": arrays = (w [S, k, 16] uint16 fp16 bits / int16 bf16 bits,)
    kind "q4_1": arrays = (qs [S, k/2, 16] uint8, d [S, k/32, 16] float32, m [S, k/32, 16] float32)
    kind "q8_0": arrays = (qs [S, k, 16] int8, d [S, k/32, 16] float32)
    with S = ceil(n / 16); padding rows are zero. nbytes is what one product streams.
    """

    n: int
    k: int
    kind: str
    arrays: tuple
    nbytes: int

    def dequantize(self) -> np.ndarray:
        """W as float32 [n, k]: exactly the values the kernels multiply with."""
        if self.kind in FLOAT_KINDS:
            strips = _widened(self.arrays[0])
        elif self.kind == "q8_0":
            qs, d = self.arrays
            strips = np.repeat(d, QK, axis=1) * qs.astype(np.float32)
        else:
            qs, d, m = self.arrays
            q = np.empty((qs.shape[0], self.k, STRIP), np.float32)
            q[:, 0::2] = qs & np.uint8(15)
            q[:, 1::2] = qs >> np.uint8(4)
            strips = np.repeat(d, QK, axis=1) * q + np.repeat(m, QK, axis=1)
        return np.ascontiguousarray(strips.transpose(0, 2, 1).reshape(-1, self.k)[: self.n])


def _widened(strips: np.ndarray) -> np.ndarray:
    """Float strips as float32 (exact): fp16 bits (uint16) and bf16 bits (int16) widened."""
    if strips.dtype == np.uint16:
        return strips.view(np.float16).astype(np.float32)
    if strips.dtype == np.int16:
        return bf16_bits_to_float32(strips)
    return strips


def _pack_half(raw: np.ndarray, kind: str, name: str, n: int, k: int) -> PackedWeight:
    """F16 / BF16 rows kept as their 2-byte values (the kernels widen them exactly)."""
    data = np.ascontiguousarray(raw).view(np.uint8)
    if data.size != 2 * n * k:
        raise ValueError(f"{name}: data does not hold {n} rows of {k} {kind.upper()} weights")
    return _packed(n, k, kind, (_to_strips(data.view(FLOAT_KINDS[kind]).reshape(n, k)),))


def _to_strips(rows: np.ndarray) -> np.ndarray:
    """[n, c] -> [ceil(n/16), c, 16]: strips of 16 rows, k-major, zero-padded."""
    n, c = rows.shape
    num_strips = -(-n // STRIP)
    padded = np.zeros((num_strips * STRIP, c), rows.dtype)
    padded[:n] = rows
    return np.ascontiguousarray(padded.reshape(num_strips, STRIP, c).transpose(0, 2, 1))


def _packed(n: int, k: int, kind: str, arrays: tuple) -> PackedWeight:
    arrays = tuple(huge_pages.place(a) for a in arrays)
    nbytes = sum(a.nbytes for a in arrays)
    return PackedWeight(n=n, k=k, kind=kind, arrays=arrays, nbytes=nbytes)


def pack_f32(w: np.ndarray) -> PackedWeight:
    """Pack a float32 [n, k] matrix (y = x @ w.T)."""
    w = np.asarray(w)
    if w.ndim != 2 or w.shape[0] < 1 or w.shape[1] < 1:
        raise ValueError(f"w must be a non-empty 2-D [n, k] matrix, got shape {w.shape}")
    if w.dtype != np.float32:
        raise ValueError(f"w must be float32, got {w.dtype}")
    return _packed(w.shape[0], w.shape[1], "f32", (_to_strips(w),))


def _block_scales(blocks: np.ndarray, offset: int) -> np.ndarray:
    """fp16 field at byte `offset` of each block [n, nb, bytes] -> float32 strips (exact)."""
    scales = np.ascontiguousarray(blocks[:, :, offset : offset + 2]).view(np.float16)[:, :, 0]
    return _to_strips(scales.astype(np.float32))


def _pack_q4_1(blocks: np.ndarray, n: int, k: int) -> PackedWeight:
    """blocks [n, k/32, 20]; GGUF element j < 16 is qs[j] & 15, element j >= 16 is qs[j-16] >> 4."""
    qs = blocks[:, :, 4:]  # [n, nb, 16]
    values = np.concatenate([qs & np.uint8(15), qs >> np.uint8(4)], axis=2).reshape(n, k)
    pairs = values[:, 0::2] | (values[:, 1::2] << np.uint8(4))  # [n, k/2]: even k low, odd k high
    arrays = (_to_strips(pairs), _block_scales(blocks, 0), _block_scales(blocks, 2))
    return _packed(n, k, "q4_1", arrays)


def _pack_q8_0(blocks: np.ndarray, n: int, k: int) -> PackedWeight:
    qs = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(n, k)
    return _packed(n, k, "q8_0", (_to_strips(qs), _block_scales(blocks, 0)))


@dataclass(frozen=True, eq=False)
class WeightParts:
    """Matrices stacked by output rows (q|k|v, gate|up) whose integer formats differ: parts[i] fills
    the output columns from offsets[i]."""

    n: int
    k: int
    parts: tuple
    offsets: tuple
    nbytes: int


Weight = PackedWeight | IntWeight | WeightParts


def _check_numerics(numerics: str) -> None:
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {', '.join(NUMERICS)}, got {numerics!r}")


def pack_gguf_tensor(t, numerics: str = "exact") -> Weight:
    """Pack a 2-D gguf.ReaderTensor (ggml shape [k, n]); Q4_1 and Q8_0 stay exact."""
    _check_numerics(numerics)
    if numerics == "int8":
        packed = pack_int(t)
        if packed is not None:
            return packed
    name, k, n = matrix_shape(t)
    kind = gguf.GGMLQuantizationType(t.tensor_type)
    if numerics == "int8" and kind not in _HALF_TYPES:
        _say_float_fallback(kind)
    raw = np.asarray(t.data)
    if kind in _HALF_TYPES:
        return _pack_half(raw, _HALF_TYPES[kind], name, n, k)
    if kind in (gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0):
        block_bytes = _Q4_1_BLOCK_BYTES if kind == gguf.GGMLQuantizationType.Q4_1 else _Q8_0_BLOCK_BYTES
        if k % QK or raw.dtype != np.uint8 or raw.size != n * (k // QK) * block_bytes:
            raise ValueError(f"{name}: data does not hold {n} rows of {k} {kind.name} weights")
        blocks = raw.reshape(n, k // QK, block_bytes)
        return (_pack_q4_1 if block_bytes == _Q4_1_BLOCK_BYTES else _pack_q8_0)(blocks, n, k)
    try:
        w = gguf.quants.dequantize(raw, kind)
    except NotImplementedError as exc:
        raise ValueError(f"{name}: tensor_type {kind.name} cannot be dequantized") from exc
    if w.size != n * k:
        raise ValueError(f"{name}: data holds {w.size} weights, shape {[k, n]} needs {n * k}")
    return pack_f32(np.asarray(w, np.float32).reshape(n, k))


_fallbacks_said: set = set()


def _say_float_fallback(kind) -> None:
    """Once per type and process: a type with no integer kernel runs as float32, several times its bytes."""
    if kind not in _fallbacks_said and kind != gguf.GGMLQuantizationType.F32:
        _fallbacks_said.add(kind)
        block, size = gguf.GGML_QUANT_SIZES[kind]
        log.warning("weights of type %s have no integer kernel: they run as float32, dequantized at load "
                    "(%.1fx their bytes in the file)", kind.name, 4 * block / size)


def pack_gguf_rows(tensors, numerics: str = "exact") -> Weight:
    """Pack matrices that share an input as one product (q|k|v, gate|up).

    One GGUF type: their blocks are concatenated. Several integer types under int8: one part per
    tensor. Otherwise (exact numerics, float types mixed in) one float32 matrix.
    """
    _check_numerics(numerics)
    types = {t.tensor_type for t in tensors}
    if numerics == "int8" and len(types) > 1:
        parts = [pack_int(t) for t in tensors]
        if all(p is not None for p in parts):
            offsets = tuple(int(v) for v in np.cumsum([0] + [p.n for p in parts[:-1]]))
            return WeightParts(sum(p.n for p in parts), parts[0].k, tuple(parts), offsets, sum(p.nbytes for p in parts))
        for t, p in zip(tensors, parts):  # the stack runs as float32 below: name the types that made it so
            if p is None:
                _say_float_fallback(gguf.GGMLQuantizationType(t.tensor_type))
    return pack_gguf_tensor(concat_gguf_rows(tensors), numerics)


def _check(x: np.ndarray, w: Weight, out: np.ndarray) -> None:
    """Cheap on the hot path (one call per weight product); names the bad field otherwise."""
    if not isinstance(w, (PackedWeight, IntWeight, WeightParts)):
        raise ValueError(f"w must be a packed weight, got {type(w).__name__}")
    for field, a, cols in (("x", x, w.k), ("out", out, w.n)):
        if not isinstance(a, np.ndarray) or a.dtype != _F32 or a.ndim != 2:
            raise ValueError(f"{field} must be a 2-D float32 array")
        if a.shape[1] != cols or not a.flags.c_contiguous:
            raise ValueError(f"{field} must be C-contiguous [T, {cols}], got shape {a.shape}")
    if out.shape[0] != x.shape[0] or not out.flags.writeable:
        raise ValueError(f"out must be a writeable [{x.shape[0]}, {w.n}] array, got shape {out.shape}")
    if np.may_share_memory(x, out):  # the kernels are compiled assuming no overlap
        raise ValueError("out must not overlap x")


def linear(x: np.ndarray, w: Weight, out: np.ndarray) -> None:
    """out [T, n] = x [T, k] @ W.T; each row of out depends on its row of x alone."""
    _check(x, w, out)
    if x.shape[0] == 0:
        return
    if not isinstance(w, PackedWeight):
        xq = int_linear.quantize(x, spare=True)  # x rows + 1: padded last tiles (int_linear._gemm)
        for part, col0 in zip(w.parts, w.offsets) if isinstance(w, WeightParts) else ((w, 0),):
            int_linear.matmul(xq, part, out, col0)
    else:
        float_tiles.kernel(float_format(w.kind), int_linear.host_path())(x, w.arrays, out)
