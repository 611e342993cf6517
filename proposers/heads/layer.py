"""Runtime of a draft head's pieces: weight products, one Llama decoder layer, KV per request.

Weight products go through the engine's strip kernels (`engine.kernels.linear`), norms, RoPE and the
gated activation through its row kernels, attention through a compiled per-row kernel
(head_attention): a row's result never depends on which other rows share the batch, so drafts of a
request are the same alone or batched. (A NumPy chain of ~40 small calls per layer cost almost as much as
the head's weight products: ~0.8 ms of a ~2.3 ms draft step on the 2-core machine.)
Head matrices are packed as Q8_0 (default; a quarter of the bytes of float32), Q4_0 (an eighth) or
float32; quantized ones use the target's numerics (integer products under the default "int8").
"""

from __future__ import annotations

import gguf
import numpy as np

from engine.kernels import arch_ops, ops
from engine.kernels import layer as layer_kernels
from engine.kernels.int_linear import host_path
from engine.kernels.linear import Weight, linear, pack_f32, pack_gguf_tensor
from engine.kernels.weights import RawTensor
from proposers.heads.head_attention import store_and_attend, store_kv
from proposers.heads.layer_jit import head_layer

WEIGHT_FORMATS = ("q8_0", "q4_0", "f32")
_GGML_TYPES = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}


def pack_matrix(w: np.ndarray, fmt: str, numerics: str = "exact") -> Weight:
    """w [out, in] float32 -> packed for `linear`; Q8_0 / Q4_0 need in % 32 == 0 (else float32).

    Quantized matrices use the target's numerics (integer products under "int8"); float32 stays float.
    """
    w = np.ascontiguousarray(w, np.float32)
    kind = _GGML_TYPES.get(fmt)
    if kind is not None and w.shape[1] % 32 == 0:
        q = gguf.quants.quantize(w, kind)
        return pack_gguf_tensor(RawTensor("head", kind, (w.shape[1], w.shape[0]), q), numerics)
    return pack_f32(w)


def gather_rows(t, rows: np.ndarray) -> RawTensor:
    """Rows `rows` of a 2-D GGUF tensor, kept in its own format (each row is independent)."""
    data = np.asarray(t.data)
    k = int(t.shape[0])
    return RawTensor(f"{t.name}[rows]", gguf.GGMLQuantizationType(t.tensor_type), (k, len(rows)),
                     np.ascontiguousarray(data.reshape(int(t.shape[1]), -1)[rows]))


def draft_rows(t, rows: np.ndarray, fmt: str) -> RawTensor:
    """The draft LM head: rows `rows` of the target's output matrix, kept in its own format, or for
    fmt "q4_0" requantized to Q4_0 (half the bytes of Q8_0; the drafts may differ, the output cannot)."""
    gathered = gather_rows(t, rows)
    if fmt != "q4_0" or gathered.tensor_type == gguf.GGMLQuantizationType.Q4_0 or gathered.shape[0] % 32:
        return gathered
    w = gguf.quants.dequantize(gathered.data, gguf.GGMLQuantizationType(gathered.tensor_type))
    w = np.asarray(w, np.float32).reshape(len(rows), -1)
    return RawTensor(gathered.name, gguf.GGMLQuantizationType.Q4_0, gathered.shape,
                     gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0))


def matmul(x: np.ndarray, w: Weight) -> np.ndarray:
    """x [n, in] -> [n, out]."""
    out = np.empty((x.shape[0], w.n), np.float32)
    linear(np.ascontiguousarray(x, np.float32), w, out)
    return out


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    out = np.empty(x.shape, np.float32)
    ops.rms_norm(np.ascontiguousarray(x, np.float32), weight, eps, out)
    return out


def silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1.0) + np.exp(-x))


