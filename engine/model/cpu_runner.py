"""CPU model runner: weights packed once, a paged KV cache allocated once, one ragged forward.

The runner owns every array the forward pass touches. A step fills a `ForwardBatch`
(preallocated host arrays) and calls `forward(batch)`, which returns logits only for
the rows listed in `batch.logits_indices`.
"""

from __future__ import annotations

import dataclasses

import numba
import numpy as np
from numba.core import types
from threadpoolctl import threadpool_limits

import engine  # noqa: F401  (sets NUMBA_SLP_VECTORIZE before numba compiles anything)
from engine.jit_cache import launch_threads
from engine.kernels import layer as layer_kernels
from engine.kernels import moe, ops
from engine.kernels.attention import vector_shapes
from engine.kernels.int_linear import QuantRows, host_path
from engine.kernels.linear import PackedWeight, linear, pack_gguf_tensor
from engine.kernels.weights import EmbeddingTable
from engine.model import cpu_compile, cpu_weights
from engine.model.forward_batch import CacheConfig, ForwardBatch  # the runner's inputs (also imported from here)
from engine.model.gguf_loader import GGUFModel, ModelConfig

KV_CACHE_DTYPES = ("auto", "float16", "float32", "int8")
KV_BYTES = {"float32": 4.0, "float16": 2.0, "int8": 1.0 + 4 / 32}  # per element, an int8 block's float32 scale included


def kv_dtype_name(kv_cache_dtype: str, numerics: str, cfg: ModelConfig, block_size: int) -> str:
    """The KV cache's element type: "auto" is float16 under int8 numerics (where the vector attention
    serves the shapes) and float32 under exact numerics; "int8" is q8_0 blocks of 32 dims."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    fits = vector_shapes(cfg.head_dim, block_size)
    if kv_cache_dtype in ("float16", "int8") and not fits:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype} needs head_dim ({cfg.head_dim}) and block_size ({block_size}) "
                         "to be multiples of 16")
    if kv_cache_dtype == "int8" and cfg.head_dim % 32:
        raise ValueError(f"kv_cache_dtype int8 needs head_dim ({cfg.head_dim}) to be a multiple of 32")
    if kv_cache_dtype == "auto":
        return "float16" if numerics == "int8" and fits else "float32"
    return kv_cache_dtype


def _array_kinds(*arrays: np.ndarray) -> tuple:
    """What numba's type of each array can depend on: dtype, rank, layout, writability (and alignment)."""
    return tuple((a.dtype.num, a.ndim, a.flags.c_contiguous, a.flags.f_contiguous, a.flags.writeable, a.flags.aligned)
                 for a in arrays)


