"""Launchers for the kernels in `cuda/*.cu`: grid and block shapes and argument order, once.

Each launcher takes device arrays and plain Python numbers and passes scalars with the exact
C width (np.int32 for `int`, ...). Modules come from a loader: CuPy's RawModule on a GPU, or
engine.gpu.emulator.EmuModule on the CPU, which runs the same launchers with NumPy arrays.
Launches go to the current stream (the runner wraps its work in `with stream:`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.gpu.build import CUDA_DIR, MODULES, compile_options, read_source

ACT_SUFFIX = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
KV_DTYPE = {"float32": "float32", "float16": "float16", "bfloat16": "float16"}  # KV cache storage per build
ATTENTION_HEAD_DIMS = (64, 128)
MAX_ATTENTION_ROWS = 16  # cuda/attention.cu MAX_ROWS: q_tile * group query vectors per block
NORM_THREADS = 256
VERIFY_THREADS = 512  # cuda/verify.cu
LIN_WARPS, LIN_ROWS = 8, 8  # cuda/linear.cu

i32, f32 = np.int32, np.float32


def cupy_loader(name: str):
    import cupy as cp

    return cp.RawModule(code=read_source(CUDA_DIR / f"{name}.cu"), options=compile_options())


@dataclass
class TokenMeta:
    """Per-token and per-tile metadata written by build_meta (all int32 device arrays)."""

    sizes: object  # [4]: num_reqs, num_tokens, num_tiles, num_logits
    cu_tiles: object  # [max_num_seqs + 1]
    req_of_token: object  # [max_tokens]
    positions: object  # [max_tokens] (-1 = padding)
    slot_mapping: object  # [max_tokens] (-1 = padding)
    tile_req: object  # [max_tokens]
    tile_tok0: object  # [max_tokens]
    tile_ntok: object  # [max_tokens]


def attention_q_tile(num_heads: int, num_kv_heads: int) -> int:
    """Tokens per attention tile: as many as fit MAX_ATTENTION_ROWS query vectors of one kv head."""
    return max(1, MAX_ATTENTION_ROWS // (num_heads // num_kv_heads))


class Kernels:
    def __init__(self, act_dtype: str = "float16", loader=cupy_loader, verify_threads: int = VERIFY_THREADS):
        if act_dtype not in ACT_SUFFIX:
            raise ValueError(f"dtype: expected one of {sorted(ACT_SUFFIX)}, got {act_dtype!r}")
        if verify_threads % 32 or not 32 <= verify_threads <= VERIFY_THREADS:
            raise ValueError(f"verify_threads: a multiple of 32 in [32, {VERIFY_THREADS}]")
        self.sfx = ACT_SUFFIX[act_dtype]
        self.kv_dtype = KV_DTYPE[act_dtype]
        self.verify_threads = verify_threads  # fewer only to keep the CPU emulator quick
        self._loader = loader
        self._modules: dict[str, object] = {}
        self._functions: dict[str, object] = {}

    def fn(self, module: str, name: str):
        key = f"{module}:{name}"
        if key not in self._functions:
            if module not in self._modules:
                self._modules[module] = self._loader(module)
            self._functions[key] = self._modules[module].get_function(name)
        return self._functions[key]

    def warm(self) -> None:
        """Compile every module now (NVRTC, cached on disk by CuPy), not in the middle of a step."""
        for name in MODULES:
            if name not in self._modules:
                self._modules[name] = self._loader(name)
            compile_now = getattr(self._modules[name], "compile", None)  # RawModule compiles lazily
            if compile_now is not None:
                compile_now()

    # ---------------------------------------------------------------- per-token ops

    def build_meta(self, cu_q, seq_lens, block_tables, meta: TokenMeta, block_size: int, q_tile: int,
                   capacity: int) -> None:
        # block_tables: [>= num_reqs, max_blocks_per_seq]
        self.fn("ops", "build_meta")((1,), (256,), (
            cu_q, seq_lens, block_tables, i32(block_tables.shape[1]), i32(block_size), i32(q_tile),
            i32(capacity), meta.sizes, meta.cu_tiles, meta.req_of_token, meta.positions,
            meta.slot_mapping, meta.tile_req, meta.tile_tok0, meta.tile_ntok))

    def embed(self, table, token_ids, sizes, x, rows: int) -> None:
        # table: [vocab, hidden]; x: [>= rows, hidden] float32
        self.fn("ops", f"embed_rows_{self.sfx}")((rows,), (NORM_THREADS,), (
            table, token_ids, sizes, x, i32(x.shape[1])))

    def rms_norm(self, x, weight, eps: float, out, rows: int, delta=None) -> None:
        """out[:rows] = rms_norm(x (+= delta)) * weight."""
        hidden = i32(x.shape[1])
        if delta is None:
            self.fn("ops", f"rms_norm_{self.sfx}")((rows,), (NORM_THREADS,), (x, weight, f32(eps), out, hidden))
        else:
            self.fn("ops", f"add_rms_norm_{self.sfx}")((rows,), (NORM_THREADS,), (
                x, delta, weight, f32(eps), out, hidden))

    def final_norm(self, x, delta, logits_indices, weight, eps: float, out, rows: int) -> None:
        """out[i] = rms_norm(x[j] + delta[j]) * weight, j = logits_indices[i], for i < rows."""
        self.fn("ops", f"final_norm_{self.sfx}")((rows,), (NORM_THREADS,), (
            x, delta, logits_indices, weight, f32(eps), out, i32(x.shape[1])))

    def swiglu(self, gate_up, out, rows: int) -> None:
        inter = out.shape[1]
        self.fn("ops", f"swiglu_{self.sfx}")((rows, -(-inter // NORM_THREADS)), (NORM_THREADS,), (
            gate_up, out, i32(inter)))

    def rope_write_kv(self, qkv, positions, slot_mapping, cos, sin, k_cache, v_cache, cfg, rows: int) -> None:
        """RoPE on q and k, then k and v into the layer's cache (of self.kv_dtype); cfg: engine ModelConfig."""
        self.fn("ops", f"rope_write_kv_{ACT_SUFFIX[self.kv_dtype]}")((rows,), (NORM_THREADS,), (
            qkv, positions, slot_mapping, cos, sin, k_cache, v_cache, i32(cfg.num_heads),
            i32(cfg.num_kv_heads), i32(cfg.head_dim), i32(cfg.rope_dim)))

    # ---------------------------------------------------------------- attention

    def attention(self, qkv, k_cache, v_cache, block_tables, meta: TokenMeta, cfg, block_size: int,
                  partition_size: int, max_splits: int, num_splits: int, out, part_acc, part_ml,
                  capacity: int) -> None:
        """Append attention for up to `capacity` tokens; `num_splits` <= max_splits partitions launched.

        part_acc: [max_tokens, num_heads, max_splits, head_dim]; part_ml: [..., 2] (float32).
        """
        hd = cfg.head_dim
        args_common = (i32(cfg.num_heads), i32(partition_size), i32(max_splits))
        self.fn("attention", f"append_attention_hd{hd}_{self.sfx}")(
            (capacity, cfg.num_kv_heads, num_splits), (128,), (
                qkv, k_cache, v_cache, block_tables, meta.positions, meta.sizes, meta.tile_req,
                meta.tile_tok0, meta.tile_ntok, i32(block_tables.shape[1]), i32(cfg.num_heads),
                i32(cfg.num_kv_heads), i32(block_size), i32(partition_size), i32(max_splits),
                f32(1.0 / np.sqrt(hd)), out, part_acc, part_ml))
        if num_splits > 1:
            self.fn("attention", f"attention_merge_hd{hd}_{self.sfx}")(
                (capacity, cfg.num_heads), (hd,), (meta.positions, meta.sizes, part_acc, part_ml, *args_common, out))

    # ---------------------------------------------------------------- weight product, verification

    def linear_rows(self, x, w, out, rows: int) -> None:
        """Batch-invariant out[:rows] = x[:rows] @ w.T (float32 out); K must be a multiple of 16 bytes."""
        n, k = w.shape
        self.fn("linear", f"linear_rows_{self.sfx}")(
            (-(-n // LIN_WARPS), -(-rows // LIN_ROWS)), (LIN_WARPS * 32,), (x, w, out, i32(rows), i32(n), i32(k)))

    def verify(self, logits, cu_rows, draft_ids, draft_probs, has_draft_probs, temperature, top_p, top_k,
               strategy, policy: int, uniforms, max_candidate_len: int, verify_top_p: float,
               out_token_ids, out_num_accepted, num_reqs: int) -> None:
        """One launch, one block per request; argument semantics of engine.spec_decode.verify.verify."""
        self.fn("verify", "verify_drafts")((num_reqs,), (self.verify_threads,), (
            logits, i32(logits.shape[1]), cu_rows, draft_ids, draft_probs, has_draft_probs, temperature,
            top_p, top_k, strategy, i32(policy), uniforms, i32(max_candidate_len), np.float64(verify_top_p),
            out_token_ids, out_num_accepted))
