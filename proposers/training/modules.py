"""Torch draft heads with exactly the semantics of `proposers/heads/head_file.py` (read its docstring).

Parameter names are the file's tensor names: `m.{i}.q.weight` here is `m{i}.q.weight` there.
The target's token embedding and its LM head rows of the draft vocabulary are frozen buffers.

Attention comes in two shapes:
  * teacher-forced: rows 0..T-1 of a sequence chunk, row p attending to rows <= p (causal);
  * drafting: query t continues its own chain -- it sees earlier rows through a `visible` mask
    and, besides, only the keys of its own earlier draft steps (`chain`) and itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class HeadShape:
    kind: str  # eagle | mtp | medusa
    num_modules: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float
    rope_theta: float


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()  # float32 statistics under bfloat16 autocast too
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE (HF Llama): x [B, T, heads, hd] at positions pos [B, T]."""
    hd = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)  # [hd/2]
    ang = pos.to(torch.float64)[..., None] * inv_freq  # [B, T, hd/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype)[:, :, None]  # [B, T, 1, hd]
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)[:, :, None]
    rotated = torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], -1)
    return x * cos + rotated * sin


def chain_attention(q, prev: tuple, chain: list[tuple]) -> torch.Tensor:
    """q [B, T, nh, hd]; prev = (k, v [B, S, nkv, hd], visible [T, S] bool); chain = [(k, v [B, T, nkv, hd])]
    per-query keys (query t sees only chain[j][:, t]). Returns [B, T, nh, hd]."""
    k_prev, v_prev, visible = prev
    rep, scale = q.shape[2] // k_prev.shape[2], q.shape[-1] ** -0.5
    k_chain = torch.stack([k for k, _ in chain], 2).repeat_interleave(rep, 3)  # [B, T, J, nh, hd]
    v_chain = torch.stack([v for _, v in chain], 2).repeat_interleave(rep, 3)
    k_prev, v_prev = k_prev.repeat_interleave(rep, 2), v_prev.repeat_interleave(rep, 2)  # [B, S, nh, hd]
    s_prev = torch.einsum("bthd,bshd->bhts", q, k_prev) * scale
    s_prev = s_prev.masked_fill(~visible, float("-inf"))
    s_chain = torch.einsum("bthd,btjhd->bhtj", q, k_chain) * scale
    probs = torch.softmax(torch.cat([s_prev, s_chain], -1), -1)  # [B, nh, T, S + J]
    num_prev = k_prev.shape[1]
    return (torch.einsum("bhts,bshd->bthd", probs[..., :num_prev], v_prev)
            + torch.einsum("bhtj,btjhd->bthd", probs[..., num_prev:], v_chain))


class DraftModule(nn.Module):
    """One EAGLE / MTP module: fc over [embedding, feature], then one Llama decoder layer."""

    def __init__(self, shape: HeadShape, with_norms: bool):
        super().__init__()
        h, q_size, kv_size, inter = (shape.hidden_size, shape.num_heads * shape.head_dim,
                                     shape.num_kv_heads * shape.head_dim, shape.intermediate_size)
        self.shape, self.with_norms = shape, with_norms
        self.fc = nn.Linear(2 * h, h, bias=False)
        if with_norms:
            self.emb_norm, self.feat_norm, self.out_norm = (RMSNorm(h, shape.rms_eps) for _ in range(3))
        self.attn_norm, self.ffn_norm = RMSNorm(h, shape.rms_eps), RMSNorm(h, shape.rms_eps)
        self.q = nn.Linear(h, q_size, bias=False)
        self.k, self.v = nn.Linear(h, kv_size, bias=False), nn.Linear(h, kv_size, bias=False)
        self.o = nn.Linear(q_size, h, bias=False)
        self.gate, self.up = nn.Linear(h, inter, bias=False), nn.Linear(h, inter, bias=False)
        self.down = nn.Linear(inter, h, bias=False)
        with torch.no_grad():  # start near z = feature: the fc passes the feature through, the layer adds little
            self.fc.weight[:, :h].mul_(0.1)
            self.fc.weight[:, h:].copy_(torch.eye(h))
            self.o.weight.mul_(0.1)
            self.down.weight.mul_(0.1)

    def forward(self, emb, feat, pos, prev=None, chain=()):
        """emb, feat [B, T, H], pos [B, T] -> z [B, T, H] and this row's (k, v) [B, T, nkv, hd].
        prev None: causal over these rows; else drafting (see `chain_attention`)."""
        s = self.shape
        if self.with_norms:
            emb, feat = self.emb_norm(emb), self.feat_norm(feat)
        x = self.fc(torch.cat([emb, feat], -1))
        h = self.attn_norm(x)
        b, t = x.shape[:2]
        q = rope(self.q(h).view(b, t, s.num_heads, s.head_dim), pos, s.rope_theta)
        k = rope(self.k(h).view(b, t, s.num_kv_heads, s.head_dim), pos, s.rope_theta)
        v = self.v(h).view(b, t, s.num_kv_heads, s.head_dim)
        if prev is None:
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True, enable_gqa=True).transpose(1, 2)
        else:
            a = chain_attention(q, prev, [*chain, (k, v)])
        x = x + self.o(a.reshape(b, t, -1))
        h = self.ffn_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h)), (k, v)


class MedusaBlock(nn.Module):
    """feature' = f + silu(f @ W.T + b); starts as the identity (W = 0, b = 0)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.w = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.w.weight)
        nn.init.zeros_(self.w.bias)

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        return f + F.silu(self.w(f))


class DraftHead(nn.Module):
    """A head of any kind: `m` holds its modules; `embed` [V, H] and `lm_head` [V_d, H] are frozen."""

    def __init__(self, shape: HeadShape, embed: torch.Tensor, lm_head: torch.Tensor):
        super().__init__()
        self.shape = shape
        self.register_buffer("embed", embed, persistent=False)
        self.register_buffer("lm_head", lm_head, persistent=False)
        if shape.kind == "medusa":
            self.m = nn.ModuleList(MedusaBlock(shape.hidden_size) for _ in range(shape.num_modules))
        else:
            self.m = nn.ModuleList(DraftModule(shape, shape.kind == "mtp") for _ in range(shape.num_modules))

    def logits(self, z: torch.Tensor, module: int = 0) -> torch.Tensor:
        """[..., V_d] float32 draft-vocabulary logits of z (mtp: through that module's out_norm)."""
        if self.shape.kind == "mtp":
            z = self.m[module].out_norm(z)
        return (z @ self.lm_head.T).float()

    def file_tensors(self) -> dict[str, torch.Tensor]:
        """The trained weights under their head-file names (`m{i}.name`)."""
        return {"m" + name[2:]: value for name, value in self.state_dict().items()}
