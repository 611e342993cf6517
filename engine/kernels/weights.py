"""Helpers on raw GGUF tensors: fuse matrices that share an input, gather embedding rows."""

from __future__ import annotations

from dataclasses import dataclass

import gguf
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


def embed_rows(embed, token_ids: np.ndarray, out: np.ndarray) -> None:
    """out[i] = dequantized embedding row of token_ids[i]; out: [num_tokens, hidden]."""
    rows = np.asarray(embed.data)[token_ids]
    out[:] = gguf.quants.dequantize(rows, embed.tensor_type).reshape(out.shape)
