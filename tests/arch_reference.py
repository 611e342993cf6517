"""A plain NumPy (float64) forward pass for the tiny architecture fixtures, read straight from their GGUF files.

No torch: it is the independent reference the engine is checked against, and it is itself checked against
Hugging Face transformers (tests/fixtures/make_arch_fixtures.py, tests/test_arch_fixtures.py).

It follows llama.cpp's reading of a GGUF, one small function per feature:

- llama:  RMSNorm, SwiGLU, grouped-query attention, RoPE on *adjacent* pairs (x[2i], x[2i+1]) applied to the
          Q/K rows that convert_hf_to_gguf.py permuted, optional Llama-3 `rope_freqs.weight` (one divisor per
          frequency), its own `output.weight`.
- qwen2:  like llama but biases on Q/K/V and RoPE "NEOX" (rotate-half: x[i] pairs with x[i + d/2]), weights
          unpermuted; tied output head (no `output.weight`: the embedding is reused).
- qwen3:  NEOX RoPE, per-head RMSNorm of Q and K (attn_q_norm / attn_k_norm) before RoPE, head_dim from
          `{arch}.attention.key_length` (not n_embd / n_head).
- gemma2: like gemma3 without QK-norm, with a sliding window on every other layer (il % 2 == 0; llama.cpp's
          built-in period 2; the local RoPE base is the global one) and soft-capped attention scores and output
          logits: s -> cap * tanh(s / cap), caps from `{arch}.attn_logit_softcapping` (after the 1/sqrt(head_dim)
          scale, before the softmax) and `{arch}.final_logit_softcapping`.
- gemma3: NEOX RoPE, QK-norm, norms after attention and after the FFN (post_attention_norm, post_ffw_norm),
          GELU (tanh approximation) gate, embeddings scaled by sqrt(n_embd), tied output head, attention scale
          1/sqrt(head_dim), and sliding-window attention on the "local" layers: llama.cpp fixes the pattern at 6
          (layer il is local iff il % 6 < 5) and the local RoPE base at 10000; a file's
          `{arch}.attention.sliding_window_pattern` and `{arch}.rope.freq_base_swa` take precedence here.
          A local layer's query at position p sees the keys at positions p - window < k <= p.
          The "+1" of Gemma's RMSNorm is already folded into the stored norm weights.
- phi3:   like llama but NEOX RoPE, weights unpermuted, and Q/K/V in one tensor `attn_qkv` (rows q, k, v) and
          the FFN's gate and up in one `ffn_up` (gate's rows first, no `ffn_gate`); its `sliding_window`
          metadata is ignored, as llama.cpp does. LongRoPE (Phi-3 128k, Phi-3.5, Phi-4-mini): per-frequency
          divisors `rope_factors_long` when the context (here the file's context_length) exceeds
          `{arch}.rope.scaling.original_context_length`, else `rope_factors_short`, and cos/sin times
          `{arch}.rope.scaling.attn_factor`; partial rotary (Phi-4-mini): only the first
          `{arch}.rope.dimension_count` dims of each head rotate.
- smollm3: llama (permuted Q/K, adjacent pairs), but every 4th layer (il % 4 == 3) applies no RoPE at all;
          llama.cpp hard-codes the step (no GGUF key).
- YaRN (`{arch}.rope.scaling.type = yarn`; the qwen3 fixture): ggml's rope_yarn on the global layers: for pair i,
          theta = theta_interp * (1 - mix) + theta_extrap * mix with theta_interp = theta_extrap / factor and
          mix = 1 - clamp((i - low) / max(0.001, high - low), 0, 1), low / high the floor / ceil of the pair that
          turns beta_fast / beta_slow (32 / 1) times over `rope.scaling.original_context_length`:
          n_dims * ln(n_ctx_orig / (2 pi beta)) / (2 ln base); cos and sin times 1 + 0.1 ln(factor).
- granitemoe: granite (below) whose FFN is a mixture of experts, as qwen3moe's.
- qwen3moe: qwen3's attention; the FFN a mixture of experts (llama.cpp's build_moe_ffn with softmax gating and
          norm_w, hard-coded for this architecture): probs = softmax(x @ ffn_gate_inp^T) over `{arch}.expert_count`
          experts, the top `{arch}.expert_used_count` by probability, their probabilities divided by their sum, and
          the output sum_e w_e * down_e(silu(gate_e x) * up_e x) with expert e's rows of ffn_{gate,up,down}_exps.
- qwen2moe: qwen2's attention; the FFN qwen3moe's mixture of experts without the renormalization (llama.cpp's
          norm_w false for this architecture: each chosen expert weighted by its probability over all experts),
          plus a shared expert every token runs, ffn_{gate,up,down}_shexp, its output times
          sigmoid(x . ffn_gate_inp_shexp), added after the routed experts' sum.
- granite: llama with four multipliers from the metadata: embeddings times `{arch}.embedding_scale`, attention
          scores times `{arch}.attention.scale` (instead of 1/sqrt(head_dim)), each sublayer's output times
          `{arch}.residual_scale` before the residual add, the logits divided by `{arch}.logit_scale`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

# ---------------------------------------------------------------- what each architecture does


@dataclass(frozen=True)
class ArchSpec:
    rope: str                      # "adjacent" (llama.cpp LLAMA_ROPE_TYPE_NORM) or "neox" (rotate-half)
    activation: str                # gate activation of the gated FFN: "silu" or "gelu_tanh"
    embed_scale: bool = False      # multiply the token embeddings by sqrt(n_embd)
    swa_period: int | None = None  # llama.cpp's built-in sliding-window period (None: every layer global)
    expert_norm: bool = True       # a MoE's chosen experts' weights divided by their sum (llama.cpp's norm_w)
    swa_rope_base: float | None = 10000.0  # llama.cpp's built-in RoPE base for the local layers (None: the global one)
    no_rope_period: int = 0        # llama.cpp's built-in NoPE step: layer il skips RoPE iff (il + 1) % period == 0


ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec(rope="adjacent", activation="silu"),
    "qwen2": ArchSpec(rope="neox", activation="silu"),
    "qwen3": ArchSpec(rope="neox", activation="silu"),
    "qwen3moe": ArchSpec(rope="neox", activation="silu"),
    "qwen2moe": ArchSpec(rope="neox", activation="silu", expert_norm=False),
    "gemma2": ArchSpec(rope="neox", activation="gelu_tanh", embed_scale=True, swa_period=2, swa_rope_base=None),
    "gemma3": ArchSpec(rope="neox", activation="gelu_tanh", embed_scale=True, swa_period=6),
    "phi3": ArchSpec(rope="neox", activation="silu"),
    "smollm3": ArchSpec(rope="adjacent", activation="silu", no_rope_period=4),
    "granite": ArchSpec(rope="adjacent", activation="silu"),
    "granitemoe": ArchSpec(rope="adjacent", activation="silu"),
}


@dataclass
class RefModel:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    eps: float
    rope_base: float
    rope_base_swa: float
    sliding_window: int            # 0: no sliding window
    local_layers: frozenset[int]
    rope_freqs: np.ndarray | None  # per-frequency divisors (Llama 3's, or LongRoPE's for this context), or None
    tensors: dict[str, np.ndarray] = field(repr=False)
    rope_dim: int = 0              # dims of each head that rotate (0: all)
    attn_softcap: float = 0.0      # attention scores -> cap * tanh(score / cap) before the softmax (0: none)
    final_softcap: float = 0.0     # the same on the output logits
    rope_mscale: float = 1.0       # cos and sin times this (LongRoPE's attn_factor)
    embedding_scale: float = 1.0   # granite's four multipliers (attention_scale 0: 1/sqrt(head_dim))
    attention_scale: float = 0.0
    residual_scale: float = 1.0
    logit_scale: float = 1.0
    yarn: tuple[float, int, float, float] | None = None  # (factor, n_ctx_orig, beta_fast, beta_slow), or None
    n_expert_used: int = 0         # a mixture of experts: each token's top k

    @property
    def spec(self) -> ArchSpec:
        return ARCHS[self.arch]

    def t(self, name: str) -> np.ndarray | None:
        return self.tensors.get(name)


# ---------------------------------------------------------------- reading the GGUF


def _field(reader: gguf.GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def dequantize(t) -> np.ndarray:
    """A GGUF tensor as float64, numpy shape (rows, row_length) = reversed GGUF dims."""
    values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
    return np.asarray(values, dtype=np.float64).reshape(tuple(int(d) for d in reversed(t.shape)))


def local_layers(arch: str, n_layer: int, pattern) -> frozenset[int]:
    """The sliding-window layers: the file's `sliding_window_pattern` (a period or one flag per layer), else
    llama.cpp's built-in period for the architecture. As llama_hparams::set_swa_pattern: layer il is local iff
    il % period < period - 1, and a period of 0 makes every layer local."""
    if pattern is None:
        pattern = ARCHS[arch].swa_period
    if pattern is None:
        return frozenset()
    if isinstance(pattern, (list, tuple)):
        return frozenset(i for i, flag in enumerate(pattern) if flag)
    period = int(pattern)
    return frozenset(i for i in range(n_layer) if period == 0 or i % period < period - 1)


def load_gguf(path: str | Path) -> RefModel:
    reader = gguf.GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if arch not in ARCHS:
        raise ValueError(f"{path}: architecture {arch!r} is not one of {sorted(ARCHS)}")
    n_embd = int(_field(reader, f"{arch}.embedding_length"))
    n_head = int(_field(reader, f"{arch}.attention.head_count"))
    n_layer = int(_field(reader, f"{arch}.block_count"))
    window = int(_field(reader, f"{arch}.attention.sliding_window", 0))
    tensors = {t.name: dequantize(t) for t in reader.tensors}
    return RefModel(
        arch=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=int(_field(reader, f"{arch}.attention.head_count_kv", n_head)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", n_embd // n_head)),
        eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_base=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_base_swa=float(_field(reader, f"{arch}.rope.freq_base_swa", ARCHS[arch].swa_rope_base
                                   or _field(reader, f"{arch}.rope.freq_base", 10000.0))),
        sliding_window=window,
        local_layers=local_layers(arch, n_layer, _field(reader, f"{arch}.attention.sliding_window_pattern"))
        if window else frozenset(),
        rope_freqs=rope_divisors(reader, arch, tensors),
        rope_dim=int(_field(reader, f"{arch}.rope.dimension_count", 0)),
        rope_mscale=float(_field(reader, f"{arch}.rope.scaling.attn_factor", 1.0)),
        attn_softcap=float(_field(reader, f"{arch}.attn_logit_softcapping", 0.0)),
        final_softcap=float(_field(reader, f"{arch}.final_logit_softcapping", 0.0)),
        embedding_scale=float(_field(reader, f"{arch}.embedding_scale", 1.0)),
        attention_scale=float(_field(reader, f"{arch}.attention.scale", 0.0)),
        residual_scale=float(_field(reader, f"{arch}.residual_scale", 1.0)),
        logit_scale=float(_field(reader, f"{arch}.logit_scale", 1.0)),
        yarn=yarn_params(reader, arch),
        n_expert_used=int(_field(reader, f"{arch}.expert_used_count", 0)),
        tensors=tensors,
    )


def yarn_params(reader: gguf.GGUFReader, arch: str) -> tuple[float, int, float, float] | None:
    if _field(reader, f"{arch}.rope.scaling.type", "none") != "yarn":
        return None
    return (float(_field(reader, f"{arch}.rope.scaling.factor")),
            int(_field(reader, f"{arch}.rope.scaling.original_context_length")),
            float(_field(reader, f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
            float(_field(reader, f"{arch}.rope.scaling.yarn_beta_slow", 1.0)))


def rope_divisors(reader: gguf.GGUFReader, arch: str, tensors: dict) -> np.ndarray | None:
    """Llama 3's rope_freqs, or LongRoPE's factors as llama.cpp picks them for a context of context_length."""
    if "rope_factors_long.weight" not in tensors:
        return tensors.get("rope_freqs.weight")
    n_ctx = int(_field(reader, f"{arch}.context_length"))
    original = int(_field(reader, f"{arch}.rope.scaling.original_context_length", n_ctx))
    return tensors["rope_factors_long.weight" if n_ctx > original else "rope_factors_short.weight"]


# ---------------------------------------------------------------- the pieces


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight over the last axis (Gemma's 1 + w is already in `weight`)."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """x @ W^T (+ b); W is stored (out_features, in_features)."""
    y = x @ weight.T
    return y if bias is None else y + bias


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def rope_inv_freq(base: float, dim: int, freq_factors: np.ndarray | None = None) -> np.ndarray:
    """theta_i = base^(-2i/dim), divided by the Llama-3 factors when the file has `rope_freqs.weight`."""
    inv = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    return inv if freq_factors is None else inv / freq_factors


def rope_yarn(inv_freq: np.ndarray, base: float, n_dims: int, yarn: tuple) -> tuple[np.ndarray, float]:
    """ggml's rope_yarn (ext_factor 1): the blended frequencies and the cos/sin magnitude."""
    factor, n_ctx_orig, beta_fast, beta_slow = yarn

    def corr_dim(n_rot: float) -> float:
        return n_dims * np.log(n_ctx_orig / (n_rot * 2 * np.pi)) / (2 * np.log(base))

    low, high = max(0.0, np.floor(corr_dim(beta_fast))), min(n_dims - 1.0, np.ceil(corr_dim(beta_slow)))
    i = np.arange(len(inv_freq))
    mix = 1.0 - np.clip((i - low) / max(0.001, high - low), 0.0, 1.0)
    return (inv_freq / factor) * (1.0 - mix) + inv_freq * mix, 1.0 + 0.1 * np.log(factor)


