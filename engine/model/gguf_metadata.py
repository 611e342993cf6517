"""The key/value metadata of a GGUF file, parsed directly (no tensors, no gguf.GGUFReader)."""

from __future__ import annotations

import mmap
import os
import struct
from typing import Any

GGUF_MAGIC = b"GGUF"

# GGUF value types (gguf spec): scalar code -> struct format.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The key/value metadata of a GGUF file, without touching tensors.

    gguf.GGUFReader builds a memmap view per array element and takes ~2 s on this vocabulary;
    the tokenizer needs only the metadata, which a direct parse reads in well under 0.1 s.
    Numeric arrays come back as lists, strings decoded as UTF-8.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != GGUF_MAGIC:
            raise ValueError(f"model: {os.fspath(path)!r} is not a GGUF file")
        version, _num_tensors, num_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"model: unsupported GGUF version {version} in {os.fspath(path)!r}")
        offset = 24
        metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key, offset = _read_string(buf, offset)
            (value_type,) = struct.unpack_from("<I", buf, offset)
            metadata[key], offset = _read_value(buf, offset + 4, value_type)
        return metadata


def _read_string(buf: mmap.mmap, offset: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buf, offset)
    start = offset + 8
    return buf[start : start + length].decode("utf-8", errors="replace"), start + length


def _read_value(buf: mmap.mmap, offset: int, value_type: int) -> tuple[Any, int]:
    if value_type == _STRING:
        return _read_string(buf, offset)
    if value_type in _SCALAR_FORMATS:
        fmt = "<" + _SCALAR_FORMATS[value_type]
        return struct.unpack_from(fmt, buf, offset)[0], offset + struct.calcsize(fmt)
    if value_type != _ARRAY:
        raise ValueError(f"model: unknown GGUF value type {value_type}")
    item_type, count = struct.unpack_from("<IQ", buf, offset)
    offset += 12
    if item_type in _SCALAR_FORMATS:
        fmt = f"<{count}{_SCALAR_FORMATS[item_type]}"
        return list(struct.unpack_from(fmt, buf, offset)), offset + struct.calcsize(fmt)
    items = []
    for _ in range(count):
        item, offset = _read_value(buf, offset, item_type)
        items.append(item)
    return items, offset
