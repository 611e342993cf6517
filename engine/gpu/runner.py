"""GPU model runner: CpuRunner's interface and semantics on CUDA (CuPy + raw kernels from cuda/*.cu).

Weights are uploaded once (fp16 by default, bf16 or fp32 on request); products accumulate in
float32 through cuBLAS (or cuda/linear.cu with batch_invariant=True). The paged KV cache (fp16;
fp32 in the float32 build, which then matches the CPU runner to rounding) and every per-step buffer are allocated in __init__ at their maximum size; the KV cache takes
what the memory budget leaves after weights and buffers. A step stages its inputs through pinned
memory with async copies on one stream, runs eagerly or replays a CUDA graph captured for its
padded token count, and returns the logits rows in `batch.logits_indices` as host NumPy.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from engine.gpu.buffers import StepBuffers
from engine.gpu.gemm import Gemm, check_invariant_shape
from engine.gpu.kernels import ATTENTION_HEAD_DIMS, KV_DTYPE, MAX_ATTENTION_ROWS, Kernels, attention_q_tile
from engine.gpu.verify import DeviceVerifier
from engine.gpu.weights import STORAGE_DTYPES, upload_weights
from engine.kernels import ops
from engine.model.cpu_runner import CacheConfig, ForwardBatch
from engine.model.gguf_loader import GGUFModel, ModelConfig

DEFAULT_GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64)
RESERVED_BYTES = 512 << 20  # CUDA graphs, cuBLAS, kernel images, allocator slack


class GpuRunner:  # implements engine.model.runner_api.ModelRunner
    provides_hidden_states = False
    supports_grammars = False  # grammar masks are applied to host logits
    numerics = "exact"  # what a proposer's CPU kernels use beside this runner
    capture_hidden = False

    def __init__(self, model: GGUFModel, cache: CacheConfig, *, dtype: str = "float16",
                 gpu_memory_utilization: float | None = None, batch_invariant: bool = False,
                 cuda_graphs: bool = True, graph_sizes=DEFAULT_GRAPH_SIZES, kv_partition_size: int = 256):
        import cupy as cp

        self.config = cfg = model.config
        _check_config(cfg, dtype, gpu_memory_utilization, kv_partition_size, batch_invariant)
        self.cp, self.dtype, self.batch_invariant = cp, dtype, batch_invariant
        self.partition_size = kv_partition_size
        self.q_tile = attention_q_tile(cfg.num_heads, cfg.num_kv_heads)
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.kernels = Kernels(dtype)
        self.kernels.warm()
        self.weights = upload_weights(model, dtype, cp.asarray)
        self.weight_bytes = self.weights.nbytes
        self.gemm = Gemm(dtype, self.kernels, batch_invariant, self.stream)
        self.bufs = StepBuffers(cfg, cache, dtype, kv_partition_size)
        cos, sin = ops.rope_tables(max(cache.max_model_len, 1), cfg.rope_dim, cfg.rope_theta, cfg.rope_scale,
                                   model.rope_freq_factors(cache.max_model_len), cfg.rope_attn_factor)
        self.rope_cos, self.rope_sin = cp.asarray(cos), cp.asarray(sin)
        self.verifier = DeviceVerifier(self.kernels, cfg.vocab_size, cache.max_num_batched_tokens,
                                       cache.max_num_seqs, self.stream)
        self.cache = dataclasses.replace(cache, num_blocks=self._num_kv_blocks(cache, gpu_memory_utilization))
        kv_shape = (cfg.num_layers, 2, self.cache.num_blocks, cache.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv = cp.zeros(kv_shape, KV_DTYPE[dtype])  # fp16, or fp32 in the float32 build
        self.kv_layers = [(self.kv[i, 0], self.kv[i, 1]) for i in range(cfg.num_layers)]
        cp.cuda.Device().synchronize()
        self.graphs: dict[int, object] = {}
        self._num_logits = 0
        if cuda_graphs:
            limit = min(cache.max_num_batched_tokens, cache.max_model_len)
            self._capture_graphs(sorted({int(s) for s in graph_sizes if 0 < int(s) <= limit}))

    @staticmethod
    def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: str = "float16") -> int:
        return 2 * cfg.num_layers * block_size * cfg.kv_size * np.dtype(KV_DTYPE[dtype]).itemsize  # K and V

    def _num_kv_blocks(self, cache: CacheConfig, utilization: float | None) -> int:
        cp = self.cp
        cp.get_default_memory_pool().free_all_blocks()
        free, total = cp.cuda.runtime.memGetInfo()
        per_block = self.kv_bytes_per_block(self.config, cache.block_size, self.dtype)
        if utilization is None:
            num_blocks = cache.num_blocks
            if num_blocks * per_block > free - RESERVED_BYTES:
                raise ValueError(f"kv_cache_memory: {num_blocks} KV blocks ({num_blocks * per_block / 2**30:.2f} GiB) "
                                 f"do not fit in {free / 2**30:.2f} GiB of free GPU memory")
        else:
            budget = total * utilization - (total - free) - RESERVED_BYTES
            num_blocks = max(int(budget // per_block), 0)
        needed = cache.max_blocks_per_seq + 1
        if num_blocks < needed:
            raise ValueError(f"gpu_memory_utilization: the budget holds {num_blocks} KV blocks; one request of "
                             f"max_model_len={cache.max_model_len} needs {needed}: raise --gpu-memory-utilization "
                             "or lower --max-model-len")
        return num_blocks

    # ------------------------------------------------------------------ the forward pass

    def forward(self, batch: ForwardBatch) -> np.ndarray:
        """Logits [num_logits, vocab] on the host (a pinned view, valid until the next call)."""
        logits = self.forward_device(batch)
        host = self.bufs.h_logits[: batch.num_logits]
        if batch.num_logits:
            logits.get(stream=self.stream, out=host, blocking=False)
        self.stream.synchronize()
        return host

    def forward_device(self, batch: ForwardBatch):
        """Run the step; returns the device logits [num_logits, vocab] (valid until the next call)."""
        self.bufs.check(batch)
        T, L = batch.num_tokens, batch.num_logits
        size = self._graph_size(T, L)
        capacity = size or T
        num_logits_cap = capacity if size else L
        self.bufs.stage(batch, capacity, num_logits_cap, self.stream)
        with self.stream:
            if size:
                self.graphs[size].launch(stream=self.stream)
            else:
                longest = int(batch.seq_lens[: batch.num_reqs].max())
                self._launch(capacity, num_logits_cap, -(-longest // self.partition_size))
        self._num_logits = L
        return self.bufs.logits[:L]

    def _graph_size(self, num_tokens: int, num_logits: int) -> int | None:
        """The smallest captured size that holds a decode/verify step (every token gets logits)."""
        if num_logits != num_tokens:
            return None
        return next((s for s in sorted(self.graphs) if s >= num_tokens), None)

    def _launch(self, capacity: int, num_logits_cap: int, num_splits: int) -> None:
        """Every kernel of one step for `capacity` (padded) tokens; live sizes come from device memory."""
        k, b, w, cfg, gemm = self.kernels, self.bufs, self.weights, self.config, self.gemm
        eps, n = cfg.rms_eps, capacity
        k.build_meta(b.dev("cu_q"), b.dev("seq_lens"), b.block_tables, b.meta, self.cache.block_size, self.q_tile, n)
        k.embed(w.embed, b.dev("token_ids"), b.meta.sizes, b.x, n)
        for i, layer in enumerate(w.layers):
            k.rms_norm(b.x, layer.attn_norm, eps, b.h, n, delta=b.delta if i else None)
            gemm(b.h, layer.qkv, b.qkv, n)  # [n, q + 2 kv]
            k_cache, v_cache = self.kv_layers[i]
            k.rope_write_kv(b.qkv, b.meta.positions, b.meta.slot_mapping, self.rope_cos, self.rope_sin,
                            k_cache, v_cache, cfg, n)
            k.attention(b.qkv, k_cache, v_cache, b.block_tables, b.meta, cfg, self.cache.block_size,
                        self.partition_size, b.max_splits, num_splits, b.attn, b.part_acc, b.part_ml, n)
            gemm(b.attn, layer.o, b.delta, n)
            k.rms_norm(b.x, layer.ffn_norm, eps, b.h, n, delta=b.delta)
            gemm(b.h, layer.gate_up, b.gate_up, n)  # [n, 2 * inter]
            k.swiglu(b.gate_up, b.act, n)
            gemm(b.act, layer.down, b.delta, n)
        if num_logits_cap:
            k.final_norm(b.x, b.delta, b.dev("logits_indices"), w.final_norm, eps, b.normed, num_logits_cap)
            gemm(b.normed, w.lm_head, b.logits, num_logits_cap)  # [num_logits, vocab]

    # ------------------------------------------------------------------ CUDA graphs

    def _capture_graphs(self, sizes: list[int]) -> None:
        """One graph per token count; each replays the whole step against the persistent buffers."""
        dummy = ForwardBatch(self.cache)
        for size in sizes:
            dummy.clear()  # one request of `size` tokens at positions 0..size-1 (blocks 0..)
            dummy.add(np.zeros(size, np.int32), 0, list(range(-(-size // self.cache.block_size))), size)
            self.bufs.stage(dummy, size, size, self.stream)
            with self.stream:
                self._launch(size, size, self.bufs.max_splits)  # warm-up: cuBLAS picks its kernels now
                self.stream.synchronize()
                self.stream.begin_capture()
                try:
                    self._launch(size, size, self.bufs.max_splits)
                finally:
                    graph = self.stream.end_capture()
            self.graphs[size] = graph
        self.stream.synchronize()

    # ------------------------------------------------------------------ verification on the device

    def verify_device(self, cu_rows, draft_ids, draft_probs, has_draft_probs, temperature, top_p, top_k,
                      strategy, policy: int, uniforms, out_token_ids, out_num_accepted,
                      max_candidate_len: int = 5, verify_top_p: float = 1.0) -> None:
        """engine.spec_decode.verify.verify over the last forward's logits rows, without copying them to the host."""
        self.verifier.verify(self.bufs.logits[: self._num_logits], cu_rows, draft_ids, draft_probs,
                             has_draft_probs, temperature, top_p, top_k, strategy, policy, uniforms,
                             out_token_ids, out_num_accepted, max_candidate_len, verify_top_p)

    def close(self) -> None:
        self.graphs.clear()
        self.gemm.close()


