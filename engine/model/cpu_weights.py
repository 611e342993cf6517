"""The CPU runner's weights, packed once from a GGUF for the layer kernels (engine/kernels/layer.py).

A layer is the tuple (attn_norm, qkv, o, ffn_norm, gate_up, down, parts): the products packed for the
numerics mode (int8 or exact), the norms as float32 vectors, and `parts` the architecture's optional
vectors. A mixture-of-experts layer holds (MoeWeights, None) in the FFN's two places.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from engine.kernels import layer as layer_kernels
from engine.kernels.linear import pack_gguf_rows, pack_gguf_tensor
from engine.kernels.moe import MoeWeights
from engine.kernels.weights import RawTensor
from engine.model.gguf_loader import GGUFModel, ModelConfig


def load_layers(model: GGUFModel, cfg: ModelConfig, numerics: str) -> list[tuple]:
    """Every layer's tuple (see the module docstring), for the first cfg.num_layers layers: packed by a thread
    per core, at most 4 (NumPy's array work, most of a repack, runs outside the GIL; 4 bounds the temporaries)."""
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda i: load_layer(model, cfg, numerics, i), range(cfg.num_layers)))


def load_layer(model: GGUFModel, cfg: ModelConfig, numerics: str, i: int) -> tuple:
    """Layer i's tuple (see the module docstring)."""
    p = f"blk.{i}."
    return (
        model.dense(p + "attn_norm.weight"),
        pack_gguf_rows([model.tensor(n) for n in model.stacked_names(i, "qkv")], numerics),
        pack_gguf_tensor(model.tensor(p + "attn_output.weight"), numerics),
        model.dense(p + "ffn_norm.weight"),
        *ffn_weights(model, cfg, i, numerics),
        layer_parts(model, cfg, p),
    )


def ffn_weights(model: GGUFModel, cfg: ModelConfig, i: int, numerics: str) -> tuple:
    """A layer's (gate_up, down) products, or for a mixture-of-experts layer (MoeWeights, None)."""
    experts = model.experts(i)
    if experts is None:
        if cfg.num_experts:
            raise ValueError(f"{model.path.name}: layer {i} has a dense FFN in a mixture-of-experts model; "
                             "models mixing the two are not supported")
        return (pack_gguf_rows([model.tensor(n) for n in model.stacked_names(i, "gate_up")], numerics),
                pack_gguf_tensor(model.tensor(f"blk.{i}.ffn_down.weight"), numerics))
    router, gate_up, down, shared = experts
    shared_gu = shared_down = None
    if shared is not None:  # its gate's row joins the router's: one product gives both (moe._layer_moe)
        gate_row, *shared_gud = shared
        router = _with_row(router, gate_row)
        shared_gu, shared_down = pack_gguf_rows(shared_gud[:2], numerics), pack_gguf_tensor(shared_gud[2], numerics)
    moe = MoeWeights(pack_gguf_tensor(router, numerics), tuple(pack_gguf_rows(list(gu), numerics) for gu in gate_up),
                     tuple(pack_gguf_tensor(d, numerics) for d in down), shared_gu, shared_down)
    for name, ws in (("gate/up", moe.gate_up), ("down", moe.down)):
        if len({layer_kernels.product_key(w) for w in ws}) > 1:
            raise ValueError(f"{model.path.name}: layer {i}'s experts' {name} weights differ in format")
    return moe, None


def _with_row(tensor, row: np.ndarray) -> RawTensor:
    """A router [experts, hidden] with one more row, as float32 (llama.cpp's converter leaves routers F32)."""
    import gguf

    dense = np.asarray(gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type), np.float32)
    dense = np.concatenate([dense.reshape(-1, len(row)), row[None].astype(np.float32)])  # [experts + 1, hidden]
    return RawTensor(tensor.name, gguf.GGMLQuantizationType.F32, (len(row), len(dense)), dense)


def streamed_bytes(layer: tuple, top_k: int) -> int:
    """The weight bytes one token's pass through a layer reads (a MoE layer: the router and its top k experts)."""
    if isinstance(layer[4], MoeWeights):
        return layer[1].nbytes + layer[2].nbytes + layer[4].active_bytes(top_k)
    return sum(w.nbytes for w in layer[1:3] + layer[4:6])


def layer_parts(model: GGUFModel, cfg: ModelConfig, p: str) -> tuple:
    """The architecture's optional per-layer vectors, empty where it has none:
    (qkv bias [q + 2 kv], q norm [head_dim], k norm [head_dim], post-attention, post-FFN), the last two
    what the layer's `_post_norm` applies to a sublayer's output: RMSNorm weights [hidden] (Gemma) or
    the residual multiplier [1] (Granite, arch_ops.scale_output)."""
    arch, none = cfg.arch, np.zeros(0, np.float32)
    bias = none
    if arch.qkv_bias:
        bias = np.concatenate([model.dense(p + f"attn_{n}.bias").reshape(-1) for n in "qkv"])
    q_norm, k_norm = (model.dense(p + "attn_q_norm.weight"), model.dense(p + "attn_k_norm.weight")) \
        if arch.qk_norm else (none, none)
    post = (none, none)
    if arch.post_norms:
        post = (model.dense(p + "post_attention_norm.weight"), model.dense(p + "post_ffw_norm.weight"))
    elif arch.residual_scale:  # arch_ops.scale_output's multiplier, in the post-norm's place
        post = (np.array([cfg.residual_scale], np.float32),) * 2
    return (bias, q_norm.reshape(-1), k_norm.reshape(-1), *post)
