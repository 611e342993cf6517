"""The README's first command, verbatim, in a fresh clone: it must serve and stream.

Run by `.ci/run` after the suite (`pytest -m newcomer`); the default run deselects it (it installs
the project into a new venv and compiles the kernels from cold: several minutes).

Nothing here is friendlier than a newcomer's machine: a fresh `git clone` of this checkout, the
caller's PATH without any virtualenv, no PYTHONPATH, and XDG_CACHE_HOME pointed at an empty folder,
so the model download, Numba's kernel cache and pip's wheel cache all start empty.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from servers import REPO, http

pytestmark = pytest.mark.newcomer

SERVE_TIMEOUT = 1500  # s: venv, pip install, model download, cold kernel compile


def readme_first_command() -> str:
    """The command in the README's first ```bash block (the "Set up and run" line)."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    lines = [line for line in block.splitlines() if line.strip() and not line.startswith("#")]
    assert len(lines) == 1, f"the README's first block should be one command, got {lines}"
    return lines[0]


def fresh_clone(dest: pathlib.Path) -> None:
    if (REPO / ".git").exists():
        subprocess.run(["git", "clone", "--quiet", str(REPO), str(dest)], check=True)
    else:  # a source tree without history: copy what a clone would hold
        shutil.copytree(REPO, dest, ignore=shutil.ignore_patterns(".venv", "__pycache__", ".env", "*.egg-info"))


def newcomer_env(cache: pathlib.Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    venv_bin = str(pathlib.Path(sys.prefix) / "bin")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p and p != venv_bin)
    env["XDG_CACHE_HOME"] = str(cache)
    return env


def streamed_tokens(url: str) -> list[str]:
    """`curl -N` of the README's chat request: the content deltas, in order, until [DONE]."""
    body = {"stream": True, "max_tokens": 16, "messages": [{"role": "user", "content": "Name three colors."}]}
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    tokens = []
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        for line in resp:
            if line.startswith(b"data: [DONE]"):
                return tokens
            if line.startswith(b"data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                tokens += [delta["content"]] if delta.get("content") else []
    pytest.fail(f"the stream ended without [DONE] after {tokens}")


@pytest.mark.timeout(SERVE_TIMEOUT + 120)
def test_readme_first_command_serves_and_streams_in_a_fresh_clone(tmp_path):
    command = readme_first_command()
    clone = tmp_path / "speculant"
    fresh_clone(clone)
    url = "http://127.0.0.1:8000"  # .env.example's address
    assert http(f"{url}/health")[0] is None, "something already listens on :8000"
    log_path = tmp_path / "newcomer.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(["bash", "-c", command], cwd=clone, env=newcomer_env(tmp_path / "cache"),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + SERVE_TIMEOUT
        while http(f"{url}/health")[0] != 200:
            assert proc.poll() is None, f"the command exited ({proc.returncode})\n{log_path.read_text()[-5000:]}"
            assert time.monotonic() < deadline, f"not healthy in {SERVE_TIMEOUT} s\n{log_path.read_text()[-5000:]}"
            time.sleep(1)
        tokens = streamed_tokens(url)
        assert len(tokens) >= 2 and "".join(tokens).strip(), tokens
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail("honcho did not stop within 30 s of SIGTERM")
    assert "gateway.1" in log_path.read_text() and "engine.1" in log_path.read_text()