class KVStore:
    """One request's head KV by position: k [num_kv_heads, head_dim, capacity] (keys contiguous per dim),
    v [capacity, num_kv_heads, head_dim]; capacity a multiple of 16, grown by doubling."""

    def __init__(self, num_kv_heads: int, head_dim: int, capacity: int = 256):
        capacity = -(-capacity // 16) * 16  # whole 16-key chunks (head_attention's vector loads)
        self.k = np.zeros((num_kv_heads, head_dim, capacity), np.float32)
        self.v = np.zeros((capacity, num_kv_heads, head_dim), np.float32)

    @property
    def capacity(self) -> int:
        return len(self.v)

    def ensure(self, size: int) -> None:
        if size > self.capacity:
            new, old = -(-max(size, 2 * self.capacity) // 16) * 16, self.capacity
            k = np.zeros(self.k.shape[:2] + (new,), np.float32)
            k[:, :, :old] = self.k
            v = np.zeros((new,) + self.v.shape[1:], np.float32)
            v[:old] = self.v
            self.k, self.v = k, v


class DecoderLayer:
    """One Llama decoder layer with rotate-half RoPE; attention reads a request's KVStore."""

    def __init__(self, w: dict[str, np.ndarray], cfg: dict, fmt: str, numerics: str = "exact", window: int = 0):
        self.window = window  # a row attends to at most this many keys, its own included (0: all)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"]
        self.eps = cfg["rms_eps"]
        self.attn_norm, self.ffn_norm = w["attn_norm"], w["ffn_norm"]
        self.qkv = pack_matrix(np.concatenate([w["q"], w["k"], w["v"]]), fmt, numerics)
        self.o = pack_matrix(w["o"], fmt, numerics)
        self.gate_up = pack_matrix(np.concatenate([w["gate"], w["up"]]), fmt, numerics)
        self.down = pack_matrix(w["down"], fmt, numerics)
        self.rope_theta = cfg["rope_theta"]
        self.cos, self.sin = ops.rope_tables(256, self.head_dim, self.rope_theta, 1.0)  # [positions, hd / 2]
        self.scale = np.float32(1.0 / np.sqrt(self.head_dim))
        self.compiled = self._compile(w)

    def _compile(self, w: dict[str, np.ndarray]):
        """(the layer as one compiled call, its weight arguments) where every product is integer, else None."""
        weights = (self.qkv, self.o, self.gate_up, self.down)
        keys = self.keys = tuple(layer_kernels.product_key(m) for m in weights)
        if any(k[0] != "int8" for k in keys):
            return None
        args = (self.attn_norm, *(layer_kernels.product_args(m) for m in weights[:2]), self.ffn_norm,
                *(layer_kernels.product_args(m) for m in weights[2:]), int(w["down"].shape[1]))
        return head_layer(keys, host_path()), args

    def run_args(self, run: tuple[KVStore, int, int, int]) -> tuple:
        """The compiled layer's arguments after its weights, for one run (the store grown to hold it)."""
        store, p0, lo, m = run
        store.ensure(p0 + m)
        cos, sin = self._rope_tables(p0 + m)
        return store.k, store.v, p0, lo, self.window, cos, sin, np.float32(self.eps), self.scale, self.num_heads

    def forward(self, x: np.ndarray, runs: list[tuple[KVStore, int, int, int]]) -> np.ndarray:
        """x [n, H] holds consecutive runs of rows, run = (store, first position, attention start,
        num rows); each row's K/V is stored at its position, then it attends causally. -> [n, H]."""
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        if self.compiled is not None and len(runs) == 1:  # one request: the whole layer in one call
            run_layer, args = self.compiled
            return run_layer(np.ascontiguousarray(x, np.float32), args, *self.run_args(runs[0]))
        qkv = matmul(rms_norm(x, self.attn_norm, self.eps), self.qkv)  # [n, (nh + 2 nkv) hd]
        positions = np.concatenate([np.arange(p0, p0 + m, dtype=np.int32) for _, p0, _, m in runs])
        cos, sin = self._rope_tables(int(positions.max()) + 1)
        arch_ops.rope_neox(qkv, positions, cos, sin, nh + nkv, hd, hd)  # q and k heads, in place
        attn = np.empty((len(x), nh * hd), np.float32)  # [n, nh hd]
        row = 0
        for store, p0, lo, m in runs:
            store.ensure(p0 + m)
            store_and_attend(qkv[row : row + m], store.k, store.v, p0, lo, self.window, nh, self.scale,
                             attn[row : row + m])
            row += m
        x = x + matmul(attn, self.o)
        gate_up = matmul(rms_norm(x, self.ffn_norm, self.eps), self.gate_up)  # [n, 2 I]
        act = np.empty((len(x), gate_up.shape[1] // 2), np.float32)  # [n, I]
        ops.swiglu(gate_up, act)
        return x + matmul(act, self.down)

    def store_kv(self, x: np.ndarray, store: KVStore, p0: int) -> None:
        """Only the K/V of rows x [n, H] at positions p0..p0+n-1 into the store, as `forward` computes them."""
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = matmul(rms_norm(x, self.attn_norm, self.eps), self.qkv)  # [n, (nh + 2 nkv) hd]
        cos, sin = self._rope_tables(p0 + len(x))
        arch_ops.rope_neox(qkv, np.arange(p0, p0 + len(x), dtype=np.int32), cos, sin, nh + nkv, hd, hd)
        store.ensure(p0 + len(x))
        store_kv(qkv, store.k, store.v, p0, nh)

    def _rope_tables(self, num_positions: int) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin [>= num_positions, hd / 2] (grown by doubling)."""
        if num_positions > len(self.cos):
            size = max(num_positions, 2 * len(self.cos))
            self.cos, self.sin = ops.rope_tables(size, self.head_dim, self.rope_theta, 1.0)
        return self.cos, self.sin
