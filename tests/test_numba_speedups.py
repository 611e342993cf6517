"""engine.numba_speedups: the faster copy propagation finds what Numba's own finds, so kernels built with it
are the same machine code; and it is what an engine process uses."""

from __future__ import annotations

import re

import numba as nb
import numpy as np
import pytest
from numba.core import ir_utils
from numba.parfors import parfor

import engine  # noqa: F401  (installs the speedups)
from engine import numba_speedups
from engine.kernels import int_linear

NUMBAS = getattr(ir_utils, "copy_propagate_numba", None)
pytestmark = pytest.mark.skipif(NUMBAS is None, reason="this Numba's copy_propagate is not the one replaced")


def _branchy(x, out):
    """A parallel loop with branches and copies in its body (many blocks for the data flow)."""
    for i in nb.prange(x.shape[0]):
        acc = 0.0
        best = x[i, 0]
        for j in range(x.shape[1]):
            v = x[i, j]
            if v > best:
                best = v
            elif v < -best:
                v = -v
            w = v
            acc += w if j % 3 else 2 * w
        out[i] = acc + best


def _use(monkeypatch, implementation) -> None:
    monkeypatch.setattr(ir_utils, "copy_propagate", implementation)
    monkeypatch.setattr(parfor, "copy_propagate", implementation)


def _asm(py_func, *args) -> str:
    """A fresh (uncached) parallel build's assembly, the names that differ per build made equal (the
    dispatcher's version in each mangled name, the address in the parallel loop's, and so the length of
    the strings that hold such a name)."""
    kernel = nb.njit(parallel=True)(py_func)
    kernel(*args)
    asm = re.sub(r"B\d+v\d+B|0x[0-9a-f]+", "_", kernel.inspect_asm(kernel.signatures[0]))
    return re.sub(r'(\.size\t".*"), \d+', r"\1, _", asm)


def _quantize_args():
    x = np.random.default_rng(0).standard_normal((5, 256)).astype(np.float32)
    return (x, np.zeros((5, 256), np.int8), np.zeros((5, 8), np.float32), np.zeros((5, 8), np.float32),
            np.zeros((5, 16), np.int32))


def test_it_returns_what_numbas_returns_on_every_call_of_a_build(monkeypatch):
    calls = []

    def both(blocks, typemap):
        theirs = NUMBAS(blocks, typemap)
        ours = numba_speedups.copy_propagate(blocks, typemap)
        calls.append(len(blocks))
        assert ours == theirs
        return theirs

    _use(monkeypatch, both)
    _asm(_branchy, np.random.default_rng(1).standard_normal((7, 9)), np.zeros(7))
    _asm(int_linear._quantize_rows, *_quantize_args())  # the integer kernels' activation quantizer
    assert len(calls) >= 4 and max(calls) > 5  # it ran, on bodies of several blocks


@pytest.mark.parametrize("case", ["branchy", "quantize_rows"])
def test_kernels_built_with_it_are_the_same_machine_code(monkeypatch, case):
    py_func, args = {"branchy": (_branchy, (np.ones((3, 4)), np.zeros(3))),
                     "quantize_rows": (int_linear._quantize_rows, _quantize_args())}[case]
    _use(monkeypatch, NUMBAS)
    theirs = _asm(py_func, *args)
    _use(monkeypatch, numba_speedups.copy_propagate)
    assert _asm(py_func, *args) == theirs


def test_an_engine_process_builds_with_it():
    assert ir_utils.copy_propagate is numba_speedups.copy_propagate
    assert parfor.copy_propagate is numba_speedups.copy_propagate  # parfor imported the name at its own import