def _check_config(cfg: ModelConfig, dtype: str, utilization, partition_size: int, batch_invariant: bool) -> None:
    if cfg.arch.name != "llama":
        raise ValueError(f"model architecture {cfg.arch.name!r}: the GPU backend runs llama models for now; "
                         "serve it with --device cpu")
    if cfg.num_experts:
        raise ValueError(f"{cfg.num_experts} experts: the GPU backend runs dense models for now; serve it with --device cpu")
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"dtype: expected one of {STORAGE_DTYPES}, got {dtype!r}")
    if utilization is not None and not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {utilization}")
    if partition_size < 32 or partition_size % 32:
        raise ValueError(f"kv_partition_size: a positive multiple of 32, got {partition_size}")
    if cfg.head_dim not in ATTENTION_HEAD_DIMS:
        raise ValueError(f"head_dim: the CUDA attention kernel supports {ATTENTION_HEAD_DIMS}, model has {cfg.head_dim}")
    group = cfg.num_heads // cfg.num_kv_heads
    if cfg.num_heads % cfg.num_kv_heads or group > MAX_ATTENTION_ROWS:
        raise ValueError(f"num_kv_heads: {cfg.num_heads} q heads over {cfg.num_kv_heads} kv heads is unsupported")
    if cfg.rope_dim % 2 or cfg.rope_dim > cfg.head_dim:
        raise ValueError(f"rope_dim: {cfg.rope_dim} must be even and <= head_dim")
    if batch_invariant:
        itemsize = 4 if dtype == "float32" else 2
        for name, k in (("hidden_size", cfg.hidden_size), ("q_size", cfg.q_size),
                        ("intermediate_size", cfg.intermediate_size)):
            check_invariant_shape(name, k, itemsize)
