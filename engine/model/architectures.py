"""The decoder architectures Speculant runs, each declared by how it differs from Llama.

One forward (engine/kernels/layer.py) serves them all; an architecture only switches its
optional parts on. The conventions are those of llama.cpp's GGUF converter, so the files
people download load as they are:

  rope        "adjacent": pairs (2i, 2i+1). llama.cpp permutes a Llama model's Q/K rows so that
              this equals Hugging Face's rotate-half. "neox": pairs (i, i + rope_dim/2) on
              unpermuted rows (Qwen 2/3, Gemma 3).
  qkv_bias    q/k/v projections carry biases (blk.N.attn_{q,k,v}.bias).
  qk_norm     RMSNorm over each head of q and k before RoPE (blk.N.attn_{q,k}_norm.weight).
  post_norms  RMSNorm on each sublayer's output before the residual add
              (blk.N.post_attention_norm.weight, blk.N.post_ffw_norm.weight).
  activation  the gated FFN's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, tanh form).
  embed_scale embeddings times sqrt(hidden), rounded to float32 first (as Gemma does).
  swa_pattern every n-th layer (n-1, 2n-1, ...) attends globally, the others over a sliding
              window of `{arch}.attention.sliding_window` keys; 0: every layer global. A file's
              own `{arch}.attention.sliding_window_pattern` takes precedence.
  swa_rope_base  RoPE base of the sliding-window layers when the file does not give
              `{arch}.rope.freq_base_swa` (llama.cpp's default for the architecture; 0: the global base).
  no_rope_period  every n-th layer (n-1, 2n-1, ...) attends without RoPE ("NoPE"); llama.cpp hard-codes
              the period per architecture (no GGUF key), 0: every layer rotates.
  residual_scale  each sublayer's output times `{arch}.residual_scale` before the residual add (Granite;
              its `embedding_scale`, `attention.scale` and `logit_scale` are read for any architecture).
  expert_norm a mixture of experts' chosen weights divided by their sum when the file does not say
              (`{arch}.expert_weights_norm`): llama.cpp hard-codes it per architecture (off for Qwen2-MoE).
  width_scaled_at  block counts at which attention scores are scaled by 1/sqrt(hidden // heads) instead of
              1/sqrt(head_dim) when the file gives no `{arch}.attention.scale`: Gemma 2 and 3 27B, whose
              query_pre_attn_scalar is hidden / heads (144, 168). GGUF has no key for it, so llama.cpp picks
              it by model size, which it reads from the block count (46, 62); so do we.

Gemma's norm weights are stored in GGUF with its "1 +" already added, so every norm is x*w here.
"""

from __future__ import annotations

from dataclasses import dataclass

ROPE_STYLES = ("adjacent", "neox")
ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True, slots=True)
class Architecture:
    name: str
    rope: str = "adjacent"
    qkv_bias: bool = False
    qk_norm: bool = False
    post_norms: bool = False
    activation: str = "silu"
    embed_scale: bool = False
    swa_pattern: int = 0
    swa_rope_base: float = 0.0
    no_rope_period: int = 0
    residual_scale: bool = False
    width_scaled_at: tuple[int, ...] = ()
    expert_norm: bool = True

    def __post_init__(self):
        assert self.rope in ROPE_STYLES and self.activation in ACTIVATIONS, self

    def attention_scale(self, num_layers: int, hidden: int, num_heads: int) -> float:
        """The scores' scale a file without `{arch}.attention.scale` implies; 0: 1 / sqrt(head_dim)."""
        return 1.0 / (hidden // num_heads) ** 0.5 if num_layers in self.width_scaled_at else 0.0

    def rotates(self, layer: int) -> bool:
        """Whether `layer` applies RoPE to q and k."""
        return not self.no_rope_period or (layer + 1) % self.no_rope_period != 0


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("llama"),  # Llama 1-3, Mistral, SmolLM: llama.cpp writes them all as "llama"
        Architecture("smollm3", no_rope_period=4),  # SmolLM3: Llama with every 4th layer unrotated
        Architecture("granite", residual_scale=True),  # IBM Granite 3.x (dense): Llama with four multipliers
        Architecture("granitemoe", residual_scale=True),  # IBM Granite 3.x MoE: granite, experts in the FFN
        Architecture("qwen2", rope="neox", qkv_bias=True),
        Architecture("qwen3", rope="neox", qk_norm=True),
        Architecture("qwen3moe", rope="neox", qk_norm=True),  # Qwen3's attention, experts in the FFN (ModelConfig)
        # Qwen1.5-MoE, Qwen2-57B-A14B: Qwen2's attention; experts not renormalized, and a gated shared expert
        Architecture("qwen2moe", rope="neox", qkv_bias=True, expert_norm=False),
        # Phi-3 / 3.5 / 4-mini: q, k, v and gate, up stored fused (gguf_loader.stacked_names). Its files carry a
        # sliding_window (2047 in Phi-3-mini); llama.cpp ignores it (ggml-org/llama.cpp#13676), and so do we.
        Architecture("phi3", rope="neox"),
        # Gemma 2: its attention and output logits soft-capped (the file's attn_logit_softcapping and
        # final_logit_softcapping), every other layer (0, 2, ...) on the sliding window
        Architecture("gemma2", rope="neox", post_norms=True, activation="gelu_tanh", embed_scale=True, swa_pattern=2,
                     width_scaled_at=(46,)),
        Architecture("gemma3", rope="neox", qk_norm=True, post_norms=True, activation="gelu_tanh",
                     embed_scale=True, swa_pattern=6, swa_rope_base=10_000.0, width_scaled_at=(62,)),
    )
}


def architecture(name: str, source: str = "the model") -> Architecture:
    """The declaration of `name`; a ValueError naming it and the supported ones otherwise."""
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise ValueError(f"unsupported model architecture {name!r} in {source}: "
                         f"Speculant runs {', '.join(ARCHITECTURES)} models") from None
