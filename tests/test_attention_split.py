"""Decode attention in three phases (attention_split): for a decode batch, the same bits as the vector
kernel's tiles give, for every cache type, group size (padded tiles of 2, 4 and 8 rows included),
head_dim split, sliding window and context length, however many runs the values phase is cut into;
and the same bits for a request alone or batched."""

import numba
import numpy as np
import pytest

import test_attention as TA
from engine.kernels import attention as A
from engine.kernels.attention_split import decode_attention


@pytest.mark.parametrize("cache", list(TA.CACHES))
@pytest.mark.parametrize("head_dim,heads", [(64, (9, 3)), (64, (6, 2)), (128, (7, 1)), (96, (4, 4)), (32, (10, 2))])
@pytest.mark.parametrize("window", [0, 37])
def test_split_decode_gives_the_tiles_bits(cache, head_dim, heads, window, monkeypatch):
    monkeypatch.setattr(TA, "NUM_HEADS", heads[0])
    monkeypatch.setattr(TA, "NUM_KV", heads[1])
    # decode requests: contexts of one chunk, an odd number of chunks, a long one; one request alone too
    for runs in ([(1100, 1), (5, 1), (47, 1), (2000, 1)], [(1300, 1)]):
        case = TA.make_case(head_dim, 16, runs, seed=head_dim + heads[0])
        case, twin = TA.CACHES[cache](case)
        tiles = TA.run(A._ATTENTION_VEC[1], case, 1 / np.sqrt(head_dim), window)
        for threads in (numba.get_num_threads(), 1, 5):  # runs of the values phase (more than threads too)
            split = TA.run(lambda *a: decode_attention(*a[:-1], threads), case, 1 / np.sqrt(head_dim), window)  # noqa: B023
            np.testing.assert_array_equal(split, tiles)
        if runs[0][0] == 1100:  # also close to the float64 reference
            want = TA.reference(*twin, 1 / np.sqrt(head_dim), window)
            np.testing.assert_allclose(split, want, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("runs, split", [([(1500, 1), (20, 1)], True), ([(300, 1)] * 4, True), ([(300, 1)], False),
                                         ([(300, 1), (200, 1)], False), ([(1500, 2)], False)])
def test_paged_attention_splits_long_or_wide_decode_batches_only(runs, split, monkeypatch):
    """The Python entry point runs a decode batch whose requests x keys of the longest reach SPLIT_MIN_KEYS
    (one long request, or several shorter ones) through the split phases (a short or narrow one, or a run of
    several tokens, through the tiles), and gets the tiles' bits either way."""
    case = TA.make_case(64, 16, runs, seed=3)
    calls = []
    monkeypatch.setattr(A, "decode_attention", lambda *a: calls.append(1) or decode_attention(*a))
    out = np.empty((case[0].shape[0], TA.NUM_HEADS * 64), np.float32)
    A.paged_attention(*case, TA.NUM_HEADS, 0.125, out)
    assert calls == ([1] if split else [])
    np.testing.assert_array_equal(out, TA.run(A._ATTENTION_VEC[1], case, 0.125))
