"""One Numba on-disk cache per version of the kernel sources.

Numba checks a cached function against its own file's timestamp only. A kernel composed from
functions in other files (a decoder layer calling the integer tiles, a specialised GEMM calling
the SIMD intrinsics) would load stale machine code after any of those files changed, and stale
code built against another buffer layout crashes. So the cache lives in a folder named after a
hash of every source file that holds jitted code; a change anywhere starts a fresh cache.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.abc
import importlib.util
import itertools
import os
import shutil
import sys
import threading
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
_PACKAGES = ("engine", "proposers")
_KEEP = 3  # cache versions kept side by side (several checkouts may share one home)
_held = threading.local()  # depth of compile_lock() in this thread (it is re-entrant)


_MARKERS = ("njit", "intrinsic")  # a file holding either takes part in compiled code


def _kernel_sources() -> list[Path]:
    """Every file whose code can end up in a compiled kernel: engine/kernels whole (its tiles are plain
    functions compiled through simd.specialize), and any other file that jits or defines intrinsics."""
    found = []
    for package in _PACKAGES:
        for path in sorted((_ROOT / package).rglob("*.py")):
            text = path.read_text(encoding="utf-8", errors="ignore")
            if path.parent.name == "kernels" or any(marker in text for marker in _MARKERS):
                found.append(path)
    return found


def sources_digest() -> str:
    digest = hashlib.sha256()
    for path in _kernel_sources():
        digest.update(path.relative_to(_ROOT).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _prune(parent: Path, current: Path) -> None:
    versions = sorted((p for p in parent.iterdir() if p.is_dir() and p != current),
                      key=lambda p: p.stat().st_mtime, reverse=True)
    for old in versions[_KEEP - 1:]:
        shutil.rmtree(old, ignore_errors=True)


def use_versioned_numba_cache() -> None:
    """Point NUMBA_CACHE_DIR at this source version's folder (a user's own setting wins)."""
    if "NUMBA_CACHE_DIR" in os.environ:
        return
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "speculant" / "numba"
    current = base / sources_digest()
    try:
        current.mkdir(parents=True, exist_ok=True)
        os.utime(current)
        _prune(base, current)
    except OSError:
        return  # read-only home: Numba falls back to its own default
    os.environ["NUMBA_CACHE_DIR"] = str(current)
    numba = sys.modules.get("numba")
    if numba is not None:  # imported first: its config already read the environment
        numba.config.CACHE_DIR = str(current)


def launch_threads() -> None:
    """Start Numba's threading layer now, before any cached kernel is loaded.

    A serial kernel (a decoder layer, a draft head's module) that calls threaded ones carries their
    parallel-for code, but only a kernel that is itself parallel starts the threading layer when it
    is loaded from the cache. Loaded first, the serial one cannot link (LLVM "Symbol not found:
    allocate_sched", the process aborts): seen once here when an eagle head's warm-up loaded its
    cached module before any target kernel had run.
    """
    import numba

    numba.get_num_threads()


@contextlib.contextmanager
def compile_lock():
    """Hold the cache folder's lock while compiling (re-entrant within a thread).

    Numba writes a function's cache entry as separate index and code files; two processes compiling
    the same function at once (two workers started together on a cold cache) can leave an index that
    points at the other's code, and a later start that loads it crashes (numba issue #4807; seen here
    as a segfault in a decoder layer loaded from such a cache). Engines therefore build and warm up
    their kernels one process at a time; a warm cache makes the wait a matter of seconds.
    """
    depth = getattr(_held, "depth", 0)
    folder = os.environ.get("NUMBA_CACHE_DIR")
    if depth or not folder:
        _held.depth = depth + 1
        try:
            yield
        finally:
            _held.depth = depth
        return
    try:
        handle = open(Path(folder) / ".compile.lock", "a")
    except OSError:  # a read-only cache folder: Numba will not write there either
        handle = None
    try:
        if handle is not None:
            fcntl.flock(handle, fcntl.LOCK_EX)
        _held.depth, _held.handle = 1, handle
        yield
    finally:
        _held.depth, _held.handle = 0, None
        if handle is not None:
            fcntl.flock(handle, fcntl.LOCK_UN)
            handle.close()


def held_lock_fd() -> int | None:
    """The file descriptor of the compile_lock this thread holds, if any. A helper process given it
    (subprocess `pass_fds`) shares the lock: it stays held until the helper exits too, even if this
    process dies first, so no other engine compiles beside an orphaned helper."""
    handle = getattr(_held, "handle", None)
    return handle.fileno() if handle is not None else None


# ---------------------------------------------------------------- cache writes that two processes can share


def _locked_save(self, key, data) -> None:
    """Numba's IndexDataCacheFile.save, made safe for processes compiling side by side.

    Numba reads the index, picks a free data file name, writes the index, then the code, with no lock:
    two processes saving at once can both pick one name, and the index then names a file holding the
    other function's code (numba issue #4807). Here the whole save holds the folder's save lock, and the
    code is written before the index that names it, so a reader never finds an entry without its code.
    """
    try:
        handle = open(os.path.join(os.path.dirname(self._index_path), ".save.lock"), "a")
    except OSError:  # a read-only folder: Numba cannot save there either; let it fail as it would
        handle = None
    try:
        if handle is not None:
            fcntl.flock(handle, fcntl.LOCK_EX)
        overloads = self._load_index()
        name = overloads.get(key)
        if name is None:
            taken = set(overloads.values())
            name = next(n for n in map(self._data_name, itertools.count(1)) if n not in taken)
            overloads[key] = name
        self._save_data(name, data)
        self._save_index(overloads)
    finally:
        if handle is not None:
            handle.close()  # releases the lock


_SAVE_PARTS = ("save", "_load_index", "_data_name", "_save_data", "_save_index")  # what _locked_save relies on


def _lock_saves(caching) -> None:
    """Install _locked_save, unless this Numba's cache class lacks a part it uses (a later release may rename
    them): then Numba keeps its own save, as unsafe as before but working."""
    cls = getattr(caching, "IndexDataCacheFile", None)
    if cls is not None and all(hasattr(cls, part) for part in _SAVE_PARTS):
        cls.save = _locked_save


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs `then(module)` right after the module `name` is first executed (wrapping its own loader)."""

    def __init__(self, name: str, then):
        self.name, self.then, self.loader = name, then, None

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name or self.loader is not None:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        self.loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        module.__loader__ = module.__spec__.loader = self.loader  # the module's own loader again
        self.then(module)


def after_import(name: str, then) -> None:
    """Run `then(module)` on the module `name` now if it is loaded, else right after it first is."""
    if name in sys.modules:
        then(sys.modules[name])
    elif not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, then))


def lock_cache_writes() -> None:
    """Make every Numba cache save in this process hold the cache folder's save lock (see _locked_save),
    now if Numba's caching module is loaded, else as soon as it is."""
    after_import("numba.core.caching", _lock_saves)
