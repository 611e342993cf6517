"""NumPy/Numba runtime of a draft head's pieces: weight products, one Llama decoder layer, KV per request.

Weight products go through the engine's strip kernels (`engine.kernels.linear`), so a row's result
never depends on which other rows share the batch: drafts of a request are the same alone or batched.
Head matrices are packed as Q8_0 (default; a quarter of the bytes of float32) or float32; Q8_0 ones
use the target's numerics (integer products under the default "int8").
"""

from __future__ import annotations

import gguf
import numpy as np

from engine.kernels.linear import Weight, linear, pack_f32, pack_gguf_tensor
from engine.kernels.weights import RawTensor

WEIGHT_FORMATS = ("q8_0", "f32")


def pack_matrix(w: np.ndarray, fmt: str, numerics: str = "exact") -> Weight:
    """w [out, in] float32 -> packed for `linear`; Q8_0 needs in % 32 == 0 (else float32).

    Q8_0 matrices use the target's numerics (integer products under "int8"); float32 stays float.
    """
    w = np.ascontiguousarray(w, np.float32)
    if fmt == "q8_0" and w.shape[1] % 32 == 0:
        q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
        return pack_gguf_tensor(RawTensor("head", gguf.GGMLQuantizationType.Q8_0, (w.shape[1], w.shape[0]), q), numerics)
    return pack_f32(w)


def gather_rows(t, rows: np.ndarray) -> RawTensor:
    """Rows `rows` of a 2-D GGUF tensor, kept in its own format (each row is independent)."""
    data = np.asarray(t.data)
    k = int(t.shape[0])
    return RawTensor(f"{t.name}[rows]", gguf.GGMLQuantizationType(t.tensor_type), (k, len(rows)),
                     np.ascontiguousarray(data.reshape(int(t.shape[1]), -1)[rows]))


def matmul(x: np.ndarray, w: Weight) -> np.ndarray:
    """x [n, in] -> [n, out]."""
    out = np.empty((x.shape[0], w.n), np.float32)
    linear(np.ascontiguousarray(x, np.float32), w, out)
    return out


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    var = np.mean(np.square(x, dtype=np.float32), axis=-1, keepdims=True)
    return (x / np.sqrt(var + np.float32(eps))).astype(np.float32) * weight


def silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1.0) + np.exp(-x))


class KVStore:
    """One request's head KV by position: k, v [capacity, num_kv_heads, head_dim]; grows by doubling."""

    def __init__(self, num_kv_heads: int, head_dim: int, capacity: int = 256):
        self.k = np.zeros((capacity, num_kv_heads, head_dim), np.float32)
        self.v = np.zeros_like(self.k)

    def ensure(self, size: int) -> None:
        if size > len(self.k):
            new = max(size, 2 * len(self.k))
            for name in ("k", "v"):
                old = getattr(self, name)
                grown = np.zeros((new, *old.shape[1:]), np.float32)
                grown[: len(old)] = old
                setattr(self, name, grown)


class DecoderLayer:
    """One Llama decoder layer with rotate-half RoPE; attention reads a request's KVStore."""

    def __init__(self, w: dict[str, np.ndarray], cfg: dict, fmt: str, numerics: str = "exact"):
        self.num_heads, self.num_kv_heads, self.head_dim = cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"]
        self.eps = cfg["rms_eps"]
        self.attn_norm, self.ffn_norm = w["attn_norm"], w["ffn_norm"]
        self.qkv = pack_matrix(np.concatenate([w["q"], w["k"], w["v"]]), fmt, numerics)
        self.o = pack_matrix(w["o"], fmt, numerics)
        self.gate_up = pack_matrix(np.concatenate([w["gate"], w["up"]]), fmt, numerics)
        self.down = pack_matrix(w["down"], fmt, numerics)
        hd = self.head_dim
        self.inv_freq = (1.0 / cfg["rope_theta"] ** (np.arange(0, hd, 2, dtype=np.float64) / hd))

    def forward(self, x: np.ndarray, runs: list[tuple[KVStore, int, int, int]]) -> np.ndarray:
        """x [n, H] holds consecutive runs of rows, run = (store, first position, attention start,
        num rows); each row's K/V is stored at its position, then it attends causally. -> [n, H]."""
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = matmul(rms_norm(x, self.attn_norm, self.eps), self.qkv)  # [n, (nh + 2 nkv) hd]
        positions = np.concatenate([np.arange(p0, p0 + m) for _, p0, _, m in runs])
        q = self._rope(qkv[:, : nh * hd].reshape(-1, nh, hd), positions)
        k = self._rope(qkv[:, nh * hd : (nh + nkv) * hd].reshape(-1, nkv, hd), positions)
        v = qkv[:, (nh + nkv) * hd :].reshape(-1, nkv, hd)
        attn = np.empty((len(x), nh * hd), np.float32)
        row = 0
        for store, p0, lo, m in runs:
            store.ensure(p0 + m)
            store.k[p0 : p0 + m], store.v[p0 : p0 + m] = k[row : row + m], v[row : row + m]
            attn[row : row + m] = self._attend(q[row : row + m], store, p0, lo).reshape(m, -1)
            row += m
        x = x + matmul(attn, self.o)
        gate_up = matmul(rms_norm(x, self.ffn_norm, self.eps), self.gate_up)  # [n, 2 I]
        inter = gate_up.shape[1] // 2
        return x + matmul(silu(gate_up[:, :inter]) * gate_up[:, inter:], self.down)

    def _rope(self, t: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Rotate-half RoPE on t [n, heads, hd] at positions [n]."""
        ang = positions[:, None].astype(np.float64) * self.inv_freq[None, :]  # [n, hd/2]
        cos = np.concatenate([np.cos(ang)] * 2, axis=1).astype(np.float32)[:, None, :]
        sin = np.concatenate([np.sin(ang)] * 2, axis=1).astype(np.float32)[:, None, :]
        half = t.shape[-1] // 2
        rotated = np.concatenate([-t[..., half:], t[..., :half]], axis=-1)
        return t * cos + rotated * sin

    def _attend(self, q: np.ndarray, store: KVStore, p0: int, lo: int) -> np.ndarray:
        """Causal attention of q [m, nh, hd] at positions p0.. over the store's keys lo..p0+m-1 -> [m, nh, hd]."""
        m, nh, hd = q.shape
        nkv, group = self.num_kv_heads, nh // self.num_kv_heads
        keys, values = store.k[lo : p0 + m], store.v[lo : p0 + m]  # [c, nkv, hd]
        # batched BLAS products per KV head (einsum took a slow non-BLAS path)
        qg = q.reshape(m, nkv, group, hd).transpose(1, 2, 0, 3).reshape(nkv, group * m, hd)
        scores = (qg @ keys.transpose(1, 2, 0)).reshape(nkv, group, m, -1) / np.float32(np.sqrt(hd))  # [nkv, g, m, c]
        key_pos = np.arange(lo, p0 + m)
        scores = np.where(key_pos[None, :] <= np.arange(p0, p0 + m)[:, None], scores, -np.inf)
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = (scores / scores.sum(axis=-1, keepdims=True)).astype(np.float32).reshape(nkv, group * m, -1)
        out = probs @ values.transpose(1, 0, 2)  # [nkv, g m, hd]
        return out.reshape(nkv, group, m, hd).transpose(2, 0, 1, 3).reshape(m, nh, hd)
