"""Speculant engine: model runtime, scheduler and the speculative step."""

import os

from engine import numba_speedups
from engine.jit_cache import after_import, lock_cache_writes, use_versioned_numba_cache

# Numba turns LLVM's SLP vectoriser off by default; the strip-packed weight kernels need it
# (see shared/CPU-KERNELS.md). It must be set before numba is first imported.
os.environ.setdefault("NUMBA_SLP_VECTORIZE", "1")
use_versioned_numba_cache()
lock_cache_writes()
after_import("numba.core.ir_utils", numba_speedups.install)  # faster parallel-loop builds, the same code
