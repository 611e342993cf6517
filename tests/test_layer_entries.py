"""CpuRunner enters its compiled layers through the overloads their dispatchers would pick, keyed by
the kinds of the batch's arrays (engine/model/cpu_runner.py, `_array_kinds`): two arrays share a key
only when numba gives them the same type, so a batch of another layout never runs a wrong overload (a
key may split arrays of one type, e.g. an empty one: that only adds an entry for the same overload)."""

from __future__ import annotations

import itertools

import numba
import numpy as np

from engine.model.cpu_runner import _array_kinds


def variants() -> list[np.ndarray]:
    base = np.arange(24, dtype=np.int32).reshape(4, 6)
    readonly = base.copy()
    readonly.flags.writeable = False
    unaligned = np.frombuffer(np.zeros(4 * 24 + 1, np.uint8).data, np.uint8, count=4 * 24, offset=1).view(np.int32)
    return [base, np.asfortranarray(base), base[:, ::2], base[:2], readonly, base.astype(np.int64),
            base.ravel(), base[0], base.T, unaligned.reshape(4, 6), np.zeros((0, 6), np.int32)]


def test_arrays_of_one_kind_have_one_numba_type():
    arrays = variants()
    assert len({numba.typeof(a) for a in arrays}) >= 6  # C / F / A layouts, read-only, another dtype, rank 1
    for a, b in itertools.product(arrays, repeat=2):
        if _array_kinds(a) == _array_kinds(b):
            assert numba.typeof(a) == numba.typeof(b)
