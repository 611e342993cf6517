"""A cold start's kernel compilation on two cores: attention in a helper process beside the rest.

On an empty kernel cache a CPU worker compiled for ~160 s before its first step (2-core Xeon,
the default model), on one core: LLVM compiles one function at a time. The attention kernels
(paged, its serial build and the split decode path: over half of that time) compile in a helper
process while this one compiles the weight products, the LM head and the caller's own kernels;
the decoder layers, compiled at the first forward, then load attention from the cache.

Numba's on-disk cache keeps one index per function. Two processes compiling *different* functions
at once is safe; the same function with different signatures is not (jit_cache.compile_lock). The
helper compiles only the attention modules' functions, which nothing in this process compiles while
it runs; this process holds compile_lock and the helper inherits it, so no other engine compiles
until both are done.

The attention signature crosses to the helper as JSON (`encode_type` / `decode_type`): the types of
the runner's own buffers, as the layer passes them.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import numba
import numpy as np
from numba.core import types

from engine.jit_cache import compile_lock, held_lock_fd
from engine.kernels.linear import linear

log = logging.getLogger("speculant.engine")

HELPER_TIMEOUT_S = 1800.0  # a helper still compiling after this is stopped (this process compiles instead)


def encode_type(t) -> list:
    """A Numba argument type (array, tuple or scalar) as JSON-able lists."""
    if isinstance(t, types.Array):
        return ["array", str(t.dtype), t.ndim, t.layout]
    if isinstance(t, types.BaseTuple):
        return ["tuple", [encode_type(e) for e in t.types]]
    return ["scalar", str(t)]


def decode_type(spec: list):
    kind = spec[0]
    if kind == "array":
        return types.Array(getattr(types, spec[1]), spec[2], spec[3])
    if kind == "tuple":
        return types.Tuple([decode_type(e) for e in spec[1]])
    return getattr(types, spec[1])


def attention_kernels(vector: bool) -> list:
    """The attention dispatchers a decoder layer calls (engine/kernels/layer.py binds all of them)."""
    from engine.kernels import attention

    pair = attention._ATTENTION_VEC if vector else attention._ATTENTION
    return [pair[0], pair[1], attention.decode_attention]


def attention_signature(runner, batch) -> tuple:
    """The types of what a decoder layer passes to attention (engine/kernels/layer.py `_layer`): the
    runner's own buffers (a leading-axis slice of a C-contiguous array keeps its type) and `batch`'s meta."""
    positions, _, cu_q, tables, _, scale, num_heads, *_, threads = runner.token_meta(batch)
    k, v = runner.layer_kv(0)
    args = (runner.qkv, k, v, cu_q, positions, tables, num_heads, scale, runner.config.window(0), runner.attn, threads)
    return tuple(numba.typeof(a) for a in args)


def product_signatures(runner) -> dict:
    """{product key: {argument types}} of the layers' weight products (engine/kernels/layer.py `product`)."""
    from engine.kernels import layer

    x = numba.typeof(runner.h)  # a product's input and output: row slices of float32 [rows, width] buffers
    sigs = {}
    for layer_weights in runner.layers:
        for w, r in runner.layer_products(layer_weights):  # r: the product's input buffers
            sigs.setdefault(layer.product_key(w), set()).add((x, numba.typeof(layer.product_args(w)), x, numba.typeof(r)))
    return sigs


def compile_products(runner) -> None:
    """Each distinct weight product of the layers for the types the layer passes, and the LM head."""
    from engine.kernels import layer
    from engine.kernels.int_linear import host_path

    for key, sigs in product_signatures(runner).items():
        for sig in sigs:
            layer.product(key, host_path()).compile(sig)
    cfg = runner.config
    linear(np.zeros((1, cfg.hidden_size), np.float32), runner.lm_head, np.zeros((1, cfg.vocab_size), np.float32))


def _loads_from_cache(kernel, sig: tuple) -> bool:
    cache = getattr(kernel, "_cache", None)  # Numba's Dispatcher cache (private; absent: assume cold)
    return cache is not None and cache.load_overload(sig, kernel.targetctx) is not None


def start_helper(vector: bool, sig: tuple) -> subprocess.Popen | None:
    """Compile the attention kernels for `sig` in a helper process, unless the cache holds them already
    or there is no on-disk cache for it to fill (NUMBA_CACHE_DIR unset, jit_cache having found no
    folder, or not writable: this process would then compile attention again after waiting)."""
    folder = os.environ.get("NUMBA_CACHE_DIR")
    if not folder or not os.access(folder, os.W_OK | os.X_OK):
        return None
    if all(_loads_from_cache(k, sig) for k in attention_kernels(vector)):
        return None
    spec = json.dumps({"vector": vector, "sig": [encode_type(t) for t in sig]})
    lock = held_lock_fd()
    return subprocess.Popen([sys.executable, "-m", "engine.model.cpu_compile", spec],
                            pass_fds=() if lock is None else (lock,))


def finish_helper(helper: subprocess.Popen | None) -> None:
    """Wait for the helper; if it failed, say so (the first forward compiles attention here instead)."""
    if helper is None:
        return
    try:
        code = helper.wait(HELPER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        helper.kill()
        code = helper.wait()
    if code != 0:
        log.warning("the attention compile helper exited with %s; compiling attention in this process", code)


def compile_ahead(runner, batch, also=()) -> None:
    """On a cold cache, compile a CPU runner's kernels before its first forward (`batch`: a ForwardBatch,
    for its arrays' types): attention in a helper, the weight products, the LM head and each of `also`
    (callables) here, then wait for the helper. With attention cached there is nothing to overlap: every
    kernel compiles, or loads, where it is first used (a cached layer loads with its callees linked in)."""
    start = time.monotonic()
    with compile_lock():
        helper = start_helper(runner.vector_attention, attention_signature(runner, batch))
        if helper is None:
            return
        log.info("compiling the CPU kernels for this CPU (a cold cache: a minute or two, once per CPU and version; "
                 "kept in %s)", os.environ.get("NUMBA_CACHE_DIR"))
        try:
            compile_products(runner)
            for compile_more in also:
                compile_more()
        finally:
            finish_helper(helper)
    log.info("kernels compiled in %.1f s (attention in a helper process)", time.monotonic() - start)


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    sig = tuple(decode_type(t) for t in spec["sig"])
    for kernel in attention_kernels(spec["vector"]):
        kernel.compile(sig)
    return 0


if __name__ == "__main__":  # the helper (the engine package set Numba's environment on import)
    sys.exit(main(sys.argv[1:]))
