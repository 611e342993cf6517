"""Weight products out[:M] = x[:M] @ W.T with float32 accumulation and float32 output.

Default: cuBLAS `cublasGemmEx`, the call cupy.matmul makes underneath, but called directly
because cupy.matmul writes its output in the input dtype (we want fp16/bf16 inputs and a float32
residual stream) and has no bfloat16. The handle gets its own workspace so that nothing is
allocated under CUDA-graph capture. With batch_invariant=True the products use
cuda/linear.cu instead: slower for large M, but a row's result never depends on M.

Row-major out[M, N] = x[M, K] W[N, K]^T is, in cuBLAS's column-major terms,
out^T (N x M, ld N) = op(W) x^T with W read as K x N (ld K) and op = transpose.
"""

from __future__ import annotations

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
        if stream is not None:  # CuPy's gemmEx rebinds it to the current stream on each call anyway
            cublas.setStream(self.handle, stream.ptr)
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
        # gemmEx binds the handle to CuPy's current stream (the runner's, inside `with stream:`).
        self._cublas.gemmEx(
            self.handle, CUBLAS_OP_T, CUBLAS_OP_N, n, rows, k,
            self._alpha.ctypes.data, w.data.ptr, self.dtype_id, k,
            x.data.ptr, self.dtype_id, k,
            self._beta.ctypes.data, out.data.ptr, CUDA_R_32F, n,
            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT,
        )

    def close(self) -> None:
        if self.handle is not None:
            self._cublas.destroy(self.handle)
            self.handle = None