class CpuRunner:  # implements engine.model.runner_api.ModelRunner
    """`numerics`: "int8" (integer weight products on int8-quantized activations) or "exact"
    (strict float32); `num_layers` < the model's keeps only its first layers (a self-speculative
    draft); `weights_from` shares another runner's packed weights instead of packing them again."""

    provides_hidden_states = True
    supports_grammars = True  # grammar masks are applied to host logits

    def __init__(self, model: GGUFModel, cache: CacheConfig, num_threads: int = 0,
                 num_layers: int | None = None, weights_from: "CpuRunner | None" = None, numerics: str = "int8",
                 kv_cache_dtype: str = "auto", compile_also: tuple = ()):
        launch_threads()
        if num_threads > 0:
            numba.set_num_threads(min(num_threads, numba.config.NUMBA_NUM_THREADS))
        # The Numba kernels own the cores. NumPy's BLAS (the draft heads' small attention products)
        # would keep worker threads spinning after each call, taking those cores from the next
        # forward (measured: an eagle head that seldom drafts at 0.89x of plain decoding; 1.0x with this).
        threadpool_limits(1, user_api="blas")
        cfg = model.config
        if num_layers is not None:
            if not 1 <= num_layers <= cfg.num_layers:
                raise ValueError(f"num_layers must be in 1..{cfg.num_layers}, got {num_layers}")
            cfg = dataclasses.replace(cfg, num_layers=num_layers)
        self.config = cfg
        self.cache = cache
        self.capture_hidden = False  # also keep the final-normed hidden state of every row
        self.numerics = weights_from.numerics if weights_from is not None else numerics
        if weights_from is not None:
            self.embed, self.final_norm, self.lm_head = weights_from.embed, weights_from.final_norm, weights_from.lm_head
            self.embed_table = weights_from.embed_table
            self.layers = weights_from.layers[: cfg.num_layers]
        else:
            self._load_weights(model)
        self.weight_bytes = sum(cpu_weights.streamed_bytes(layer, cfg.num_experts_used) for layer in self.layers) \
            + self.lm_head.nbytes  # what one token's forward reads
        max_pos = max(cache.max_model_len, 1)
        self.rope_cos, self.rope_sin = ops.rope_tables(
            max_pos, cfg.rope_dim, cfg.rope_theta, cfg.rope_scale, model.rope_freq_factors(cache.max_model_len),
            cfg.rope_attn_factor,
        )
        # Sliding-window layers rotate with their own base, unscaled (as llama.cpp does for Gemma 3).
        self.rope_local = ops.rope_tables(max_pos, cfg.rope_dim, cfg.rope_theta_local, 1.0) if cfg.local_layers else None
        # K is stored transposed within a block so that one block's scores are a vector op over keys.
        # fp16 entries are kept as their uint16 bits (the kernels convert them exactly on load).
        self.kv_cache_dtype = kv_dtype_name(kv_cache_dtype, self.numerics, cfg, cache.block_size)  # one of KV_BYTES
        self.k_cache, self.v_cache = self._alloc_kv(cfg, cache)
        self._alloc_activations()
        self._compile_layers()
        cpu_compile.compile_ahead(self, ForwardBatch(cache), compile_also)  # `compile_also`: the caller's kernels

    def _alloc_kv(self, cfg: ModelConfig, cache: CacheConfig) -> tuple:
        """(K, V) caches of every layer: arrays [layers, kv, blocks, hd, bs] and [layers, kv, blocks, bs, hd],
        or for int8 (values, scales) pairs, the scales with hd / 32 in place of hd (a layer's entry: `layer_kv`)."""
        k_shape = (cfg.num_layers, cfg.num_kv_heads, cache.num_blocks, cfg.head_dim, cache.block_size)
        v_shape = (cfg.num_layers, cfg.num_kv_heads, cache.num_blocks, cache.block_size, cfg.head_dim)
        if self.kv_cache_dtype != "int8":
            dtype = np.uint16 if self.kv_cache_dtype == "float16" else np.float32
            return np.zeros(k_shape, dtype), np.zeros(v_shape, dtype)
        scales = lambda shape, axis: np.zeros(shape[:axis] + (shape[axis] // 32,) + shape[axis + 1:], np.float32)  # noqa: E731
        return (np.zeros(k_shape, np.int8), scales(k_shape, 3)), (np.zeros(v_shape, np.int8), scales(v_shape, 4))

    def layer_kv(self, i: int) -> tuple:
        """Layer i's (K, V) cache entries, as the layer kernel takes them."""
        pick = lambda c: (c[0][i], c[1][i]) if isinstance(c, tuple) else c[i]  # noqa: E731
        return pick(self.k_cache), pick(self.v_cache)

    @staticmethod
    def kv_bytes_per_block(cfg: ModelConfig, block_size: int, numerics: str = "int8", kv_cache_dtype: str = "auto") -> int:
        width = KV_BYTES[kv_dtype_name(kv_cache_dtype, numerics, cfg, block_size)]
        return int(2 * cfg.num_layers * block_size * cfg.kv_size * width)

    def _load_weights(self, model: GGUFModel) -> None:
        self.embed = model.tensor("token_embd.weight")
        self.embed_table = EmbeddingTable(self.embed)
        self.layers = cpu_weights.load_layers(model, self.config, self.numerics)
        self.final_norm = model.dense("output_norm.weight")
        head = self.embed if self.config.tied_embeddings else model.tensor("output.weight")
        self.lm_head = pack_gguf_tensor(head, self.numerics)

    def layer_products(self, layer: tuple) -> list:
        """(weight, input buffers) of each distinct product of a layer (a MoE layer: its first expert's and the
        router's), as the layer passes them."""
        rows_h, rows_q, rows_i = self.layer_rows()
        w_qkv, w_o, w_gu, w_down = layer[1], layer[2], layer[4], layer[5]
        if isinstance(w_gu, moe.MoeWeights):
            shared = [] if w_gu.shared_down is None else [(w_gu.shared_gate_up, rows_h), (w_gu.shared_down, rows_i)]
            return [(w_qkv, rows_h), (w_o, rows_q), (w_gu.gate_up[0], rows_h), (w_gu.down[0], rows_i),
                    (w_gu.router, self._router_input(w_gu)), *shared]
        return [(w_qkv, rows_h), (w_o, rows_q), (w_gu, rows_h), (w_down, rows_i)]

    def _alloc_activations(self) -> None:
        cfg, n = self.config, self.cache.max_num_batched_tokens
        self.x = np.zeros((n, cfg.hidden_size), np.float32)  # residual stream
        self.h = np.zeros((n, cfg.hidden_size), np.float32)  # normed input of a sublayer
        self.delta = np.zeros((n, cfg.hidden_size), np.float32)  # sublayer output
        self.qkv = np.zeros((n, cfg.q_size + 2 * cfg.kv_size), np.float32)
        self.attn = np.zeros((n, cfg.q_size), np.float32)
        self.ffn_size = cfg.expert_intermediate_size if cfg.num_experts else cfg.intermediate_size
        self.gate_up = np.zeros((n, 2 * self.ffn_size), np.float32)
        self.act = np.zeros((n, self.ffn_size), np.float32)
        if cfg.num_experts:
            self.moe_scratch = moe.scratch(n, cfg.hidden_size, cfg.num_experts, cfg.num_experts_used,
                                           bool(cfg.shared_expert_intermediate_size))
        self.logits = np.zeros((n, cfg.vocab_size), np.float32)
        self.hidden = np.zeros((n, cfg.hidden_size), np.float32)  # final-normed rows, when captured
        self.req_of_token = np.zeros(n, np.int32)
        self.positions = np.zeros(n, np.int32)
        self.slot_mapping = np.zeros(n, np.int32)

    def _rows(self, k: int, on_float: bool = False):
        """A product's input buffers: QuantRows (int8), or an empty placeholder where the float kernels run
        (exact, or `on_float`: a weight the integer kernels do not run, such as a float32 MoE router),
        which need none."""
        n = self.cache.max_num_batched_tokens
        if self.numerics == "int8" and not on_float:
            r = QuantRows(k, n)
            return r.xq, r.xd, r.xm, r.xs
        return np.empty((0, k, 16), np.float32)

    def layer_rows(self) -> tuple:
        """The layers' product input buffers for inputs of hidden, q and intermediate width (see `_rows`)."""
        return self._bufs[7:10]

    def _compile_layers(self) -> None:
        """One compiled function per layer (engine/kernels/layer.py) and the arguments it keeps."""
        cfg, path = self.config, host_path()
        self._bufs = (self.x, self.delta, self.h, self.qkv, self.attn, self.gate_up, self.act,
                      self._rows(cfg.hidden_size), self._rows(cfg.q_size), self._rows(self.ffn_size))
        # the MoE routers' input buffers, by whether a router runs on the float kernels (llama.cpp leaves them F32)
        kinds = {isinstance(layer[4].router, PackedWeight) for layer in self.layers if isinstance(layer[4], moe.MoeWeights)}
        shared_ff, n = cfg.shared_expert_intermediate_size, self.cache.max_num_batched_tokens
        # a shared expert's own gate_up, act and product input buffers (without one, the routed experts', unused)
        self._shared_bufs = (np.zeros((n, 2 * shared_ff), np.float32), np.zeros((n, shared_ff), np.float32),
                             self._rows(shared_ff)) if shared_ff else self._bufs[5:7] + self._bufs[9:10]
        self._router_rows = {on_float: self._rows(cfg.hidden_size, on_float) for on_float in kinds}
        vector = self.vector_attention = vector_shapes(cfg.head_dim, self.cache.block_size)
        arch = layer_kernels.arch_key(cfg.arch)
        self._layer_calls = []
        unrotated = ()
        for i, layer in enumerate(self.layers):
            attn_norm, w_qkv, w_o, ffn_norm, w_gu, w_down, parts = layer
            keys = tuple(layer_kernels.product_key(w) for w, _ in self.layer_products(layer))
            window = cfg.window(i)
            cos, sin = self.rope_local if window else (self.rope_cos, self.rope_sin)
            if not cfg.arch.rotates(i):  # NoPE: cos 1, sin 0 rotate by nothing, exactly (one pair of tables)
                unrotated = cos, sin = unrotated or (np.ones_like(cos), np.zeros_like(sin))
            args = (attn_norm, *(layer_kernels.product_args(w) for w in (w_qkv, w_o)), ffn_norm,
                    *self._ffn_args(w_gu, w_down), *self.layer_kv(i), (*parts, cos, sin, window))
            if isinstance(w_gu, moe.MoeWeights):  # w[9], w[10] (engine/kernels/moe.py)
                shared = w_gu.shared_down is not None
                args += ((layer_kernels.product_args(w_gu.router), self._router_input(w_gu), cfg.num_experts_used,
                          cfg.expert_weights_norm, self.moe_scratch, shared),
                         (*(layer_kernels.product_args(w) for w in ((w_gu.shared_gate_up, w_gu.shared_down)
                                                                     if shared else (w_gu.gate_up[0], w_gu.down[0]))),
                          *self._shared_bufs))
            run_layer = layer_kernels.layer(keys, self.kv_cache_dtype, vector, path, arch)
            self._layer_calls.append((run_layer, layer_kernels.layer_args(self._bufs, args)))
        self._layer_entries = {}  # _array_kinds of a forward's batch arrays -> each layer's compiled entry

    def _router_input(self, moe_weights: moe.MoeWeights):
        """The input buffers of a MoE layer's router product."""
        return self._router_rows[isinstance(moe_weights.router, PackedWeight)]

    @staticmethod
    def _ffn_args(w_gu, w_down) -> tuple:
        """The layer's w[4], w[5]: the two FFN products' arguments, or every expert's (engine/kernels/moe.py)."""
        if isinstance(w_gu, moe.MoeWeights):
            return (tuple(layer_kernels.product_args(w) for w in w_gu.gate_up),
                    tuple(layer_kernels.product_args(w) for w in w_gu.down))
        return layer_kernels.product_args(w_gu), layer_kernels.product_args(w_down)

    def _entries_for(self, meta: tuple) -> list:
        """Each layer's compiled entry for this forward's meta: the overload its dispatcher would pick.
        A dispatcher types its four arguments at each of the 30 calls of a forward; entering the
        overloads directly took 12-96 us off a step (Xeon, avx512). The batch's arrays are the only
        part of the arguments whose types can change, so their kinds key the entries (numba.typeof of
        the meta tuple alone costs ~40 us)."""
        key = _array_kinds(meta[2], meta[3])  # cu_q, block_tables
        entries = self._layer_entries.get(key)
        if entries is None:
            meta_type = numba.typeof(meta)
            entries = self._layer_entries[key] = [
                run_layer.compile((types.int64, types.boolean, numba.typeof(args), meta_type))
                for run_layer, args in self._layer_calls]
        return entries

    def token_meta(self, batch: ForwardBatch) -> tuple:
        """The layers' `meta` argument for a batch (see engine/kernels/layer.py `_layer`)."""
        cfg = self.config
        scale = np.float32(cfg.attention_scale or 1.0 / np.sqrt(cfg.head_dim))
        if cfg.attn_softcap:  # attention_vec.score_scale: (scale, cap)
            scale = (scale, np.float32(cfg.attn_softcap))
        return (self.positions, self.slot_mapping, batch.cu_q[: batch.num_reqs + 1], batch.block_tables,
                np.float32(cfg.rms_eps), scale,
                cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rope_dim, numba.get_num_threads())

    def forward(self, batch: ForwardBatch) -> np.ndarray:
        """Run the model over the ragged batch; returns logits [num_logits, vocab] (a view, valid until the next call)."""
        cfg, T = self.config, batch.num_tokens
        ops.fill_token_meta(
            batch.cu_q[: batch.num_reqs + 1], batch.seq_lens[: batch.num_reqs], batch.block_tables,
            self.cache.block_size, self.req_of_token, self.positions, self.slot_mapping,
        )
        x, delta = self.x[:T], self.delta[:T]
        self.embed_table.rows(batch.token_ids[:T], x)
        if cfg.arch.embed_scale:
            x *= np.float32(np.sqrt(cfg.hidden_size))
        elif cfg.embedding_scale != 1.0:
            x *= np.float32(cfg.embedding_scale)
        meta = self.token_meta(batch)
        for i, (enter, (_, args)) in enumerate(zip(self._entries_for(meta), self._layer_calls)):
            enter(T, i == 0, args, meta)
        ops.add_inplace(x, delta)
        L = batch.num_logits
        if self.capture_hidden:  # per-row norm: the logits rows get exactly the same values either way
            ops.rms_norm(x, self.final_norm, cfg.rms_eps, self.hidden[:T])
            normed = self.hidden[batch.logits_indices[:L]]  # [num_logits, hidden]
        else:
            rows = x[batch.logits_indices[:L]]  # [num_logits, hidden]
            normed = np.empty_like(rows)
            ops.rms_norm(rows, self.final_norm, cfg.rms_eps, normed)
        logits = self.logits[:L]
        self._lm_head(normed, logits)
        return logits

    def _lm_head(self, normed: np.ndarray, logits: np.ndarray) -> None:
        """logits [rows, vocab] of final-normed rows [rows, hidden]."""
        cfg = self.config
        linear(normed, self.lm_head, logits)
        if cfg.logit_scale != 1.0:  # as llama.cpp: times 1 / scale (Granite)
            logits *= np.float32(1.0 / cfg.logit_scale)
        if cfg.final_softcap:  # cap * tanh(logits / cap), element by element (Gemma 2)
            cap = np.float32(cfg.final_softcap)
            np.tanh(np.divide(logits, cap, out=logits), out=logits)
            logits *= cap

    def row_logits(self, rows: np.ndarray) -> np.ndarray:
        """[len(rows), vocab] logits of any rows of the last forward (its own logits rows get the same bits:
        the norm and the products are row by row); a new array, so the forward's logits stay as they are."""
        x = self.x[rows]  # [rows, hidden]: the final residual stream, until the next forward
        normed = np.empty_like(x)
        ops.rms_norm(x, self.final_norm, self.config.rms_eps, normed)
        logits = np.empty((len(rows), self.config.vocab_size), np.float32)
        self._lm_head(normed, logits)
        return logits

    def hidden_states(self, num_tokens: int) -> np.ndarray:
        """[num_tokens, hidden] final-normed hidden states of the last forward (needs `capture_hidden`)."""
        return self.hidden[:num_tokens]
