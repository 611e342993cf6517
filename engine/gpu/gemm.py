"""Weight products out[:M] = x[:M] @ W.T with float32 accumulation and float32 output.

Default: cuBLAS `cublasGemmEx`, the call cupy.matmul makes underneath, but called directly
because cupy.matmul writes its output in the input dtype (we want fp16/bf16 inputs and a float32
residual stream) and has no bfloat16. The handle gets its own workspace so that nothing is
allocated under CUDA-graph capture. The calls go through ctypes to the libcublas that CuPy loaded:
CuPy's wrappers rebind the stream on every call and refuse to run while a stream captures
("calling cuBLAS API during stream capture is currently unsupported", CuPy 14 on an H100), so
the graphs could not be built. With batch_invariant=True the products use
cuda/linear.cu instead: slower for large M, but a row's result never depends on M.

Row-major out[M, N] = x[M, K] W[N, K]^T is, in cuBLAS's column-major terms,
out^T (N x M, ld N) = op(W) x^T with W read as K x N (ld K) and op = transpose.
"""

from __future__ import annotations

import ctypes

import numpy as np

CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF = 0, 2, 14  # cudaDataType
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_COMPUTE_32F = 68  # plain fp32 accumulation (no TF32)
CUBLAS_GEMM_DEFAULT = -1
CUBLAS_DEFAULT_MATH = 0
DATA_TYPES = {"float32": CUDA_R_32F, "float16": CUDA_R_16F, "bfloat16": CUDA_R_16BF}
WORKSPACE_BYTES = 32 << 20


def check_invariant_shape(name: str, k: int, itemsize: int) -> None:
    """cuda/linear.cu reads 16-byte vectors along K."""
    if (k * itemsize) % 16:
        raise ValueError(f"{name}: in_features={k} is not a multiple of {16 // itemsize}; "
                         "batch_invariant=True needs 16-byte rows (use the cuBLAS path)")


def _loaded_cublas() -> ctypes.CDLL:
    """The libcublas already mapped into this process by CuPy's cuBLAS module (same handles, same library)."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "/libcublas.so" in line}
    if not paths:
        raise RuntimeError("libcublas is not loaded (import cupy_backends.cuda.libs.cublas first)")
    lib = ctypes.CDLL(min(paths))
    lib.cublasGemmEx.argtypes = [ctypes.c_void_p, *[ctypes.c_int] * 5, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                 ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.cublasSetStream_v2.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    return lib


class Gemm:
    def __init__(self, dtype: str, kernels, batch_invariant: bool = False, stream=None):
        if dtype not in DATA_TYPES:
            raise ValueError(f"dtype: expected one of {sorted(DATA_TYPES)}, got {dtype!r}")
        self.dtype_id = DATA_TYPES[dtype]
        self.kernels = kernels
        self.batch_invariant = batch_invariant
        self.handle = None
        if not batch_invariant:
            self._open_cublas(stream)

    def _open_cublas(self, stream) -> None:
        import cupy as cp
        from cupy_backends.cuda.libs import cublas

        self._cublas = cublas
        self.handle = cublas.create()
        self._lib = _loaded_cublas()
        self._bound_stream = None
        if stream is not None:
            self._bind(stream.ptr)
        if hasattr(cublas, "setMathMode"):
            cublas.setMathMode(self.handle, CUBLAS_DEFAULT_MATH)
        self.workspace = cp.empty(WORKSPACE_BYTES, cp.uint8)
        if hasattr(cublas, "setWorkspace"):  # CuPy >= 13: no cudaMalloc inside graph capture
            cublas.setWorkspace(self.handle, self.workspace.data.ptr, WORKSPACE_BYTES)
        self._alpha = np.ones(1, np.float32)  # host scalars, read when the call is made / captured
        self._beta = np.zeros(1, np.float32)

    def __call__(self, x, w, out, rows: int) -> None:
        """out[:rows] = x[:rows] @ w.T on the current stream; x: [>= rows, K], w: [N, K], out: [>= rows, N] f32."""
        if rows <= 0:
            return
        if self.batch_invariant:
            self.kernels.linear_rows(x, w, out, rows)
            return
        n, k = w.shape
        self._bind(self._current_stream())  # the runner's stream (inside `with stream:`), also under capture
        status = self._lib.cublasGemmEx(
            self.handle, CUBLAS_OP_T, CUBLAS_OP_N, n, rows, k,
            self._alpha.ctypes.data, w.data.ptr, self.dtype_id, k,
            x.data.ptr, self.dtype_id, k,
            self._beta.ctypes.data, out.data.ptr, CUDA_R_32F, n,
            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT,
        )
        if status:
            raise RuntimeError(f"cublasGemmEx failed with status {status} (out [{rows}, {n}], K = {k})")

    @staticmethod
    def _current_stream() -> int:
        import cupy as cp

        return cp.cuda.get_current_stream().ptr

    def _bind(self, stream_ptr: int) -> None:
        if stream_ptr != self._bound_stream:
            status = self._lib.cublasSetStream_v2(self.handle, stream_ptr)
            if status:
                raise RuntimeError(f"cublasSetStream failed with status {status}")
            self._bound_stream = stream_ptr

    def close(self) -> None:
        if self.handle is not None:
            self._cublas.destroy(self.handle)
            self.handle = None
