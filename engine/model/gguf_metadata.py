"""A GGUF file parsed directly: its key/value metadata, and its tensors as views of one memory map.

gguf.GGUFReader builds a NumPy memmap view for every element of every metadata array: 3-6 s per
open on the default model's 49,152-token vocabulary, paid by every engine start and worker. This
parse reads the same file in ~0.3 s. Tensors come back as gguf's own ReaderTensor, with the dtypes
and shapes GGUFReader gives them (tests/test_model_files.py checks both against GGUFReader).
Little-endian files only (what llama.cpp and gguf-py write).
"""

from __future__ import annotations

import mmap
import os
import struct
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, ReaderTensor
from gguf.quants import quant_shape_to_byte_shape

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32  # bytes, unless general.alignment says otherwise

# GGUF value types (gguf spec): scalar code -> struct format.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
Q = GGMLQuantizationType
# tensor types GGUFReader hands out as arrays of elements; every other type as its raw bytes
_ELEMENT_DTYPES = {Q.F16: np.float16, Q.F32: np.float32, Q.F64: np.float64, Q.I8: np.int8, Q.I16: np.int16,
                   Q.I32: np.int32, Q.I64: np.int64}


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The key/value metadata of a GGUF file, without touching tensors. Numeric arrays come back as
    lists, strings decoded as UTF-8."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return _header(buf, path)[0]


def read_gguf(path: str | os.PathLike) -> tuple[dict[str, Any], list[ReaderTensor]]:
    """(metadata, tensors) of a GGUF file; tensor data are read-only views of one memory map of it."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        metadata, num_tensors, offset = _header(buf, path)
        infos = []
        for _ in range(num_tensors):
            name, offset = _read_string(buf, offset)
            (n_dims,) = struct.unpack_from("<I", buf, offset)
            dims = np.array(struct.unpack_from(f"<{n_dims}Q", buf, offset + 4), np.uint64)
            kind, tensor_offset = struct.unpack_from("<IQ", buf, offset + 4 + 8 * n_dims)
            offset += 4 + 8 * n_dims + 12
            infos.append((name, dims, kind, tensor_offset))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_start = -(-offset // alignment) * alignment
    data = np.memmap(path, np.uint8, mode="r")
    if len({name for name, *_ in infos}) != len(infos):
        raise ValueError(f"model: {os.fspath(path)!r} names a tensor twice")
    return metadata, [_tensor(data, data_start, *info) for info in infos]


def _tensor(data: np.memmap, data_start: int, name: str, dims: np.ndarray, kind: int, offset: int) -> ReaderTensor:
    ggml_type = GGMLQuantizationType(kind)
    n_elements = int(np.prod(dims))
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    n_bytes = n_elements * type_size // block_size
    shape = tuple(int(d) for d in reversed(dims.tolist()))
    start = data_start + offset
    raw = data[start : start + n_bytes]
    if ggml_type in _ELEMENT_DTYPES:
        values = raw.view(_ELEMENT_DTYPES[ggml_type]).reshape(shape)
    else:
        values = raw.reshape(quant_shape_to_byte_shape(shape, ggml_type))
    return ReaderTensor(name=name, tensor_type=ggml_type, shape=dims, n_elements=n_elements, n_bytes=n_bytes,
                        data_offset=start, data=values, field=None)


def _header(buf: mmap.mmap, path) -> tuple[dict[str, Any], int, int]:
    """(metadata, number of tensors, offset of the first tensor info)."""
    if buf[:4] != GGUF_MAGIC:
        raise ValueError(f"model: {os.fspath(path)!r} is not a GGUF file")
    version, num_tensors, num_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"model: unsupported GGUF version {version} in {os.fspath(path)!r}")
    offset = 24
    metadata: dict[str, Any] = {}
    for _ in range(num_kv):
        key, offset = _read_string(buf, offset)
        (value_type,) = struct.unpack_from("<I", buf, offset)
        metadata[key], offset = _read_value(buf, offset + 4, value_type)
    return metadata, num_tensors, offset


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
