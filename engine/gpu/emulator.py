"""Run the real `cuda/*.cu` kernels on the CPU, for tests on machines without a GPU.

`EmuModule(name)` compiles cuda/<name>.cu with g++ against cuda/emu/ (one std::thread per CUDA
thread, barriers for __syncthreads and warp shuffles) and exposes each `extern "C"` kernel with
CuPy's RawKernel calling convention: `module.get_function(name)(grid, block, args)`, with NumPy
arrays in place of device arrays. So the launchers in engine.gpu.kernels run unchanged against
it. Arguments are type-checked strictly (np.int32 for `int`, np.float32 for `float`, ...): CuPy
would silently misread a wrong scalar width, the emulator refuses it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from engine.gpu.build import CUDA_DIR, read_source

EMU_DIR = CUDA_DIR / "emu"
_KERNEL = re.compile(r'extern\s+"C"\s+void\s+(\w+)\s*\(([^)]*)\)\s*\{')
_SCALARS = {
    "int": (ctypes.c_int, np.int32),
    "unsigned": (ctypes.c_uint, np.uint32),
    "float": (ctypes.c_float, np.float32),
    "double": (ctypes.c_double, np.float64),
}


def available() -> bool:
    return shutil.which(os.environ.get("CXX", "g++")) is not None


def _cxx_flags() -> list[str]:
    return ["-std=c++17", f"-I{EMU_DIR}", "-include", str(EMU_DIR / "cuda_emu.h")]


def _run(cmd: list[str], stdin: str | None = None) -> str:
    done = subprocess.run(cmd, input=stdin, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"emulator build failed: {' '.join(cmd)}\n{done.stderr[-4000:]}")
    return done.stdout


def _parse_params(text: str) -> list[tuple[str, str]]:
    """`const float* x, int n` -> [("const float*", "x"), ("int", "n")]."""
    params = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name = re.findall(r"\w+", part)[-1]
        params.append((part[: part.rfind(name)].replace("__restrict__", "").strip(), name))
    return params


class EmuKernel:
    def __init__(self, func, name: str, params: list[tuple[str, str]]):
        self.name, self.params = name, params
        self._func = func
        self._func.restype = None
        self._func.argtypes = [ctypes.c_uint] * 6 + [
            ctypes.c_void_p if "*" in ptype else _SCALARS[ptype][0] for ptype, _ in params
        ]

    def __call__(self, grid, block, args, shared_mem: int = 0, stream=None) -> None:
        if len(args) != len(self.params):
            raise TypeError(f"{self.name}: expected {len(self.params)} arguments, got {len(args)}")
        dims = [*(tuple(grid) + (1, 1))[:3], *(tuple(block) + (1, 1))[:3]]
        values = []
        for (ptype, pname), arg in zip(self.params, args):
            if "*" in ptype:
                if not isinstance(arg, np.ndarray) or not arg.flags.c_contiguous:
                    raise TypeError(f"{self.name}: {pname} must be a C-contiguous ndarray")
                values.append(arg.ctypes.data)
            else:
                expected = _SCALARS[ptype][1]
                if not isinstance(arg, np.generic) or arg.dtype != expected:
                    raise TypeError(f"{self.name}: {pname} must be a numpy {np.dtype(expected).name} scalar")
                values.append(arg.item())
        self._func(*dims, *values)


class EmuModule:
    """A compiled `cuda/<name>.cu`; mirrors cupy.RawModule.get_function."""

    def __init__(self, name: str, cache_dir: str | None = None):
        source = read_source(CUDA_DIR / f"{name}.cu")
        kernels = self._find_kernels(source)
        wrappers = "\n".join(self._wrapper(k, params) for k, params in kernels.items())
        full = source + "\n" + wrappers + "\n"
        key = hashlib.sha256((full + (EMU_DIR / "cuda_emu.h").read_text()).encode()).hexdigest()[:16]
        cache = Path(cache_dir or os.path.join(tempfile.gettempdir(), "speculant-cuda-emu"))
        cache.mkdir(parents=True, exist_ok=True)
        lib = cache / f"{name}-{key}.so"
        if not lib.exists():
            src = cache / f"{name}-{key}.cpp"
            src.write_text(full)
            tmp = cache / f"{name}-{key}.{os.getpid()}.so"
            cmd = [os.environ.get("CXX", "g++"), *_cxx_flags(), "-O1", "-shared", "-fPIC", str(src), "-o", str(tmp)]
            _run(cmd)
            tmp.replace(lib)
        self._lib = ctypes.CDLL(str(lib))
        self._kernels = {k: EmuKernel(getattr(self._lib, f"emu__{k}"), k, p) for k, p in kernels.items()}

    @staticmethod
    def _find_kernels(source: str) -> dict[str, list[tuple[str, str]]]:
        cmd = [os.environ.get("CXX", "g++"), *_cxx_flags(), "-E", "-P", "-x", "c++", "-"]
        text = _run(cmd, source)
        return {m.group(1): _parse_params(m.group(2)) for m in _KERNEL.finditer(text)}

    @staticmethod
    def _wrapper(name: str, params: list[tuple[str, str]]) -> str:
        decl = ", ".join(f"{t} {n}" for t, n in params)
        names = ", ".join(n for _, n in params)
        return (f'extern "C" void emu__{name}(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, '
                f"unsigned bz, {decl}) {{ emu_launch({name}, dim3{{gx, gy, gz}}, dim3{{bx, by, bz}}, {names}); }}")

    def get_function(self, name: str) -> EmuKernel:
        return self._kernels[name]
