"""A faster copy propagation for Numba's parallel-loop passes: the same result, without the deep copies.

Numba's `ir_utils.copy_propagate` solves a data-flow problem (which `a = b` copies reach each block)
by iterating to a fixed point, and after every sweep it takes `copy.deepcopy` of the whole answer (a
set of (name, name) tuples per block) to compare with the next one. On our weight products, whose
parallel loop holds every token tile inlined (hundreds of blocks, thousands of copies), that deep
copy was a quarter of a product's build: 21 of 79 s in one AVX2 Q4_0 product under cProfile (Zen 3,
2026-11-30), four million `deepcopy` calls for sets of immutable tuples.

`copy_propagate` below runs the same sweeps in the same order and stops at the same sweep: a sweep
assigns each block's out-set once, so "some block's out-set changed in this sweep" is exactly
"this sweep's answer differs from the last one", which Numba finds by comparing snapshots. It
returns equal sets, so Numba builds the same IR and the same machine code (tests/test_numba_speedups.py
compares the two on real kernels). Installed only over the function it was written against: if a
Numba release changes `copy_propagate`, its own version stays.
"""

from __future__ import annotations

import hashlib
import inspect
import sys

# sha256 (first 16 hex digits) of numba.core.ir_utils.copy_propagate's source where this was written (0.68.1)
_REPLACES = frozenset({"b607f90ff29db1ce"})


def copy_propagate(blocks, typemap):
    """Numba's ir_utils.copy_propagate (in_b = intersection of the predecessors' out; out_b = gen_b |
    (in_b - kill_b), to a fixed point), noting changes as it sweeps instead of deep-copying snapshots."""
    from numba.core import config
    from numba.core.ir_utils import compute_cfg_from_blocks, init_copy_propagate_data

    cfg = compute_cfg_from_blocks(blocks)
    entry = cfg.entry_point()
    gen_copies, _all, kill_copies, in_copies, out_copies = init_copy_propagate_data(blocks, entry, typemap)
    changed = True
    while changed:
        changed = False
        for label in blocks.keys():
            if label == entry:
                continue
            predecs = [i for i, _d in cfg.predecessors(label)]
            in_copies[label] = out_copies[predecs[0]].copy()
            for p in predecs:
                in_copies[label] &= out_copies[p]
            out = gen_copies[label] | (in_copies[label] - kill_copies[label])
            changed = changed or out != out_copies[label]
            out_copies[label] = out
    if config.DEBUG_ARRAY_OPT >= 1:
        print("copy propagate out_copies:", out_copies)
    return in_copies, out_copies


def source_key(function) -> str:
    """A digest of the function's source ("" where its source cannot be read)."""
    try:
        return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()[:16]
    except (OSError, TypeError):
        return ""


def install(ir_utils) -> bool:
    """Put copy_propagate in place of Numba's in `ir_utils` (numba.core.ir_utils, maybe just executed) and
    where numba.parfors.parfor imported it; False if this Numba's own differs from the one it reproduces."""
    original = getattr(ir_utils, "copy_propagate_numba", ir_utils.copy_propagate)
    if source_key(original) not in _REPLACES:
        return False
    ir_utils.copy_propagate_numba = original  # kept for the test that compares the two
    ir_utils.copy_propagate = copy_propagate
    parfor = sys.modules.get("numba.parfors.parfor")
    if parfor is not None:
        parfor.copy_propagate = copy_propagate
    return True
