"""Test helpers shared by the GPU kernel tests: one interface over a CUDA device and the CPU emulator.

`Backend("cuda")` moves NumPy arrays to CuPy and back; `Backend("emu")` keeps them in NumPy and
loads the kernels through engine.gpu.emulator. A test written against Backend checks the same
kernel code either way (as cupy.testing compares NumPy with CuPy).
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.gpu import emulator
from engine.gpu.kernels import Kernels
from engine.gpu.weights import to_storage


def cuda_available() -> bool:
    try:
        import cupy

        return bool(cupy.cuda.is_available())
    except Exception:  # CuPy missing, or no driver / device
        return False


class Backend:
    def __init__(self, name: str):
        if name not in ("cuda", "emu"):
            raise ValueError(f"backend: expected 'cuda' or 'emu', got {name!r}")
        self.name = name
        self._kernels: dict[str, Kernels] = {}
        if name == "cuda":
            import cupy

            self.cp = cupy

    def kernels(self, dtype: str = "float32") -> Kernels:
        if dtype not in self._kernels:
            if self.name == "emu":  # 64-thread verify blocks: same code paths, 8x fewer CPU threads
                self._kernels[dtype] = Kernels(dtype, loader=emulator.EmuModule, verify_threads=64)
            else:
                self._kernels[dtype] = Kernels(dtype)
        return self._kernels[dtype]

    def dev(self, a: np.ndarray):
        return self.cp.asarray(a) if self.name == "cuda" else np.array(a, copy=True, order="C")

    def host(self, a) -> np.ndarray:
        if self.name == "cuda":
            self.cp.cuda.Device().synchronize()
            return self.cp.asnumpy(a)
        return np.array(a, copy=True)

    def poisoned(self, shape, dtype: str = "float32"):
        """A device array of NaN (in the storage type), so unwritten elements show."""
        return self.dev(to_storage(np.full(shape, np.nan, np.float32), dtype))


BACKEND_PARAMS = [
    pytest.param("emu", marks=pytest.mark.skipif(not emulator.available(), reason="needs g++ (C++17)")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="CUDA not available")]),
]


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    """||out - ref|| / ||ref||; fails on NaN first (a poisoned element left unwritten)."""
    assert not np.isnan(out).any(), "NaN in the output: an element was not written"
    return float(np.linalg.norm(out.astype(np.float64) - ref) / np.linalg.norm(ref))
