"""The on-disk format of a learned draft head, shared by `speculant train-head` and the proposers.

A head is two files side by side: `NAME.safetensors` (weights) and `NAME.json` (config).

JSON config (every key required unless marked optional):
    format: "speculant-head", version: 1
    kind: "eagle" | "mtp" | "medusa"
    hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size: ints (the target's, for eagle/mtp layers)
    rms_eps: float, rope_theta: float
    num_modules: int -- eagle: 1; mtp: number of MTP modules (depths); medusa: number of heads
    draft_vocab_size: int -- length of the `draft_vocab` tensor
    target: {"name": str, "vocab_size": int, "hidden_size": int, "num_layers": int}
    training: optional dict (the train-head report: data size, steps, losses, acceptance per position)

Tensors (float16 or float32; `draft_vocab` int32). Matrices are [out, in] (y = x @ W.T):
    draft_vocab [V_d]                 target token ids the draft LM head scores (the target's LM head rows)
  eagle / mtp, module i (eagle: i = 0 only):
    m{i}.fc.weight [H, 2H]            input = concat(token embedding, feature)  (that order)
    m{i}.emb_norm.weight [H]          mtp only: RMSNorm of the embedding before fc
    m{i}.feat_norm.weight [H]         mtp only: RMSNorm of the feature before fc
    m{i}.attn_norm.weight [H]         decoder layer (Llama): x + o(attn(rope(q, k), v)) of rmsnorm(x)
    m{i}.q.weight [nh*hd, H], m{i}.k.weight [nkv*hd, H], m{i}.v.weight [nkv*hd, H], m{i}.o.weight [H, nh*hd]
    m{i}.ffn_norm.weight [H]          then x + down(silu(gate(h)) * up(h)) of h = rmsnorm(x)
    m{i}.gate.weight [I, H], m{i}.up.weight [I, H], m{i}.down.weight [H, I]
    m{i}.out_norm.weight [H]          mtp only: RMSNorm before the (shared) LM head
  medusa, head i:
    m{i}.w.weight [H, H], m{i}.w.bias [H]   feature' = f + silu(f @ W.T + b)

Semantics. f_p is the target's final-normed hidden state at position p (what feeds its LM head), x_p the token.
  eagle:  z_p = layer(fc([e(x_{p+1}), f_p]))  predicts f_{p+1}; logits = z_p @ lm_head[draft_vocab].T predict x_{p+2}.
          Drafting feeds z back as the next feature.
  mtp:    z_p = layer(fc([emb_norm(e(x_{p+1})), feat_norm(f_p)])); logits = out_norm(z_p) @ lm_head[draft_vocab].T
          predict x_{p+2}. Module i (0-based) at row p takes feature z^{i-1}_p (module i-1's output at the
          same row p; f_p for i = 0) and the token x_{p+1+i}, and predicts x_{p+2+i} (DeepSeek-V3 depths).
          Drafting with more steps than modules reuses the last module EAGLE-style (its own z as the next
          row's feature).
  medusa: head i (0-based) on f_p predicts x_{p+2+i}: logits = medusa_i(f_p) @ lm_head[draft_vocab].T
  The decoder layer attends causally over the request's earlier rows; row p sits at RoPE position p,
  rotate-half convention (HF Llama: q*cos + rotate_half(q)*sin, inv_freq = theta^(-2j/hd)); e() is the
  target's token embedding, lm_head the target's output matrix (tied: the embedding).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

KINDS = ("eagle", "mtp", "medusa")
_LAYER = ("attn_norm", "q", "k", "v", "o", "ffn_norm", "gate", "up", "down")


@dataclass
class HeadFile:
    path: Path  # the .safetensors file
    config: dict
    tensors: dict[str, np.ndarray]  # float32 (draft_vocab int32)

    @property
    def kind(self) -> str:
        return self.config["kind"]

    def module(self, i: int) -> dict[str, np.ndarray]:
        """Tensors of module i with the `m{i}.` prefix and `.weight` suffix stripped."""
        prefix = f"m{i}."
        return {k[len(prefix):].removesuffix(".weight"): v for k, v in self.tensors.items() if k.startswith(prefix)}


def required_tensors(config: dict) -> list[str]:
    names = ["draft_vocab"]
    for i in range(config["num_modules"]):
        if config["kind"] == "medusa":
            names += [f"m{i}.w.weight", f"m{i}.w.bias"]
            continue
        names += [f"m{i}.fc.weight"] + [f"m{i}.{n}.weight" for n in _LAYER]
        if config["kind"] == "mtp":
            names += [f"m{i}.{n}.weight" for n in ("emb_norm", "feat_norm", "out_norm")]
    return names


def config_path(path: Path) -> Path:
    return path.with_suffix(".json")


def load_head(path: str | Path, hidden_size: int, vocab_size: int, field: str = "speculative_config.model") -> HeadFile:
    """Read and check a head against the target; a problem is a ValueError naming `field`."""
    from safetensors.numpy import load_file

    path = Path(path)
    if path.suffix != ".safetensors":
        path = path.with_suffix(".safetensors")
    if not path.is_file() or not config_path(path).is_file():
        raise ValueError(f"{field}: no head at {path} (needs {path.name} and {config_path(path).name})")
    config = json.loads(config_path(path).read_text())
    if config.get("format") != "speculant-head" or config.get("kind") not in KINDS:
        raise ValueError(f"{field}: {config_path(path)} is not a speculant head config")
    target = config.get("target", {})
    if config["hidden_size"] != hidden_size or target.get("vocab_size") != vocab_size:
        raise ValueError(
            f"{field}: head {path.name} was trained for hidden_size={config['hidden_size']}, "
            f"vocab_size={target.get('vocab_size')}; the target has {hidden_size}, {vocab_size}"
        )
    raw = load_file(str(path))
    missing = [n for n in required_tensors(config) if n not in raw]
    if missing:
        raise ValueError(f"{field}: head {path.name} lacks tensors {missing[:4]}")
    tensors = {k: (v.astype(np.int32) if k == "draft_vocab" else np.ascontiguousarray(v, np.float32)) for k, v in raw.items()}
    if tensors["draft_vocab"].min() < 0 or tensors["draft_vocab"].max() >= vocab_size:
        raise ValueError(f"{field}: head {path.name} has draft_vocab ids outside the target's vocabulary")
    return HeadFile(path, config, tensors)
