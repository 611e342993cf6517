"""GPU backend (CUDA through CuPy): the boundary every GPU import goes through.

Nothing here imports CuPy at module level, so the CPU path never needs it. The engine calls
`make_gpu_runner(model, cache, args)` when `--device cuda` (or `auto` with `cuda_available()`).
Command-line flags read from `args` (all optional):
    --gpu-memory-utilization F   fraction of GPU memory for weights, buffers and KV cache; the KV
                                 cache takes the rest (default: size it from --kv-cache-memory)
    --gpu-dtype {float16,bfloat16,float32}   weight / activation storage type (default float16)
    --gpu-batch-invariant        weight products by cuda/linear.cu: bit-identical rows for any batch
    --no-cuda-graphs             always launch eagerly
"""

from __future__ import annotations

import dataclasses


def cuda_available() -> bool:
    """True when CuPy imports and sees a CUDA device."""
    try:
        import cupy
    except Exception:  # not installed, or a broken CUDA install
        return False
    try:
        return bool(cupy.cuda.is_available())
    except Exception:
        return False


def make_gpu_runner(model, cache, args):
    """Build the GpuRunner for `--device cuda`; use `runner.cache` afterwards (its num_blocks is the GPU's)."""
    from engine.gpu.runner import GpuRunner

    if not cuda_available():
        raise ValueError("device: --device cuda needs CuPy (pip install 'speculant[gpu]') and a CUDA device")
    utilization = getattr(args, "gpu_memory_utilization", None)
    dtype = getattr(args, "gpu_dtype", None) or "float16"
    if utilization is None:  # --kv-cache-memory GiB of GPU cache blocks
        per_block = GpuRunner.kv_bytes_per_block(model.config, cache.block_size, dtype)
        cache = dataclasses.replace(cache, num_blocks=int(args.kv_cache_memory * 2**30) // per_block)
    return GpuRunner(
        model, cache,
        dtype=dtype,
        gpu_memory_utilization=utilization,
        batch_invariant=bool(getattr(args, "gpu_batch_invariant", False)),
        cuda_graphs=not getattr(args, "no_cuda_graphs", False),
    )
