"""engine.kernels.huge_pages: packed weights copied onto transparent huge pages, and their memory given back."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest

from engine.kernels import huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mapping_of(address: int) -> dict | None:
    """The /proc/self/smaps entry whose range holds `address`: its fields in kB, or None."""
    entry = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            entry = {} if lo <= address < hi else None
        elif entry is not None and line.split()[-1] == "kB":
            entry[head.rstrip(":")] = int(line.split()[1])
            if head == "VmFlags:":
                break
        if entry is not None and "AnonHugePages" in entry:
            return entry
    return entry


def test_mid_sized_arrays_are_copied_and_the_rest_left_as_they_are():
    rng = np.random.default_rng(0)
    mid = rng.integers(0, 256, (3 << 20) // 16, dtype=np.uint8).reshape(-1, 16)  # 3 MB, [rows, 16]
    placed = huge_pages.place(mid)
    if not huge_pages.supported():
        assert placed is mid
        return
    assert placed is not mid and placed.shape == mid.shape and placed.dtype == mid.dtype
    np.testing.assert_array_equal(placed, mid)
    assert placed.flags.c_contiguous and placed.flags.writeable and placed.ctypes.data % huge_pages.ALIGN == 0
    for other in (np.zeros(100, np.float32), np.zeros(huge_pages.LARGEST, np.uint8)):  # too small, or NumPy's own
        assert huge_pages.place(other) is other


@pytest.mark.skipif(not (huge_pages.supported() and THP.exists() and "[never]" not in THP.read_text()),
                    reason="this kernel gives no transparent huge pages")
def test_placed_arrays_sit_on_huge_pages(monkeypatch):
    monkeypatch.setattr(huge_pages, "_chunk", None)  # a chunk of its own, whatever earlier tests left
    placed = huge_pages.place(np.ones(3 << 20, np.uint8))
    entry = _mapping_of(placed.ctypes.data)
    assert entry is not None and entry["AnonHugePages"] >= 2048, entry


@pytest.mark.skipif(not huge_pages.supported(), reason="no madvise(MADV_HUGEPAGE) on this platform")
def test_a_chunk_is_unmapped_once_its_arrays_are_gone(monkeypatch):
    monkeypatch.setattr(huge_pages, "_chunk", None)  # not the chunk an engine of an earlier test still holds
    size = 3 << 20
    first = [huge_pages.place(np.full(size, i, np.uint8)) for i in range(huge_pages.CHUNK // size)]
    later = huge_pages.place(np.ones(size, np.uint8))  # past the first chunk's end: a new chunk
    address = first[0].ctypes.data
    assert _mapping_of(address) is not None
    first.clear()
    gc.collect()
    assert _mapping_of(address) is None and _mapping_of(later.ctypes.data) is not None


@pytest.mark.skipif(not huge_pages.supported(), reason="no madvise(MADV_HUGEPAGE) on this platform")
def test_a_kernel_without_transparent_huge_pages_still_gets_the_copy(monkeypatch):
    """madvise(MADV_HUGEPAGE) fails with EINVAL on a kernel built without them: the weights then sit on plain pages."""
    import mmap

    class NoHugePages(mmap.mmap):
        def madvise(self, *args):
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(mmap, "mmap", NoHugePages)
    monkeypatch.setattr(huge_pages, "_chunk", None)  # the next place() maps a new chunk
    mid = np.arange(1 << 18, dtype=np.float32)  # 1 MB
    placed = huge_pages.place(mid)
    assert placed is not mid
    np.testing.assert_array_equal(placed, mid)
