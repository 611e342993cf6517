"""A cold start compiles attention in a helper process beside the rest (engine/model/cpu_compile.py).

The helper only helps if the signature it compiles is the one the decoder layer calls attention with,
and the products compiled ahead only if they are the layer's: these tests check both on the real model
(by typing its layer), and run the helper itself as the engine does.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numba
import numpy as np
import pytest
from numba.core import types

from engine.kernels import unlinked
from engine.model import cpu_compile


def _typed_calls(dispatcher, argtypes: tuple, calls: dict) -> None:
    """Add what `dispatcher` called with `argtypes` passes to each kernel it calls to calls {dispatcher:
    [argument types, ...]}, and what its attention block (engine/kernels/layer.py) passes to its own."""
    from numba.core import compiler, ir, typed_passes

    interp = compiler.run_frontend(dispatcher.py_func)
    typed = typed_passes.type_inference_stage(dispatcher.typingctx, dispatcher.targetctx, interp, argtypes, None)
    for block in interp.blocks.values():
        for stmt in block.body:
            if isinstance(stmt, ir.Assign) and isinstance(stmt.value, ir.Expr) and stmt.value.op == "call":
                fnty = typed.typemap[stmt.value.func.name]
                kernel = fnty.dispatcher if isinstance(fnty, types.Dispatcher) else unlinked.called_kernel(fnty)
                if kernel is not None:  # a linked call, or one by symbol (engine/kernels/unlinked.py)
                    sig = tuple(typed.calltypes[stmt.value].args)
                    calls.setdefault(kernel, []).append(sig)
                    if kernel.py_func.__name__.startswith("_attention_block"):
                        _typed_calls(kernel, sig, calls)


@pytest.fixture(scope="module")
def layer_calls(engine):
    """What the real model's first decoder layer passes to each kernel it calls (its attention block's
    callees included), as Numba types it: {dispatcher: [argument types, ...]}. Type inference only (the
    layer itself may load from the cache, and then never types its callees in this process)."""
    from engine.model.cpu_runner import ForwardBatch

    runner = engine.runner
    batch = ForwardBatch(runner.cache)
    batch.add(np.array([1, 2], np.int32), 0, [0], 1)
    run_layer, args = runner._layer_calls[0]
    calls = {}
    _typed_calls(run_layer, (types.int64, types.boolean, numba.typeof(args), numba.typeof(runner.token_meta(batch))),
                 calls)
    return runner, batch, calls


def test_the_helpers_signature_is_the_one_the_layers_call_attention_with(layer_calls):
    runner, batch, calls = layer_calls
    sig = cpu_compile.attention_signature(runner, batch)
    for kernel in cpu_compile.attention_kernels(runner.vector_attention):
        assert calls[kernel] == [sig], kernel.py_func.__name__


def test_the_products_compiled_ahead_are_the_ones_the_layers_call(layer_calls):
    """Had a layer called a product with other types than `compile_products` compiled, the first forward
    would compile that product again, after the helper (one core idle meanwhile)."""
    from engine.kernels import layer
    from engine.kernels.int_linear import host_path

    runner, _, calls = layer_calls
    ahead = cpu_compile.product_signatures(runner)
    products = {layer.product(key, host_path()): key for key in ahead}
    called = [(products[kernel], sig) for kernel, sigs in calls.items() if kernel in products for sig in sigs]
    assert len(called) == 4  # q|k|v, o, gate|up, down
    for key, sig in called:
        assert sig in ahead[key], key


def test_argument_types_cross_to_the_helper_unchanged(layer_calls):
    runner, batch, _ = layer_calls
    sig = cpu_compile.attention_signature(runner, batch)
    crossed = json.loads(json.dumps([cpu_compile.encode_type(t) for t in sig]))
    assert tuple(cpu_compile.decode_type(t) for t in crossed) == sig
    pair = types.Tuple([types.Array(types.int8, 4, "C"), types.Array(types.float32, 4, "C")])  # an int8 K/V entry
    assert cpu_compile.decode_type(cpu_compile.encode_type(pair)) == pair


def test_the_helper_process_builds_the_attention_kernels_into_the_cache(layer_calls):
    """The helper as the engine starts it (here the kernels are in the cache already, so it loads them)."""
    forwarded, batch, _ = layer_calls
    sig = cpu_compile.attention_signature(forwarded, batch)
    spec = json.dumps({"vector": forwarded.vector_attention, "sig": [cpu_compile.encode_type(t) for t in sig]})
    done = subprocess.run([sys.executable, "-m", "engine.model.cpu_compile", spec], timeout=600)
    assert done.returncode == 0
    for kernel in cpu_compile.attention_kernels(forwarded.vector_attention):
        assert kernel._cache.load_overload(sig, kernel.targetctx) is not None, kernel.py_func.__name__
    assert cpu_compile.start_helper(forwarded.vector_attention, sig) is None  # nothing left to compile: no helper


def test_nothing_compiled_beside_the_helper_reaches_the_attention_modules():
    """The engine compiles the weight products, the LM head and the verification kernels while the helper
    compiles attention; a kernel of theirs calling into the attention modules (as a draft head's attention
    does: it is compiled after the helper) would compile an attention function in both processes at once."""
    from test_import_graph import import_graph

    graph = import_graph()
    attention = {m for m in graph if m.startswith("engine.kernels.attention") or m == "engine.kernels.kv_prefetch"}
    for start in ("engine.kernels.int_linear", "engine.kernels.linear", "engine.kernels.float_tiles",
                  "engine.spec_decode.verify"):  # the products, LM head, verification
        seen, todo = set(), [start]
        while todo:
            module = todo.pop()
            if module not in seen:
                seen.add(module)
                todo.extend(graph.get(module, ()))
        assert not seen & attention, (start, sorted(seen & attention))
