"""`speculant bench peers` on a tiny budget: one prompt, a few tokens, the peers that are installed.

The Speculant-only path (every peer reported as not installed) runs everywhere; each peer's own
test is skipped where its package is missing.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.isolated import exit_status
from benchmarks.peers import main
from benchmarks.peers_systems import NOT_INSTALLED, PEERS

MAX_TOKENS = 6
PROMPT = {"category": "code_edit", "id": "rename",
          "prompt": "Rename f to g:\n```python\ndef f(x):\n    return x + 1\n\nprint(f(2))\n```"}


def run_bench(tmp_path, methods: str) -> tuple[dict, str]:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps(PROMPT) + "\n")
    out = tmp_path / "out"
    argv = ["--prompts", str(prompts), "--max-tokens", str(MAX_TOKENS), "--threads", "1", "--methods", methods,
            "--max-model-len", "256", "--kv-cache-memory", "0.05", "--out", str(out)]
    assert main(argv) == 0
    return json.loads((out / "peers.json").read_text()), (out / "peers.md").read_text()


def _system(result: dict, name: str) -> dict:
    (system,) = [s for s in result["systems"] if s["system"] == name]
    return system


def _rows(result: dict, name: str) -> list[dict]:
    return [r for r in result["rows"] if r["system"] == name]


def test_speculant_only_when_no_peer_is_installed(tmp_path, monkeypatch, capsys):
    for module in ("llama_cpp", "transformers"):
        monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    result, md = run_bench(tmp_path, "ngram,suffix")
    for name in PEERS:
        assert _system(result, name)["status"] == NOT_INSTALLED
        assert _rows(result, name) == [{"system": name, "mode": None, "status": NOT_INSTALLED}]
        assert f"| {name} | {NOT_INSTALLED} |" in md
    assert NOT_INSTALLED in capsys.readouterr().out
    ours = _rows(result, "speculant")
    assert [r["mode"].split()[0] for r in ours] == ["plain", "ngram", "suffix"]
    (best,) = [r for r in ours if r["best"]]
    assert best["decode_tok_s"] == max(r["decode_tok_s"] for r in ours[1:])  # the faster method of this run
    assert best["vs_speculant_best"] == pytest.approx(1.0) and ours[0]["vs_speculant_plain"] == pytest.approx(1.0)
    for r in ours[1:]:
        assert r["same_as_plain"] == 1  # greedy speculation is lossless
        assert r["vs_speculant_plain"] == pytest.approx(r["decode_tok_s"] / ours[0]["decode_tok_s"])


@pytest.fixture(scope="module")
def with_peers(tmp_path_factory):
    """One run with whichever peers are installed (Speculant with ngram only, to stay cheap)."""
    return run_bench(tmp_path_factory.mktemp("bench_peers"), "ngram")


def _check_peer(result: dict, name: str) -> None:
    system = _system(result, name)
    assert system["status"] == "ok", system["status"]
    assert system["same_prompt_ids"] == 1  # its tokenizer turns the shared text into our prompt ids
    plain, lookup = system["modes"]
    assert (plain["speculative"], lookup["speculative"]) == (False, True)
    assert lookup["same_as_plain"] in (0, 1)
    ours = {r["mode"]: r for r in _rows(result, "speculant")}
    for mode in (plain, lookup):
        assert 1 <= mode["output_tokens"] <= MAX_TOKENS and mode["wall_s"] > 0
        assert mode["decode_tok_s"] == pytest.approx(1000 / mode["tpot_ms"])
        row = next(r for r in _rows(result, name) if r["mode"] == mode["mode"])
        assert row["vs_speculant_plain"] == pytest.approx(mode["decode_tok_s"] / ours["plain"]["decode_tok_s"])
    outputs = system["outputs"][plain["mode"]]
    assert list(outputs) == [PROMPT["id"]]


def test_llama_cpp_plain_and_prompt_lookup(request):
    pytest.importorskip("llama_cpp")
    result, md = request.getfixturevalue("with_peers")  # only built where a peer is installed
    _check_peer(result, "llama.cpp")
    assert isinstance(_system(result, "llama.cpp")["outputs"]["plain"][PROMPT["id"]], str)  # compared as text
    assert "| llama.cpp | prompt lookup K=10 |" in md


def test_transformers_plain_and_prompt_lookup(request):
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    result, md = request.getfixturevalue("with_peers")
    _check_peer(result, "transformers")
    ids = _system(result, "transformers")["outputs"]["plain"][PROMPT["id"]]
    assert all(isinstance(t, int) for t in ids)  # compared as token ids
    assert "| transformers | prompt lookup K=10 |" in md


def test_a_crashing_child_is_reported_with_its_signal():
    """A peer runs in its own process; one that dies of a signal is named as crashed, not fatal."""
    crash = subprocess.run([sys.executable, "-c", "import ctypes; ctypes.string_at(0)"])  # a real SIGSEGV
    assert exit_status(crash.returncode) == "crashed (signal 11, SIGSEGV)"
    assert exit_status(3) == "failed (exit status 3)"


@pytest.mark.parametrize("argv, flag", [
    (["--peers", "vllm"], "--peers"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--methods", "none"], "--methods"),
    (["--methods", "nosuchproposer"], "nosuchproposer"),
])
def test_bad_flags_name_the_flag(argv, flag, capsys):
    assert main(argv) == 2
    assert flag in capsys.readouterr().err
