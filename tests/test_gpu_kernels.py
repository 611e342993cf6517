"""Each CUDA kernel against the CPU reference, on fresh random ragged inputs.

Two backends run the same tests: "cuda" (CuPy on a device; marker `gpu`, skipped without one)
and "emu" (the same .cu sources compiled by g++, each CUDA thread a CPU fiber: engine.gpu.emulator),
so the kernels' arithmetic, synchronisation and launch arguments are checked in CPU CI too.
Outputs are poisoned with NaN before each launch, so an element the kernel forgot stays NaN.
Relative error ||out - ref|| / ||ref|| bounds: 1e-5 float32, 1e-3 float16, 1e-2 bfloat16.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.gpu.kernels import TokenMeta, attention_q_tile
from engine.gpu.testing import BACKEND_PARAMS, Backend, rel_err
from engine.gpu.weights import from_storage, to_storage
from engine.kernels import ops
from engine.kernels.attention import paged_attention, write_kv

TOL = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 1e-2}
DTYPES = list(TOL)


@pytest.fixture(scope="module", params=BACKEND_PARAMS)
def backend(request) -> Backend:
    return Backend(request.param)


# ------------------------------------------------------------------------------------ ragged batches


class Ragged:
    """A random ragged batch: request r has cached[r] tokens and appends new[r] more."""

    def __init__(self, rng, cached, new, block_size=16, num_blocks=None, max_blocks_per_seq=80):
        self.cached, self.new = np.array(cached, np.int32), np.array(new, np.int32)
        self.num_reqs, self.num_tokens = len(new), int(sum(new))
        self.block_size = block_size
        self.seq_lens = self.cached + self.new
        self.cu_q = np.concatenate([[0], np.cumsum(self.new)]).astype(np.int32)
        needed = sum(-(-int(s) // block_size) for s in self.seq_lens)
        self.num_blocks = num_blocks or needed + 3
        perm = rng.permutation(self.num_blocks).astype(np.int32)  # scattered physical blocks
        self.block_tables = np.zeros((self.num_reqs, max_blocks_per_seq), np.int32)
        used = 0
        for r, s in enumerate(self.seq_lens):
            nb = -(-int(s) // block_size)
            self.block_tables[r, :nb] = perm[used : used + nb]
            used += nb

    def cpu_meta(self):
        req = np.zeros(self.num_tokens, np.int32)
        pos, slot = np.zeros_like(req), np.zeros_like(req)
        ops.fill_token_meta(self.cu_q, self.seq_lens, self.block_tables, self.block_size, req, pos, slot)
        return req, pos, slot

    def device_meta(self, be: Backend, q_tile: int, capacity: int) -> TokenMeta:
        cap = max(capacity, self.num_tokens)
        sizes = np.array([self.num_reqs, self.num_tokens, 0, 0], np.int32)
        meta = TokenMeta(be.dev(sizes), *(be.dev(np.full(n, -7, np.int32)) for n in [self.num_reqs + 1] + [cap] * 6))
        be.kernels("float32").build_meta(be.dev(self.cu_q), be.dev(self.seq_lens), be.dev(self.block_tables),
                                         meta, self.block_size, q_tile, cap)
        return meta


CASES = {
    "decode": ([5, 40, 17], [1, 1, 1]),
    "verify": ([3, 70, 0, 33], [4, 6, 1, 5]),
    "mixed_long": ([0, 300, 561, 12], [9, 1, 4, 2]),  # contexts past 256: the split-KV path
}


# ------------------------------------------------------------------------------------ metadata


@pytest.mark.parametrize("case", list(CASES))
def test_build_meta_matches_cpu_and_tiles_cover_every_token(backend, case):
    rng = np.random.default_rng(1)
    rb = Ragged(rng, *CASES[case])
    q_tile, cap = 3, rb.num_tokens + 5  # 5 padding rows
    meta = rb.device_meta(backend, q_tile, cap)
    req, pos, slot = rb.cpu_meta()
    n = rb.num_tokens
    assert np.array_equal(backend.host(meta.req_of_token)[:n], req)
    assert np.array_equal(backend.host(meta.positions)[:n], pos)
    assert np.array_equal(backend.host(meta.slot_mapping)[:n], slot)
    assert (backend.host(meta.positions)[n:cap] == -1).all() and (backend.host(meta.slot_mapping)[n:cap] == -1).all()
    num_tiles = int(backend.host(meta.sizes)[2])
    t_req, t0, tn = (backend.host(a)[:num_tiles] for a in (meta.tile_req, meta.tile_tok0, meta.tile_ntok))
    covered = np.concatenate([np.arange(a, a + b) for a, b in zip(t0, tn)])
    assert np.array_equal(covered, np.arange(n)) and (tn >= 1).all() and (tn <= q_tile).all()
    assert np.array_equal(req[t0], t_req) and np.array_equal(req[t0 + tn - 1], t_req)


# ------------------------------------------------------------------------------------ row ops


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_match_cpu(backend, dtype):
    rng = np.random.default_rng(2)
    k, rows, hidden = backend.kernels(dtype), 5, 320
    x = rng.standard_normal((rows, hidden)).astype(np.float32)
    delta = rng.standard_normal((rows, hidden)).astype(np.float32)
    w = rng.standard_normal(hidden).astype(np.float32)
    ref, ref_x, d_w = np.empty_like(x), x.copy(), backend.dev(w)
    ops.rms_norm(x, w, 1e-5, ref)
    out = backend.poisoned((rows, hidden), dtype)
    k.rms_norm(backend.dev(x), d_w, 1e-5, out, rows)
    assert rel_err(from_storage(backend.host(out), dtype), ref) < TOL[dtype]

    ops.add_rms_norm(ref_x, delta, w, 1e-5, ref)
    d_x, out = backend.dev(x), backend.poisoned((rows, hidden), dtype)
    k.rms_norm(d_x, d_w, 1e-5, out, rows, delta=backend.dev(delta))
    assert rel_err(from_storage(backend.host(out), dtype), ref) < TOL[dtype]
    assert rel_err(backend.host(d_x), ref_x) < 1e-6  # the residual stream itself is float32

    idx = np.array([4, 0, 2], np.int32)  # final norm of the logits rows, gathered
    out = backend.poisoned((3, hidden), dtype)
    k.final_norm(backend.dev(x), backend.dev(delta), backend.dev(idx), d_w, 1e-5, out, 3)
    ref_rows = np.empty((3, hidden), np.float32)
    ops.rms_norm((x + delta)[idx], w, 1e-5, ref_rows)
    assert rel_err(from_storage(backend.host(out), dtype), ref_rows) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_embed_and_swiglu_match_cpu(backend, dtype):
    rng = np.random.default_rng(3)
    k = backend.kernels(dtype)
    table = to_storage(rng.standard_normal((50, 96)).astype(np.float32), dtype)
    ids = np.array([7, 0, 49, 7, 3], np.int32)
    sizes = np.array([1, 4, 0, 0], np.int32)  # 4 live tokens: row 4 is padding and embeds token 0
    x = backend.poisoned((5, 96))
    k.embed(backend.dev(table), backend.dev(ids), backend.dev(sizes), x, 5)
    ref = from_storage(table, dtype)[[7, 0, 49, 7, 0]]
    assert np.array_equal(backend.host(x), ref)

    gate_up = rng.standard_normal((6, 2 * 300)).astype(np.float32) * 3
    ref = np.empty((6, 300), np.float32)
    ops.swiglu(gate_up, ref)
    out = backend.poisoned((6, 300), dtype)
    k.swiglu(backend.dev(gate_up), out, 6)
    assert rel_err(from_storage(backend.host(out), dtype), ref) < TOL[dtype]


class Geometry:
    """The ModelConfig fields the attention and RoPE launchers read."""

    def __init__(self, head_dim=64, num_heads=6, num_kv_heads=2, rope_dim=None):
        self.head_dim, self.num_heads, self.num_kv_heads = head_dim, num_heads, num_kv_heads
        self.rope_dim = rope_dim or head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim


@pytest.mark.parametrize("dtype", ["float32", "float16"])  # KV cache: float32, resp. fp16
def test_rope_write_kv_matches_cpu(backend, dtype):
    rng = np.random.default_rng(4)
    g = Geometry(rope_dim=48)  # partial rotary: the last 16 dims of each head pass through
    rb = Ragged(rng, [3, 20], [2, 3])
    req, pos, slot = rb.cpu_meta()
    qkv = rng.standard_normal((rb.num_tokens, g.q_size + 2 * g.kv_size)).astype(np.float32)
    cos, sin = ops.rope_tables(64, g.rope_dim, 10000.0, 1.0)
    cache_shape = (rb.num_blocks, rb.block_size, g.num_kv_heads, g.head_dim)
    # The CPU cache is KV-head major and keeps K transposed inside a block ([kv, blocks, hd, bs], V
    # [kv, blocks, bs, hd]); the GPU's is [blocks, bs, kv, hd] for both.
    k_cpu = np.zeros((g.num_kv_heads, rb.num_blocks, g.head_dim, rb.block_size), np.float32)
    v_cpu = np.zeros((g.num_kv_heads, rb.num_blocks, rb.block_size, g.head_dim), np.float32)
    ref_qkv = qkv.copy()
    ops.rope_adjacent(ref_qkv, pos, cos, sin, g.num_heads + g.num_kv_heads, g.head_dim, g.rope_dim)
    write_kv(ref_qkv, k_cpu, v_cpu, slot, g.q_size, g.kv_size)
    ref_k = np.ascontiguousarray(k_cpu.transpose(1, 3, 0, 2))
    ref_v = np.ascontiguousarray(v_cpu.transpose(1, 2, 0, 3))
    kern = backend.kernels(dtype)
    d_qkv, kv_type = backend.dev(qkv), np.dtype(kern.kv_dtype)
    d_k, d_v = backend.dev(np.zeros(cache_shape, kv_type)), backend.dev(np.zeros(cache_shape, kv_type))
    kern.rope_write_kv(d_qkv, backend.dev(pos), backend.dev(slot), backend.dev(cos), backend.dev(sin), d_k, d_v, g,
                       rb.num_tokens)
    assert rel_err(backend.host(d_qkv)[:, : g.q_size], ref_qkv[:, : g.q_size]) < 1e-6
    assert rel_err(backend.host(d_k).astype(np.float32), ref_k) < (1e-6 if dtype == "float32" else 1e-3)
    assert np.array_equal(backend.host(d_v), ref_v.astype(kv_type))


# ------------------------------------------------------------------------------------ attention


def run_attention(be: Backend, rb: Ragged, g: Geometry, qkv, k16, v16, dtype, partition_size=64, num_splits=None):
    """Device append attention over the batch; returns out [num_tokens, q_size] as float32.

    k16/v16 hold fp16 values; the float32 build's cache is float32 (the same values, widened)."""
    kv_type = np.dtype(be.kernels(dtype).kv_dtype)
    q_tile = attention_q_tile(g.num_heads, g.num_kv_heads)
    cap = rb.num_tokens
    meta = rb.device_meta(be, q_tile, cap)
    max_splits = -(-int(rb.seq_lens.max()) // partition_size)
    out = be.poisoned((cap, g.q_size), dtype)
    part_acc = be.poisoned((cap, g.num_heads, max_splits, g.head_dim))
    part_ml = be.poisoned((cap, g.num_heads, max_splits, 2))
    be.kernels(dtype).attention(be.dev(qkv), be.dev(k16.astype(kv_type)), be.dev(v16.astype(kv_type)),
                                be.dev(rb.block_tables), meta, g,
                                rb.block_size, partition_size, max_splits, num_splits or max_splits,
                                out, part_acc, part_ml, cap)
    return from_storage(be.host(out), dtype)


def attention_inputs(rng, rb: Ragged, g: Geometry):
    qkv = rng.standard_normal((rb.num_tokens, g.q_size + 2 * g.kv_size)).astype(np.float32)
    shape = (rb.num_blocks, rb.block_size, g.num_kv_heads, g.head_dim)
    k16 = (rng.standard_normal(shape) * 2).astype(np.float16)  # every slot holds a key: masking must hide the future
    v16 = rng.standard_normal(shape).astype(np.float16)
    return qkv, k16, v16


def cpu_attention(qkv, k16, v16, rb: Ragged, pos, g, out) -> None:
    """The CPU kernel as reference; its caches are KV-head major, K transposed inside each block."""
    k_cpu = np.ascontiguousarray(k16.astype(np.float32).transpose(2, 0, 3, 1))  # [kv, blocks, hd, bs]
    v_cpu = np.ascontiguousarray(v16.astype(np.float32).transpose(2, 0, 1, 3))  # [kv, blocks, bs, hd]
    paged_attention(qkv, k_cpu, v_cpu, rb.cu_q, pos, rb.block_tables,
                    g.num_heads, np.float32(1 / np.sqrt(g.head_dim)), out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_append_attention_matches_cpu(backend, case, dtype):
    rng = np.random.default_rng(5)
    g = Geometry()
    rb = Ragged(rng, *CASES[case])
    qkv, k16, v16 = attention_inputs(rng, rb, g)
    req, pos, _ = rb.cpu_meta()
    ref = np.zeros((rb.num_tokens, g.q_size), np.float32)
    cpu_attention(qkv, k16, v16, rb, pos, g, ref)
    assert rel_err(run_attention(backend, rb, g, qkv, k16, v16, dtype), ref) < TOL[dtype]


def test_append_attention_head_dim_128_gqa_4(backend):
    rng = np.random.default_rng(6)
    g = Geometry(head_dim=128, num_heads=8, num_kv_heads=2)
    rb = Ragged(rng, [0, 130], [6, 3])
    qkv, k16, v16 = attention_inputs(rng, rb, g)
    req, pos, _ = rb.cpu_meta()
    ref = np.zeros((rb.num_tokens, g.q_size), np.float32)
    cpu_attention(qkv, k16, v16, rb, pos, g, ref)
    assert rel_err(run_attention(backend, rb, g, qkv, k16, v16, "float32"), ref) < 1e-5


def test_append_attention_is_batch_invariant(backend):
    """A query's output is bit-identical alone, in a ragged batch, or as one of several appended tokens."""
    rng = np.random.default_rng(7)
    g = Geometry()
    rb = Ragged(rng, [150, 9, 64], [5, 3, 2])
    qkv, k16, v16 = attention_inputs(rng, rb, g)
    batched = run_attention(backend, rb, g, qkv, k16, v16, "float32")
    for r in range(rb.num_reqs):
        for j in range(rb.new[r]):
            t = rb.cu_q[r] + j
            alone = Ragged(rng, [rb.cached[r] + j], [1])
            alone.block_tables[0] = rb.block_tables[r]  # the same cache blocks, as plain decoding sees them
            got = run_attention(backend, alone, g, qkv[t : t + 1], k16, v16, "float32", num_splits=None)
            assert np.array_equal(got[0], batched[t]), f"request {r} token {j}"


# ------------------------------------------------------------------------------------ weight product


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_rows_matches_float64_and_is_batch_invariant(backend, dtype):
    rng = np.random.default_rng(8)
    m, n, k = 11, 37, 200  # partial row and column tiles
    x = to_storage(rng.standard_normal((m, k)).astype(np.float32), dtype)
    w = to_storage(rng.standard_normal((n, k)).astype(np.float32), dtype)
    ref = from_storage(x, dtype).astype(np.float64) @ from_storage(w, dtype).astype(np.float64).T
    kern, d_w = backend.kernels(dtype), backend.dev(w)
    out = backend.poisoned((m, n))
    kern.linear_rows(backend.dev(x), d_w, out, m)
    got = backend.host(out)
    assert rel_err(got, ref) < 1e-5  # exact inputs, float32 accumulation
    for row in (0, 8, 10):
        alone = backend.poisoned((1, n))
        kern.linear_rows(backend.dev(x[row : row + 1]), d_w, alone, 1)
        assert np.array_equal(backend.host(alone)[0], got[row])