def rope_adjacent(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, mscale: float = 1.0) -> np.ndarray:
    """llama.cpp "normal" RoPE: rotates the adjacent pairs (x[2i], x[2i+1]) of each head. x: (T, H, D)."""
    ang = positions[:, None, None] * inv_freq[None, None, :]
    cos, sin = mscale * np.cos(ang), mscale * np.sin(ang)
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = odd * cos + even * sin
    return out


def rope_neox(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, mscale: float = 1.0) -> np.ndarray:
    """NEOX / Hugging Face rotate-half RoPE: x[i] pairs with x[i + D/2]. x: (T, H, D)."""
    half = x.shape[-1] // 2
    ang = positions[:, None, None] * inv_freq[None, None, :]
    cos, sin = mscale * np.cos(ang), mscale * np.sin(ang)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attention_mask(n: int, window: int = 0) -> np.ndarray:
    """allowed[q, k]: causal, and with a sliding window only the keys p - window < k <= p."""
    q = np.arange(n)[:, None]
    k = np.arange(n)[None, :]
    allowed = k <= q
    if window:
        allowed &= (q - k) < window
    return allowed


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, allowed: np.ndarray,
              softcap: float = 0.0) -> np.ndarray:
    """Grouped-query softmax attention. q: (T, H, D), k/v: (T, Hkv, D) -> (T, H * D)."""
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) * scale
    if softcap:  # gemma2
        scores = softcap * np.tanh(scores / softcap)
    scores = np.where(allowed[None], scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    out = np.einsum("hqk,khd->qhd", p, v)
    return out.reshape(out.shape[0], -1)


def moe_ffn(m: RefModel, il: int, x: np.ndarray) -> np.ndarray:
    """Each token's top n_expert_used experts by softmax probability, weighted by those renormalized."""
    b = f"blk.{il}."
    logits = linear(x, m.t(b + "ffn_gate_inp.weight"))  # (T, n_expert)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    gate, up, down = (m.t(b + f"ffn_{kind}_exps.weight") for kind in ("gate", "up", "down"))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        chosen = np.argsort(-probs[t], kind="stable")[: m.n_expert_used]
        weights = probs[t, chosen] / (probs[t, chosen].sum() if m.spec.expert_norm else 1.0)
        for e, w in zip(chosen, weights):
            out[t] += w * linear(silu(linear(x[t], gate[e])) * linear(x[t], up[e]), down[e])
    if m.t(b + "ffn_gate_inp_shexp.weight") is not None:  # qwen2moe's shared expert, gated per token
        shared = linear(silu(linear(x, m.t(b + "ffn_gate_shexp.weight"))) * linear(x, m.t(b + "ffn_up_shexp.weight")),
                        m.t(b + "ffn_down_shexp.weight"))
        out += shared / (1.0 + np.exp(-(x @ m.t(b + "ffn_gate_inp_shexp.weight").reshape(-1))))[:, None]
    return out


def gated_ffn(m: RefModel, il: int, x: np.ndarray) -> np.ndarray:
    act = silu if m.spec.activation == "silu" else gelu_tanh
    b = f"blk.{il}."
    if m.t(b + "ffn_gate_inp.weight") is not None:
        return moe_ffn(m, il, x)
    gate, up = m.t(b + "ffn_gate.weight"), m.t(b + "ffn_up.weight")
    if gate is None:  # phi3: one tensor, the gate's rows first
        gate, up = np.split(up, 2, axis=0)
    return linear(act(linear(x, gate)) * linear(x, up), m.t(b + "ffn_down.weight"))


def self_attention(m: RefModel, il: int, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    b = f"blk.{il}."
    n = x.shape[0]
    if m.t(b + "attn_qkv.weight") is not None:  # phi3: q, k, v rows in one tensor
        qkv = linear(x, m.t(b + "attn_qkv.weight"))
        q, k, v = np.split(qkv, [m.n_head * m.head_dim, (m.n_head + m.n_head_kv) * m.head_dim], axis=1)
    else:
        q = linear(x, m.t(b + "attn_q.weight"), m.t(b + "attn_q.bias"))
        k = linear(x, m.t(b + "attn_k.weight"), m.t(b + "attn_k.bias"))
        v = linear(x, m.t(b + "attn_v.weight"), m.t(b + "attn_v.bias"))
    q = q.reshape(n, m.n_head, m.head_dim)
    k = k.reshape(n, m.n_head_kv, m.head_dim)
    v = v.reshape(n, m.n_head_kv, m.head_dim)
    if m.t(b + "attn_q_norm.weight") is not None:  # QK-norm (qwen3, gemma3): per head, before RoPE
        q = rms_norm(q, m.t(b + "attn_q_norm.weight"), m.eps)
        k = rms_norm(k, m.t(b + "attn_k_norm.weight"), m.eps)
    local = il in m.local_layers
    base = m.rope_base_swa if local else m.rope_base
    rot = m.rope_dim or m.head_dim  # partial rotary: the dims past `rot` pass through
    inv_freq = rope_inv_freq(base, rot, None if m.rope_freqs is None else m.rope_freqs[: rot // 2])
    mscale = m.rope_mscale
    if m.yarn is not None and not local:
        inv_freq, yarn_mscale = rope_yarn(inv_freq, base, rot, m.yarn)
        mscale *= yarn_mscale
    rope = rope_adjacent if m.spec.rope == "adjacent" else rope_neox
    period = m.spec.no_rope_period
    if not period or (il + 1) % period:
        q, k = (np.concatenate([rope(x[..., :rot], positions, inv_freq, mscale), x[..., rot:]], axis=-1)
                for x in (q, k))
    allowed = attention_mask(n, m.sliding_window if local else 0)
    out = attention(q, k, v, m.attention_scale or 1.0 / np.sqrt(m.head_dim), allowed, m.attn_softcap)
    return linear(out, m.t(b + "attn_output.weight"))


def block(m: RefModel, il: int, h: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """One decoder layer: pre-norm attention and FFN, each optionally post-normed (gemma3)."""
    b = f"blk.{il}."
    a = self_attention(m, il, rms_norm(h, m.t(b + "attn_norm.weight"), m.eps), positions)
    if m.t(b + "post_attention_norm.weight") is not None:
        a = rms_norm(a, m.t(b + "post_attention_norm.weight"), m.eps)
    h = h + a * m.residual_scale
    f = gated_ffn(m, il, rms_norm(h, m.t(b + "ffn_norm.weight"), m.eps))
    if m.t(b + "post_ffw_norm.weight") is not None:
        f = rms_norm(f, m.t(b + "post_ffw_norm.weight"), m.eps)
    return h + f * m.residual_scale


def forward(m: RefModel, tokens) -> np.ndarray:
    """Logits (T, n_vocab), float64, for one sequence starting at position 0."""
    tokens = np.asarray(tokens, dtype=np.int64)
    embd = m.t("token_embd.weight")
    h = embd[tokens]
    if m.spec.embed_scale:
        h = h * np.sqrt(m.n_embd)
    h = h * m.embedding_scale
    positions = np.arange(len(tokens), dtype=np.float64)
    for il in range(m.n_layer):
        h = block(m, il, h, positions)
    h = rms_norm(h, m.t("output_norm.weight"), m.eps)
    head = m.t("output.weight")
    logits = linear(h, embd if head is None else head) / m.logit_scale
    return m.final_softcap * np.tanh(logits / m.final_softcap) if m.final_softcap else logits


def variant(m: RefModel, **changes) -> RefModel:
    """A copy with some fields changed (e.g. sliding_window=0), to show that a feature matters."""
    return dataclasses.replace(m, **changes)
