"""Model weights on the device, converted once from GGUF: fp16 (default), bf16 or fp32.

Every matrix is dequantized with GGUFModel.dense (exact GGUF values, float32) and rounded once
to the storage type; products accumulate in float32. Q|K|V and gate|up are fused so one weight
product serves each. bf16 has no NumPy/CuPy dtype: it is stored as its raw uint16 bits, which
is all the kernels and cuBLAS need (a pointer and a type tag).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.kernels.weights import bf16_bits_to_float32
from engine.model.gguf_loader import GGUFModel

STORAGE_DTYPES = ("float16", "bfloat16", "float32")


def float32_to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest, ties to even) -> uint16 bits; NaN stays NaN."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    is_nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(is_nan, ((u >> 16) | 0x40).astype(np.uint16), rounded)


def to_storage(a: np.ndarray, dtype: str) -> np.ndarray:
    """float32 host array -> host array in the storage type (bf16 as uint16 bits)."""
    if dtype == "float32":
        return np.ascontiguousarray(a, dtype=np.float32)
    if dtype == "float16":
        return np.ascontiguousarray(a, dtype=np.float16)
    if dtype == "bfloat16":
        return float32_to_bf16_bits(a)
    raise ValueError(f"dtype: expected one of {STORAGE_DTYPES}, got {dtype!r}")


def from_storage(a: np.ndarray, dtype: str) -> np.ndarray:
    return bf16_bits_to_float32(a) if dtype == "bfloat16" else np.asarray(a, dtype=np.float32)


def storage_numpy_dtype(dtype: str):
    return {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}[dtype]


@dataclass
class LayerWeights:
    attn_norm: object  # [hidden] float32
    qkv: object  # [q_size + 2 * kv_size, hidden]
    o: object  # [hidden, q_size]
    ffn_norm: object  # [hidden] float32
    gate_up: object  # [2 * inter, hidden]
    down: object  # [hidden, inter]


@dataclass
class ModelWeights:
    embed: object  # [vocab, hidden]
    layers: list
    final_norm: object  # [hidden] float32
    lm_head: object  # [vocab, hidden] (the embedding itself when tied)
    nbytes: int  # bytes one full forward streams (matrices, embedding excluded unless tied)


def upload_weights(model: GGUFModel, dtype: str, to_device) -> ModelWeights:
    """Convert and upload every tensor; `to_device(host_array)` returns a device array."""
    cfg = model.config

    def matrix(*names: str):
        dense = np.concatenate([model.dense(n) for n in names], axis=0) if len(names) > 1 else model.dense(names[0])
        host = to_storage(dense, dtype)
        if not np.all(np.isfinite(from_storage(host, dtype))):
            raise ValueError(f"dtype: {'+'.join(names)} overflows {dtype}; use --gpu-dtype bfloat16 or float32")
        return to_device(host)

    def vector(name: str):
        return to_device(np.ascontiguousarray(model.dense(name).reshape(-1), dtype=np.float32))

    layers = []
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        layers.append(LayerWeights(
            attn_norm=vector(p + "attn_norm.weight"),
            qkv=matrix(*model.stacked_names(i, "qkv")),
            o=matrix(p + "attn_output.weight"),
            ffn_norm=vector(p + "ffn_norm.weight"),
            gate_up=matrix(*model.stacked_names(i, "gate_up")),
            down=matrix(p + "ffn_down.weight"),
        ))
    embed = matrix("token_embd.weight")
    lm_head = embed if cfg.tied_embeddings else matrix("output.weight")
    nbytes = sum(w.nbytes for layer in layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
    return ModelWeights(embed, layers, vector("output_norm.weight"), lm_head, nbytes + lm_head.nbytes)
