"""Paged append attention: the general kernel and the vector kernel (block_size, head_dim multiples of
16; float32, fp16 or int8 cache) match a float64 softmax-attention reference, and a query's output from the
vector kernel is the same bits alone, inside a ragged batch, or among its run's other tokens. The int8
cache's writer stores what a NumPy q8_0 quantizer gives."""

import numba
import numpy as np
import pytest

import engine  # noqa: F401  (sets NUMBA_SLP_VECTORIZE before numba compiles anything)
from engine.kernels import attention as A

NUM_HEADS, NUM_KV = 6, 2


def make_case(head_dim: int, block_size: int, runs: list[tuple[int, int]], seed: int = 0):
    """Requests given as (cached tokens, appended tokens); blocks shuffled in a shared cache."""
    rng = np.random.default_rng(seed)
    tables = [-(-(c + t) // block_size) for c, t in runs]
    num_blocks = sum(tables) + 1
    k_cache = rng.standard_normal((NUM_KV, num_blocks, head_dim, block_size)).astype(np.float32)
    v_cache = rng.standard_normal((NUM_KV, num_blocks, block_size, head_dim)).astype(np.float32)
    order = rng.permutation(num_blocks).astype(np.int32)
    block_tables = np.zeros((len(runs), max(tables)), np.int32)
    start = 0
    for r, n in enumerate(tables):
        block_tables[r, :n] = order[start:start + n]
        start += n
    cu_q = np.concatenate([[0], np.cumsum([t for _, t in runs])]).astype(np.int32)
    positions = np.concatenate([c + np.arange(t) for c, t in runs]).astype(np.int32)
    qkv = rng.standard_normal((cu_q[-1], (NUM_HEADS + 2 * NUM_KV) * head_dim)).astype(np.float32)
    return qkv, k_cache, v_cache, cu_q, positions, block_tables


def reference(qkv, k_cache, v_cache, cu_q, positions, block_tables, scale, window=0, softcap=0.0):
    """float64 attention of each query over keys 0..position of its own request (the last `window` of them);
    softcap > 0: scores soft-capped as cap * tanh(score / cap) (Gemma 2)."""
    head_dim = k_cache.shape[2]
    out = np.zeros((qkv.shape[0], NUM_HEADS * head_dim))
    for r in range(len(cu_q) - 1):
        keys = np.concatenate([k_cache[:, b].transpose(2, 0, 1) for b in block_tables[r]]).astype(np.float64)  # [T, kv, hd]
        vals = np.concatenate([v_cache[:, b].transpose(1, 0, 2) for b in block_tables[r]]).astype(np.float64)
        for t in range(cu_q[r], cu_q[r + 1]):
            n = positions[t] + 1
            lo = max(0, n - window) if window else 0
            for h in range(NUM_HEADS):
                kvh = h // (NUM_HEADS // NUM_KV)
                s = keys[lo:n, kvh] @ qkv[t, h * head_dim:(h + 1) * head_dim].astype(np.float64) * scale
                if softcap:
                    s = softcap * np.tanh(s / softcap)
                p = np.exp(s - s.max())
                out[t, h * head_dim:(h + 1) * head_dim] = p @ vals[lo:n, kvh] / p.sum()
    return out


def run(kernel, case, scale, window=0):
    head_dim = (case[1][0] if isinstance(case[1], tuple) else case[1]).shape[2]
    out = np.full((case[0].shape[0], NUM_HEADS * head_dim), np.nan, np.float32)
    kernel(*case, NUM_HEADS, np.float32(scale), window, out, numba.get_num_threads())
    return out


def as_fp16(case):
    """The same case with K/V in an fp16 cache (uint16 bits), and its float32 twin for the reference."""
    qkv, k, v, *rest = case
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    return (qkv, k16.view(np.uint16), v16.view(np.uint16), *rest), (qkv, k16.astype(np.float32), v16.astype(np.float32), *rest)


def q8_0(x: np.ndarray, axis: int):
    """NumPy q8_0 along `axis` (blocks of 32): (int8 values, float32 scales with that axis / 32), as
    llama.cpp quantizes: scale = max|x| / 127, values round(x / scale) half to even."""
    x = np.moveaxis(x, axis, -1)
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    scale = (np.abs(blocks).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.divide(np.float32(1), scale, out=np.zeros_like(scale), where=scale > 0)
    q = np.rint(blocks * inv[..., None]).astype(np.int8).reshape(x.shape)
    return np.moveaxis(q, -1, axis), np.moveaxis(scale, -1, axis)


def as_int8(case):
    """The same case with K/V in an int8 cache ((values, scales) pairs), and its float32 twin for the reference."""
    qkv, k, v, *rest = case
    (kq, ks), (vq, vs) = q8_0(k, 2), q8_0(v, 3)
    twin_k = kq.astype(np.float32) * np.repeat(ks, 32, axis=2)
    twin_v = vq.astype(np.float32) * np.repeat(vs, 32, axis=3)
    return (qkv, (kq, ks), (vq, vs), *rest), (qkv, twin_k, twin_v, *rest)


CACHES = {"float32": lambda case: (case, case), "float16": as_fp16, "int8": as_int8}


@pytest.mark.parametrize("window", [0, 5, 13])
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (40, 4), (64, 24)])
def test_general_kernel_matches_a_float64_reference(head_dim, block_size, window):
    case = make_case(head_dim, block_size, [(21, 1), (3, 5), (0, 7), (30, 9)], seed=1)
    scale = 1 / np.sqrt(head_dim)
    for kernel in A._ATTENTION:
        np.testing.assert_allclose(run(kernel, case, scale, window), reference(*case, scale, window), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("head_dim,block_size,heads", [(64, 16, (6, 2)), (32, 32, (4, 1)), (128, 16, (7, 1)), (256, 16, (4, 1))])
def test_vector_kernel_matches_a_float64_reference(head_dim, block_size, heads, cache, monkeypatch):
    monkeypatch.setattr(__import__(__name__), "NUM_HEADS", heads[0])
    monkeypatch.setattr(__import__(__name__), "NUM_KV", heads[1])
    case = make_case(head_dim, block_size, [(37, 1), (5, 4), (0, 9), (80, 3), (16, 16)])
    case, twin = CACHES[cache](case)
    scale = 1 / np.sqrt(head_dim)
    for window in (0, 7, 33):  # a sliding window: unaligned, and longer than a 16-key chunk
        want = reference(*twin, scale, window)
        for kernel in A._ATTENTION_VEC:
            np.testing.assert_allclose(run(kernel, case, scale, window), want, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("head_dim,block_size,cache", [(64, 16, c) for c in CACHES] + [(40, 4, "float32")])
def test_soft_capped_scores_match_a_float64_reference(head_dim, block_size, cache):
    """A soft cap (Gemma 2) through the Python entry point: the vector tiles, the split decode path (a request
    past SPLIT_MIN_KEYS in a decode batch) and the general kernel (head_dim 40, float32 cache only), with and
    without a window."""
    for runs in ([(37, 1), (5, 4), (0, 9), (80, 3)], [(1100, 1), (47, 1)]):
        case, twin = CACHES[cache](make_case(head_dim, block_size, runs, seed=4))
        for window in (0, 13):
            out = np.empty((case[0].shape[0], NUM_HEADS * head_dim), np.float32)
            A.paged_attention(*case, NUM_HEADS, 1 / np.sqrt(head_dim), out, window, softcap=0.7)
            want = reference(*twin, 1 / np.sqrt(head_dim), window, softcap=0.7)
            np.testing.assert_allclose(out, want, rtol=1e-4, atol=2e-5)
            assert np.abs(want - reference(*twin, 1 / np.sqrt(head_dim), window)).max() > 1e-2  # the cap binds


def one_query(case, t):
    """Token t's query as a request of its own (its own block table and position)."""
    qkv, k, v, cu_q, positions, tables = case
    r = int(np.searchsorted(cu_q, t, side="right") - 1)
    return (qkv[t : t + 1], k, v, np.array([0, 1], np.int32), positions[t : t + 1], tables[r : r + 1])


@pytest.mark.parametrize("window", [0, 6, 19])
@pytest.mark.parametrize("cache", list(CACHES))
def test_vector_kernel_query_is_the_same_bits_alone_or_batched(cache, window):
    """Each query run alone (one token, one request) equals the same query inside a ragged batch,
    where runs of 2-9 tokens share K/V loads in tiles of consecutive tokens or of a group's heads;
    with a sliding window too, where a tile's rows start at different keys."""
    case = make_case(64, 16, [(37, 1), (5, 4), (0, 9), (80, 3), (16, 2), (3, 7), (40, 8)], seed=2)
    case = CACHES[cache](case)[0]
    for kernel in A._ATTENTION_VEC:
        batched = run(kernel, case, 0.125, window)
        alone = np.concatenate([run(kernel, one_query(case, t), 0.125, window) for t in range(case[0].shape[0])])
        np.testing.assert_array_equal(batched, alone)


def test_a_verify_of_nine_tokens_is_the_same_bits_as_its_queries_alone():
    """A chunk of 8 tokens and one of 1 (AVX-512; 4 + 4 + 1 elsewhere): equal ranges of the items would
    leave one thread nearly all the work, so the kernel hands them out as balanced runs; each query still
    gets the bits it gets alone."""
    case = as_fp16(make_case(64, 16, [(300, 9)], seed=4))[0]
    for kernel in A._ATTENTION_VEC:
        alone = np.concatenate([run(kernel, one_query(case, t), 0.125) for t in range(9)])
        np.testing.assert_array_equal(run(kernel, case, 0.125), alone)



@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("cache", list(CACHES))
def test_a_lone_verify_split_by_its_tokens_gives_each_query_its_own_bits(cache, window):
    """One request's verify of BY_TOKENS_MIN .. TOKENS_PER_ITEM tokens (one chunk) on groups of 3 query heads: each
    KV head's two items take halves of the tokens (every head) instead of halves of the heads. Each query
    gets the bits it gets alone, and the float64 reference's values."""
    from engine.kernels.attention_items import BY_TOKENS_MIN
    from engine.kernels.attention_vec import TOKENS_PER_ITEM

    for num_tokens in sorted({BY_TOKENS_MIN, BY_TOKENS_MIN + 1, TOKENS_PER_ITEM}):
        case, twin = CACHES[cache](make_case(64, 16, [(300, num_tokens)], seed=num_tokens))
        want = reference(*twin, 0.125, window)
        for kernel in A._ATTENTION_VEC:
            alone = np.concatenate([run(kernel, one_query(case, t), 0.125, window) for t in range(num_tokens)])
            got = run(kernel, case, 0.125, window)
            np.testing.assert_array_equal(got, alone)
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5)

def test_balanced_runs_hold_every_item_once_and_even_out_the_threads():
    from engine.kernels.attention_items import _equal_ranges_top, _runs

    costs = np.array([16, 8, 16, 8, 16, 8, 2, 1, 2, 1, 2, 1], np.int64)  # a verify of 9: chunks of 8 and 1
    order, starts = _runs(costs, 2)
    assert sorted(order.tolist()) == list(range(len(costs))) and starts[0] == 0 and starts[-1] == len(costs)
    loads = [int(costs[order[starts[t] : starts[t + 1]]].sum()) for t in range(2)]
    assert max(loads) <= costs.sum() // 2 + costs.max()  # within one item of an even share
    assert _equal_ranges_top(costs, 2) == 72 > max(loads)  # what prange's equal ranges would give


@pytest.mark.parametrize("block_size", [16, 32, 48])
def test_chunk_cursor_walks_the_blocks_as_division_does(block_size):
    from engine.kernels.kv_prefetch import chunk_cursor, next_chunk

    @numba.njit
    def walk(c0, n, bs):
        out = np.empty((n, 2), np.int64)
        i, o = chunk_cursor(c0, bs)
        for j in range(n):
            out[j, 0], out[j, 1] = i, o
            i, o = next_chunk(i, o, bs)
        return out

    for c0 in (0, 1, 5):
        chunks = c0 + np.arange(40)
        expected = np.stack([16 * chunks // block_size, 16 * chunks % block_size], 1)  # [chunks, (table index, offset)]
        np.testing.assert_array_equal(walk(c0, 40, block_size), expected)


def test_fp16_cache_needs_vector_shapes():
    case, _ = as_fp16(make_case(40, 4, [(3, 2)]))
    with pytest.raises(ValueError, match="multiples of 16"):
        A.paged_attention(*case, NUM_HEADS, 0.125, np.empty((2, NUM_HEADS * 40), np.float32))


@pytest.mark.parametrize("serial", [True, False])
def test_int8_cache_writer_stores_numpy_q8_0(serial):
    """Every new K/V row lands in its slot as NumPy's q8_0 of it (values and scales, bit for bit); other slots stay zero."""
    rng = np.random.default_rng(5)
    num_blocks, head_dim, block_size, num_tokens = 6, 64, 16, 70
    qkv = (rng.standard_normal((num_tokens, (NUM_HEADS + 2 * NUM_KV) * head_dim)) * 3).astype(np.float32)
    qkv[3, NUM_HEADS * head_dim : (NUM_HEADS + 1) * head_dim] = 0.0  # an all-zero block: scale 0, values 0
    slots = rng.permutation(num_blocks * block_size)[:num_tokens].astype(np.int32)
    k = (np.zeros((NUM_KV, num_blocks, head_dim, block_size), np.int8), np.zeros((NUM_KV, num_blocks, 2, block_size), np.float32))
    v = (np.zeros((NUM_KV, num_blocks, block_size, head_dim), np.int8), np.zeros((NUM_KV, num_blocks, block_size, 2), np.float32))
    A._WRITE_KV_Q8[0 if serial else 1](qkv, k, v, slots, NUM_HEADS * head_dim, NUM_KV * head_dim)
    q = NUM_HEADS * head_dim
    rows_k = qkv[:, q : q + NUM_KV * head_dim].reshape(num_tokens, NUM_KV, head_dim)
    rows_v = qkv[:, q + NUM_KV * head_dim :].reshape(num_tokens, NUM_KV, head_dim)
    (kq, ks), (vq, vs) = q8_0(rows_k, 2), q8_0(rows_v, 2)
    b, o = slots // block_size, slots % block_size
    np.testing.assert_array_equal(k[0][:, b, :, o], kq)  # [tokens, kv, hd]
    np.testing.assert_array_equal(k[1][:, b, :, o], ks)
    np.testing.assert_array_equal(v[0][:, b, o].transpose(1, 0, 2), vq)
    np.testing.assert_array_equal(v[1][:, b, o].transpose(1, 0, 2), vs)
    untouched = np.ones((num_blocks, block_size), bool)
    untouched[b, o] = False
    assert not k[0].transpose(1, 3, 0, 2)[untouched].any() and not v[0].transpose(1, 2, 0, 3)[untouched].any()


def test_kv_cache_dtype_is_checked_by_name(model_path):
    """The runner's KV element types: int8 is 1 byte + a float32 scale per 32 values; bad names and
    shapes the int8 kernels cannot serve are ValueErrors naming the field."""
    from conftest import _smollm_config
    from engine.model.cpu_runner import CpuRunner, kv_dtype_name

    cfg = _smollm_config(model_path)
    assert kv_dtype_name("int8", "exact", cfg, 16) == "int8"
    sizes = {d: CpuRunner.kv_bytes_per_block(cfg, 16, "int8", d) for d in ("float32", "float16", "int8")}
    assert sizes["float32"] == 2 * sizes["float16"] == 2 * 4 * cfg.num_layers * 16 * cfg.kv_size
    assert sizes["int8"] == cfg.num_layers * 2 * 16 * cfg.kv_size * 9 // 8
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        kv_dtype_name("q4_0", "int8", cfg, 16)
    with pytest.raises(ValueError, match="kv_cache_dtype int8 needs head_dim"):
        kv_dtype_name("int8", "int8", cfg, 8)
