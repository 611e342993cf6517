"""Engines build their kernels one process at a time (engine.jit_cache.compile_lock): another process
holding the cache folder's lock makes a second wait; the lock is re-entrant within a process. The cache
folder itself is versioned by every source a kernel is built from, and processes saving entries into one
cache index at once lose none and never mix up their files (engine.jit_cache.lock_cache_writes)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from engine.jit_cache import compile_lock

HOLD = 1.5  # s


def test_a_second_process_waits_for_the_lock(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from engine.jit_cache import compile_lock\n"
         f"with compile_lock():\n    print('held', flush=True); time.sleep({HOLD})"],
        env={**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    start = time.monotonic()
    with compile_lock():
        waited = time.monotonic() - start
        with compile_lock():  # re-entrant: no deadlock
            pass
    holder.wait(timeout=30)
    assert waited > HOLD / 2


def test_without_a_cache_folder_the_lock_is_a_no_op(monkeypatch):
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    with compile_lock():
        pass


def test_every_file_that_feeds_a_kernel_versions_the_cache():
    """Numba checks a cached kernel against its own file only, so the cache folder is named after a hash
    of every source a kernel is built from: the integer tiles (plain functions, compiled per ISA path
    through simd.specialize) and the intrinsics' files included, or an edit there would load stale code."""
    from engine.jit_cache import _ROOT, _kernel_sources

    names = {p.relative_to(_ROOT).as_posix() for p in _kernel_sources()}
    for module in ("int_tiles", "int_linear", "simd", "simd_ir", "simd_paths", "layer", "attention_vec"):
        assert f"engine/kernels/{module}.py" in names


def test_the_models_layers_load_back_from_the_kernel_cache(engine):
    """Every compiled layer of the real model's forward (and so the attention, products and norms it calls)
    is saved in Numba's on-disk cache and loads back from it, so a worker's next start compiles none of them.
    A kernel that reads a dynamic global (numba.get_num_threads() called inside it) cannot be saved: it and
    every layer calling it then compiled again in each process, ~23 s of every worker start."""
    import numpy as np

    from engine.model.cpu_runner import ForwardBatch

    runner, blocks, table = engine.runner, engine.scheduler.blocks, []
    assert blocks.allocate(table, 1)  # a block of the engine's own manager: the runner's cache is shared
    try:
        batch = ForwardBatch(runner.cache)
        batch.add(np.array([1], np.int32), 0, table, 1)
        runner.forward(batch)
    finally:
        blocks.free_blocks(table)
    for run in {id(run): run for run, _ in runner._layer_calls}.values():
        assert run.signatures, run.py_func.__name__
        for sig in run.signatures:
            assert run._cache.load_overload(sig, run.targetctx) is not None, run.py_func.__name__


SAVER = """
import sys
import engine  # locks Numba's cache saves, as in every process that imports the engine
from numba.core.caching import IndexDataCacheFile
folder, tag, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
index = IndexDataCacheFile(folder, "shared", "stamp")
for i in range(count):
    index.save((tag, i), (tag, i, "code"))
"""


def test_processes_saving_into_one_cache_index_lose_no_entry(tmp_path):
    """Four processes each save 60 entries into one Numba index file at once (two compiling workers whose
    functions share a source file). Unlocked, Numba's read-modify-write of the index drops other processes'
    entries and can point one entry at another's code file; here every entry is kept with its own code."""
    from numba.core.caching import IndexDataCacheFile

    tags, count = ("a", "b", "c", "d"), 60
    savers = [subprocess.Popen([sys.executable, "-c", SAVER, str(tmp_path), tag, str(count)]) for tag in tags]
    assert [p.wait(timeout=120) for p in savers] == [0] * len(tags)
    index = IndexDataCacheFile(str(tmp_path), "shared", "stamp")
    for tag in tags:
        for i in range(count):
            assert index.load((tag, i)) == (tag, i, "code"), (tag, i)


def test_a_numba_without_the_parts_the_locked_save_uses_keeps_its_own():
    """A later Numba that renamed the cache class's helpers keeps its own save instead of failing on import."""
    from types import SimpleNamespace

    from engine.jit_cache import _lock_saves

    class Index:
        def save(self, key, data):
            pass

    own = Index.save
    _lock_saves(SimpleNamespace(IndexDataCacheFile=Index))
    assert Index.save is own
    _lock_saves(SimpleNamespace())  # no such class at all: nothing to patch, no error
