"""Read a GGUF of a supported architecture: hyperparameters from metadata, tensors by name.

Every hyperparameter comes from the file's metadata; how the architecture differs from Llama
comes from its declaration (engine/model/architectures.py). Q and K weights keep the file's
row order: llama.cpp permutes a Llama model's rows so that RoPE rotates adjacent pairs, and
writes the other architectures unpermuted for rotate-half ("neox") RoPE. A layer's q, k and v
(and the FFN's gate and up) are stacked into one product: from separate tensors, or from the one
tensor a Phi-3 file holds (`stacked_names`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from engine.model.architectures import ARCHITECTURES, Architecture, architecture
from engine.model.gguf_metadata import read_gguf
from engine.model.rope_scaling import Yarn, read_yarn

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_dim: int
    rope_theta: float
    rope_scale: float  # linear position scaling (1.0 = none)
    rms_eps: float
    vocab_size: int
    context_length: int
    tied_embeddings: bool
    arch: Architecture = ARCHITECTURES["llama"]
    sliding_window: int = 0  # keys a local layer sees (itself included)
    local_layers: tuple[int, ...] = ()  # the layers that attend over the sliding window
    rope_theta_local: float = 0.0  # RoPE base of the local layers
    rope_attn_factor: float = 1.0  # RoPE's cos and sin scaled by it (LongRoPE's and YaRN's magnitude corrections)
    attn_softcap: float = 0.0  # attention logits soft-capped as cap * tanh(s / cap) (Gemma 2); 0 = none
    final_softcap: float = 0.0  # the same on the output logits
    embedding_scale: float = 1.0  # token embeddings times this (Granite; Gemma's sqrt(hidden) is its architecture's)
    attention_scale: float = 0.0  # attention scores times this; 0: 1 / sqrt(head_dim)
    residual_scale: float = 1.0  # each sublayer's output times this before the residual add (Granite)
    logit_scale: float = 1.0  # output logits divided by this (Granite)
    yarn: Yarn | None = None  # YaRN scaling: its divisors come with rope_freq_factors, its magnitude is in the above
    num_experts: int = 0  # mixture of experts (Qwen3-MoE, Mixtral): experts per layer; 0: dense FFNs
    num_experts_used: int = 0  # experts each token runs (the router's top k)
    expert_intermediate_size: int = 0  # an expert's FFN width
    expert_weights_norm: bool = True  # the top k's softmax weights renormalized to sum to 1
    shared_expert_intermediate_size: int = 0  # a shared expert every token runs, gated (Qwen2-MoE); 0: none

    def window(self, layer: int) -> int:
        """Keys that `layer` attends to, itself included (0: all of them)."""
        return self.sliding_window if layer in self.local_layers else 0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _field(metadata: dict, key: str, default=None):
    value = metadata.get(key)
    if value is None:
        if default is None:
            raise ValueError(f"GGUF metadata is missing {key!r}")
        return default
    return value


class GGUFModel:
    """An opened GGUF file: `config`, `tensor(name)`, and its key/value `metadata` (the tokenizer's too)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.metadata, tensors = read_gguf(self.path)
        arch = str(_field(self.metadata, "general.architecture"))
        architecture(arch, self.path.name)
        self.tensors = {t.name: t for t in tensors}
        self.config = self._read_config(arch)

    def _read_config(self, arch: str) -> ModelConfig:
        r = self.metadata
        hidden = int(_field(r, f"{arch}.embedding_length"))
        num_heads = int(_field(r, f"{arch}.attention.head_count"))
        head_dim = int(_field(r, f"{arch}.attention.key_length", hidden // num_heads))
        if ("rope_factors_long.weight" in self.tensors) != ("rope_factors_short.weight" in self.tensors):
            raise ValueError(f"{self.path.name}: LongRoPE needs both rope_factors_long.weight and "
                             "rope_factors_short.weight")
        scaling = str(_field(r, f"{arch}.rope.scaling.type", "none"))
        if scaling not in ("none", "linear", "yarn", "longrope"):  # LongRoPE: its factor tensors decide
            raise ValueError(f"unsupported RoPE scaling {scaling!r} in {self.path.name}")
        factor = float(_field(r, f"{arch}.rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0
        context_length = int(_field(r, f"{arch}.context_length", 2048))
        yarn = read_yarn(r, arch, context_length) if scaling == "yarn" else None
        attn_factor = float(_field(r, f"{arch}.rope.scaling.attn_factor", 1.0)) * (yarn.magnitude if yarn else 1.0)
        embd = self.tensors["token_embd.weight"]
        vocab = int(_field(r, f"{arch}.vocab_size", int(embd.shape[1])))
        decl = architecture(arch)
        num_layers = int(_field(r, f"{arch}.block_count"))
        window = int(_field(r, f"{arch}.attention.sliding_window", 0)) if decl.swa_pattern else 0
        return ModelConfig(
            architecture=arch,
            name=str(_field(r, "general.name", self.path.stem)),
            num_layers=num_layers,
            hidden_size=hidden,
            intermediate_size=int(_field(r, f"{arch}.feed_forward_length")),
            num_heads=num_heads,
            num_kv_heads=int(_field(r, f"{arch}.attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rope_dim=int(_field(r, f"{arch}.rope.dimension_count", head_dim)),
            rope_theta=float(_field(r, f"{arch}.rope.freq_base", 10000.0)),
            rope_scale=factor,
            rms_eps=float(_field(r, f"{arch}.attention.layer_norm_rms_epsilon")),
            vocab_size=vocab,
            context_length=context_length,
            tied_embeddings="output.weight" not in self.tensors,
            arch=decl,
            sliding_window=window,
            local_layers=self._local_layers(decl, num_layers) if window else (),
            rope_theta_local=float(_field(r, f"{arch}.rope.freq_base_swa",
                                          decl.swa_rope_base or _field(r, f"{arch}.rope.freq_base", 10000.0))),
            rope_attn_factor=attn_factor,
            attn_softcap=float(_field(r, f"{arch}.attn_logit_softcapping", 0.0)),
            final_softcap=float(_field(r, f"{arch}.final_logit_softcapping", 0.0)),
            embedding_scale=float(_field(r, f"{arch}.embedding_scale", 1.0)),
            attention_scale=float(_field(r, f"{arch}.attention.scale", 0.0)) or decl.attention_scale(num_layers, hidden,
                                                                                                    num_heads),
            residual_scale=float(_field(r, f"{arch}.residual_scale", 1.0)),
            logit_scale=float(_field(r, f"{arch}.logit_scale", 1.0)),
            yarn=yarn,
            **self._read_experts(arch),
        )

    def _read_experts(self, arch: str) -> dict:
        """ModelConfig's mixture-of-experts fields: softmax gating over `expert_count` experts, each token
        running its top `expert_used_count`, their weights renormalized as the architecture does (llama.cpp
        hard-codes it: on for Mixtral and Qwen3-MoE, off for Qwen2-MoE; `expert_weights_norm` decides where a
        file has it), and the width of a shared expert (`expert_shared_feed_forward_length`) if the file has one."""
        r = self.metadata
        num = int(_field(r, f"{arch}.expert_count", 0))
        if not num:
            return {}
        used = int(_field(r, f"{arch}.expert_used_count", 0))
        if not 1 <= used <= num:
            raise ValueError(f"{self.path.name}: {arch}.expert_used_count must be in 1..{num}, got {used}")
        gating = int(_field(r, f"{arch}.expert_gating_func", 1))
        if gating != 1:
            raise ValueError(f"{self.path.name}: {arch}.expert_gating_func {gating}: only softmax gating (1) is supported")
        return dict(num_experts=num, num_experts_used=used,
                    expert_intermediate_size=int(_field(r, f"{arch}.expert_feed_forward_length",
                                                        _field(r, f"{arch}.feed_forward_length"))),
                    expert_weights_norm=bool(_field(r, f"{arch}.expert_weights_norm", architecture(arch).expert_norm)),
                    shared_expert_intermediate_size=int(_field(r, f"{arch}.expert_shared_feed_forward_length",
                                                               self._shared_width())))

    def _local_layers(self, decl: Architecture, num_layers: int) -> tuple[int, ...]:
        """The sliding-window layers: the file's `sliding_window_pattern` (a period, or one flag per
        layer) where it has one, else the architecture's period."""
        pattern = _field(self.metadata, f"{decl.name}.attention.sliding_window_pattern", decl.swa_pattern)
        if isinstance(pattern, (list, tuple)):
            if len(pattern) != num_layers:
                raise ValueError(f"{self.path.name}: sliding_window_pattern has {len(pattern)} flags "
                                 f"for {num_layers} layers")
            return tuple(i for i, local in enumerate(pattern) if local)
        period = int(pattern)
        return tuple(i for i in range(num_layers) if period > 0 and (i + 1) % period != 0)

    def tensor(self, name: str):
        try:
            return self.tensors[name]
        except KeyError:
            raise ValueError(f"tensor {name!r} missing from {self.path.name}") from None

    def stacked_names(self, layer: int, kind: str) -> list[str]:
        """The tensors whose rows, in order, make one of a layer's stacked products: kind "qkv" (q, k, v)
        or "gate_up" (gate, up). A Phi-3 file holds each as one tensor: attn_qkv, and ffn_up with the
        gate's rows first and no ffn_gate (llama.cpp's fused SwiGLU)."""
        p = f"blk.{layer}."
        if kind == "qkv":
            fused = p + "attn_qkv.weight"
            return [fused] if fused in self.tensors else [p + f"attn_{n}.weight" for n in "qkv"]
        if p + "ffn_gate.weight" in self.tensors:
            return [p + "ffn_gate.weight", p + "ffn_up.weight"]
        rows = int(self.tensor(p + "ffn_up.weight").shape[-1])
        if rows != 2 * self.config.intermediate_size:
            raise ValueError(f"{self.path.name}: {p}ffn_gate.weight is missing and {p}ffn_up.weight has {rows} rows, "
                             f"not the 2 x {self.config.intermediate_size} of a fused gate and up")
        return [p + "ffn_up.weight"]

    def experts(self, layer: int) -> tuple | None:
        """A mixture-of-experts layer's (router [experts, hidden], [gate, up] per expert, down per expert, shared
        expert or None) as 2-D tensors (the file stacks each kind's experts in one 3-D tensor); None for a dense
        layer."""
        from engine.kernels.weights import expert_matrix  # numba: not for the gateway's imports of this module

        p = f"blk.{layer}."
        if p + "ffn_gate_inp.weight" not in self.tensors:
            return None
        cfg = self.config
        stacks = [self.tensor(p + f"ffn_{kind}_exps.weight") for kind in ("gate", "up", "down")]
        for t in stacks:
            if len(t.shape) != 3 or int(t.shape[2]) != cfg.num_experts:
                raise ValueError(f"{self.path.name}: {t.name} has shape {[int(d) for d in t.shape]}, "
                                 f"not [.., .., {cfg.num_experts}]")
        gate, up, down = ([expert_matrix(t, e) for e in range(cfg.num_experts)] for t in stacks)
        return self.tensor(p + "ffn_gate_inp.weight"), list(zip(gate, up)), down, self._shared_expert(layer)

    def _shared_width(self) -> int:
        """The width of layer 0's shared expert, for a file without `expert_shared_feed_forward_length` (0: none)."""
        down = self.tensors.get("blk.0.ffn_down_shexp.weight")
        return 0 if down is None else int(down.shape[0])

    def _shared_expert(self, layer: int) -> tuple | None:
        """A layer's shared expert as (its gate's row [hidden] float32, gate, up, down tensors), or None."""
        p = f"blk.{layer}."
        names = [p + f"ffn_{kind}_shexp.weight" for kind in ("gate", "up", "down")]
        have = [n in self.tensors for n in names]
        if not any(have):
            return None
        if not all(have) or p + "ffn_gate_inp_shexp.weight" not in self.tensors:
            raise ValueError(f"{self.path.name}: layer {layer}'s shared expert needs ffn_gate_shexp, ffn_up_shexp, "
                             "ffn_down_shexp and ffn_gate_inp_shexp")
        gate_row = self.dense(p + "ffn_gate_inp_shexp.weight").reshape(-1)
        return (gate_row, *(self.tensor(n) for n in names))

    def dense(self, name: str) -> np.ndarray:
        """A tensor dequantized to float32 in logical (row-major, ggml-reversed) shape."""
        t = self.tensor(name)
        shape = tuple(int(s) for s in reversed(t.shape))
        return np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)

    def rope_freq_factors(self, context_len: int) -> np.ndarray | None:
        """Per-frequency divisors of RoPE's angles [rope_dim / 2], if the file has any: the tensor's (below)
        times YaRN's when the file scales by YaRN."""
        cfg = self.config
        tensor = self._rope_factor_tensor(context_len)
        if cfg.yarn is None:
            return tensor
        yarn = cfg.yarn.divisors(cfg.rope_dim, cfg.rope_theta)
        return yarn if tensor is None else tensor[: len(yarn)] * yarn

    def _rope_factor_tensor(self, context_len: int) -> np.ndarray | None:
        """Llama 3's rope_freqs.weight, or LongRoPE's (Phi-3 128k, Phi-3.5, Phi-4-mini) short factors, or its
        long ones when `context_len` (the engine's max_model_len) exceeds the file's original context;
        llama.cpp chooses them the same way."""
        if "rope_freqs.weight" in self.tensors:
            return self.dense("rope_freqs.weight").reshape(-1)
        if "rope_factors_long.weight" not in self.tensors:
            return None
        cfg = self.config
        original = int(_field(self.metadata, f"{cfg.architecture}.rope.scaling.original_context_length",
                              cfg.context_length))
        return self.dense(f"rope_factors_{'long' if context_len > original else 'short'}.weight").reshape(-1)
