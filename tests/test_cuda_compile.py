"""CPU CI gate for the CUDA sources: every cuda/*.cu compiles with NVRTC for sm_80 and sm_90.

No GPU and no driver are needed: NVRTC alone (the nvidia-cuda-nvrtc-cu12 wheel, through CuPy's
low-level binding) compiles to a cubin, with cuda_fp16.h / cuda_bf16.h from the
nvidia-cuda-runtime-cu12 wheel. An error or any warning in NVRTC's log fails the test. The
sources are compiled exactly as the runtime compiles them (engine.gpu.build: local headers
expanded, the same options plus -arch).
"""

from __future__ import annotations

import os

import pytest

from engine.gpu.build import CI_ARCHS, CUDA_DIR, MODULES, KernelCompileError, nvrtc_compile, source_paths


def _nvrtc_or_skip():
    """The binding and libnvrtc; in CI (env CI set) their absence is a failure, not a skip."""
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception as exc:  # CuPy or the NVRTC wheel missing
        if os.environ.get("CI"):
            pytest.fail(f"NVRTC unavailable in CI ({exc}); install the test extra (cupy-cuda12x, nvidia-cuda-nvrtc-cu12)")
        pytest.skip(f"NVRTC unavailable: {exc}")


def test_every_module_has_a_source():
    assert sorted(p.stem for p in source_paths()) == sorted(MODULES)


@pytest.mark.parametrize("arch", CI_ARCHS)
@pytest.mark.parametrize("source", [p.name for p in source_paths()])
def test_compiles_cleanly(source, arch):
    _nvrtc_or_skip()
    cubin, log = nvrtc_compile(CUDA_DIR / source, arch)
    assert len(cubin) > 1000
    assert log == ""


def test_a_warning_fails_the_gate(tmp_path):
    """The gate itself: an unused variable (a warning, not an error) is reported as a failure."""
    _nvrtc_or_skip()
    src = tmp_path / "probe.cu"
    src.write_text('extern "C" __global__ void probe(float* x) { int unused; x[threadIdx.x] = 1.0f; }\n')
    with pytest.raises(KernelCompileError, match="unused"):
        nvrtc_compile(src, "sm_90")
    src.write_text('extern "C" __global__ void probe(float* x) { x[threadIdx.x] = 1.0f }\n')  # missing ';'
    with pytest.raises(KernelCompileError, match="error"):
        nvrtc_compile(src, "sm_90")
