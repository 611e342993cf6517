"""Helpers on raw GGUF tensors: fuse matrices that share an input, gather embedding rows."""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numba as nb
import numpy as np


@dataclass(frozen=True)
class RawTensor:
    """The subset of gguf.ReaderTensor the packers read: ggml shape [K, N] and raw row data."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, int]
    data: np.ndarray  # [N, bytes or elements per row]


def matrix_shape(t) -> tuple[str, int, int]:
    """(name, k, n) of a 2-D GGUF weight (ggml shape [k, n]); a ValueError naming it otherwise."""
    name = getattr(t, "name", "tensor")
    shape = [int(v) for v in t.shape]
    if len(shape) != 2 or min(shape) < 1:
        raise ValueError(f"{name}: shape must be a 2-D [k, n] weight, got {shape}")
    return name, shape[0], shape[1]


def expert_matrix(t, expert: int) -> RawTensor:
    """Expert `expert`'s [k, n] matrix of a 3-D GGUF tensor (ggml shape [k, n, experts]), a view of its rows."""
    k, n = int(t.shape[0]), int(t.shape[1])
    return RawTensor(f"{t.name}[{expert}]", t.tensor_type, (k, n), np.asarray(t.data)[expert])


def concat_gguf_rows(tensors) -> RawTensor:
    """Stack several [N_i, K] weights into one [sum N_i, K] weight (q|k|v, gate|up).

    Rows are independent in every GGUF format, so the raw blocks are concatenated as
    they are; mixed formats fall back to float32. Each output element is computed
    exactly as it would be from the separate matrices.
    """
    k = int(tensors[0].shape[0])
    n = sum(int(t.shape[1]) for t in tensors)
    name = "+".join(t.name for t in tensors)
    types = {t.tensor_type for t in tensors}
    if len(types) == 1:
        data = np.concatenate([np.asarray(t.data).reshape(int(t.shape[1]), -1) for t in tensors], axis=0)
        return RawTensor(name, tensors[0].tensor_type, (k, n), data)
    dense = [gguf.quants.dequantize(t.data, t.tensor_type).reshape(int(t.shape[1]), k) for t in tensors]
    return RawTensor(name, gguf.GGMLQuantizationType.F32, (k, n), np.concatenate(dense, axis=0).astype(np.float32))


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """bf16 values held as 2-byte integers (uint16 or int16 bits) as float32, exact: they are its high half."""
    return (np.ascontiguousarray(bits).view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def embed_rows(embed, token_ids: np.ndarray, out: np.ndarray) -> None:
    """out[i] = dequantized embedding row of token_ids[i]; out: [num_tokens, hidden]."""
    rows = np.asarray(embed.data)[token_ids]
    out[:] = gguf.quants.dequantize(rows, embed.tensor_type).reshape(out.shape)


@nb.njit(cache=True)
def _gather_q8_0(quants, scales, token_ids, out):
    """out[i] = rows token_ids[i] of a Q8_0 table: quants [rows, blocks, 32] int8 times scales [rows, blocks]."""
    for i in range(token_ids.shape[0]):
        t = token_ids[i]
        for b in range(quants.shape[1]):
            d = scales[t, b]
            for j in range(32):
                out[i, 32 * b + j] = np.float32(quants[t, b, j]) * d


class EmbeddingTable:
    """Rows of a GGUF embedding tensor, dequantized on demand to exactly gguf's values.

    Q8_0 (the usual type of a token_embd) is gathered by a compiled loop over its int8 values and
    float32 scales (kept beside the file's bytes: 4 bytes per 32 weights); F32 / F16 / BF16 rows are indexed;
    any other type goes through gguf's dequantizer. (gguf's Python path cost ~50-250 us per call for
    one or two rows, a share of a decode step.)
    """

    def __init__(self, tensor):
        self.tensor = tensor
        self.kind = gguf.GGMLQuantizationType(tensor.tensor_type)
        data = np.asarray(tensor.data)
        self.quants = self.scales = None
        if self.kind == gguf.GGMLQuantizationType.Q8_0:
            blocks = data.reshape(data.shape[0], -1, 34)  # [rows, blocks, fp16 d | 32 int8]
            self.scales = np.ascontiguousarray(blocks[:, :, :2]).view(np.float16)[:, :, 0].astype(np.float32)
            self.quants = blocks[:, :, 2:].view(np.int8)  # a view of the file's bytes
        self.data = data

    def rows(self, token_ids: np.ndarray, out: np.ndarray) -> None:
        """out[i] = dequantized row token_ids[i]; out: [num_tokens, hidden] float32."""
        ids = np.asarray(token_ids, np.int64)
        if self.quants is not None:
            _gather_q8_0(self.quants, self.scales, ids, out)
        elif self.kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            out[:] = self.data[ids]
        elif self.kind == gguf.GGMLQuantizationType.BF16:
            out[:] = bf16_bits_to_float32(self.data[ids])
        else:
            embed_rows(self.tensor, ids, out)
