"""A gateway and one engine worker as subprocesses, for `speculant bench serve`."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Self

REPO = pathlib.Path(__file__).resolve().parents[1]
START_TIMEOUT = 300.0  # s: model load + JIT warm-up on a cold cache
KEEP_ENV = ("SPECULANT_API_KEY", "SPECULANT_LOG_LEVEL", "SPECULANT_WORKER_TIMEOUT")
# A long prefill step on a busy machine can outlast the gateway's default 5 s heartbeat timeout;
# a benchmark measures throughput, so it should not lose its only worker to that.
WORKER_TIMEOUT = "60"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def num_ready_workers(url: str) -> int | None:
    """Workers the gateway's /health reports; None while nobody answers."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
            return json.loads(resp.read())["workers"]
    except urllib.error.HTTPError as err:  # 503: up, but no worker yet
        return json.loads(err.read() or b"{}").get("workers", 0)
    except (urllib.error.URLError, OSError, ValueError):
        return None


def wait_ready(url: str, timeout: float, procs: list[subprocess.Popen] = (), logs: str = "") -> None:
    deadline = time.monotonic() + timeout
    while (num_ready_workers(url) or 0) < 1:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args[3]} exited with {proc.returncode} while starting; logs in {logs}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no engine worker ready at {url} after {timeout:g} s; logs in {logs}")
        time.sleep(0.3)


class LocalServers:
    """`with LocalServers(engine_args) as s:` a ready gateway at `s.url`; both processes stop on exit."""

    def __init__(self, engine_args, log_dir: str | None = None):
        self.engine_args = engine_args
        self.log_dir = pathlib.Path(log_dir or tempfile.mkdtemp(prefix="speculant-bench-serve-"))
        self.port, self.zmq_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen] = []

    def _env(self) -> dict:
        """Our flags define the servers: other SPECULANT_* settings (engine defaults) are not inherited."""
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("SPECULANT_") or k in KEEP_ENV}
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        return {"SPECULANT_WORKER_TIMEOUT": WORKER_TIMEOUT, **inherited, "PYTHONPATH": path,
                "PYTHONUNBUFFERED": "1", "SPECULANT_PORT": str(self.port), "SPECULANT_MAX_PENDING": "4096",
                "SPECULANT_ENGINE_ENDPOINT": f"tcp://127.0.0.1:{self.zmq_port}"}

    def _worker_flags(self) -> list[str]:
        a = self.engine_args
        flags = ["--model", str(a.model), "--max-model-len", str(a.max_model_len), "--kv-cache-memory",
                 str(a.kv_cache_memory), "--max-num-seqs", str(a.max_num_seqs), "--threads", str(a.threads),
                 "--max-num-batched-tokens", str(a.max_num_batched_tokens), "--worker-id", "bench-w1"]
        if a.speculative_config:
            flags += ["--speculative-config", a.speculative_config]
        return flags

    def _start(self, name: str, args: list[str]) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"{name}.log", "wb") as log:
            self.procs.append(subprocess.Popen([sys.executable, "-m", "engine.cli", name, *args], env=self._env(),
                                               cwd=REPO, stdout=log, stderr=subprocess.STDOUT))

    def __enter__(self) -> Self:
        try:
            self._start("gateway", [])
            self._start("engine", self._worker_flags())
            wait_ready(self.url, START_TIMEOUT, self.procs, str(self.log_dir))
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
