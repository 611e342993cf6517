"""Where the CUDA sources live and how they are compiled: shared by the runtime and the CPU CI gate.

The kernels are plain `cuda/*.cu` files at the repository root (not a Python package). Local
`#include "x.cuh"` lines are expanded here, textually, so that CuPy's compile cache (keyed on
the source text) sees every header change. Only the standard library is imported at module
level: this file is safe on the CPU path.
"""

from __future__ import annotations

import re
import site
import sys
from pathlib import Path

CUDA_DIR = Path(__file__).resolve().parents[2] / "cuda"
MODULES = ("ops", "attention", "linear", "verify")  # cuda/<name>.cu
CI_ARCHS = ("sm_80", "sm_90")
_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


class KernelCompileError(RuntimeError):
    """NVRTC rejected a source, or warned about it; the message carries NVRTC's log."""


def source_paths() -> list[Path]:
    return sorted(CUDA_DIR.glob("*.cu"))


def read_source(path: Path, _seen: frozenset = frozenset()) -> str:
    """The source with local includes expanded (each header once)."""
    path = Path(path)
    text = path.read_text()

    def expand(match: re.Match) -> str:
        header = (path.parent / match.group(1)).resolve()
        if header in _seen:
            return ""
        return read_source(header, _seen | {header}).replace("#pragma once", "")

    return _LOCAL_INCLUDE.sub(expand, text)


def cuda_include_dirs() -> list[str]:
    """CUDA runtime headers (cuda_fp16.h, cuda_bf16.h) from the nvidia-cuda-runtime-cu12 wheel."""
    roots = [*site.getsitepackages(), site.getusersitepackages(), *sys.path]
    found = []
    for root in roots:
        inc = Path(root) / "nvidia" / "cuda_runtime" / "include"
        if (inc / "cuda_fp16.h").is_file() and str(inc) not in found:
            found.append(str(inc))
    return found[:1]


def compile_options(arch: str | None = None) -> tuple[str, ...]:
    """NVRTC options; `arch` (e.g. "sm_90") only for driverless compiles, CuPy picks it otherwise."""
    options = ["-std=c++17", *(f"-I{d}" for d in cuda_include_dirs())]
    if arch is not None:
        options.insert(0, f"-arch={arch}")
    return tuple(options)


def nvrtc_compile(path: Path, arch: str) -> tuple[bytes, str]:
    """Compile one `.cu` with NVRTC alone (no driver, no GPU) -> (cubin, log).

    Raises KernelCompileError on an error or on any warning in the log.
    """
    from cupy.cuda import nvrtc  # lazy: CuPy is a GPU/test dependency only

    path = Path(path)
    prog = nvrtc.createProgram(read_source(path), path.name, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, list(compile_options(arch)))
        except nvrtc.NVRTCError as exc:
            raise KernelCompileError(f"{path.name} ({arch}): {exc}\n{nvrtc.getProgramLog(prog)}") from None
        log = nvrtc.getProgramLog(prog).strip("\x00").strip()
        if "warning" in log.lower() or "error" in log.lower():
            raise KernelCompileError(f"{path.name} ({arch}) compiled with diagnostics:\n{log}")
        return nvrtc.getCUBIN(prog), log
    finally:
        nvrtc.destroyProgram(prog)
