"""A gateway and one engine worker as subprocesses, for `speculant bench serve`."""

from __future__ import annotations

import json
import os
import pathlib
import random
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


# Below the range the kernel hands to outgoing connections (Linux 32768-60999, BSD/macOS 49152-65535).
# A port from bind(0) lies inside it, so any client socket opened before the server binds can take
# it; CI once lost a gateway that way ("address already in use").
PORT_RANGE = (20000, 32768)
START_TRIES = 3  # fresh ports after a server that could not bind


def free_port(exclude: tuple[int, ...] = ()) -> int:
    """A port on 127.0.0.1 that nobody holds now, outside the ephemeral range."""
    for _ in range(1000):
        port = random.randrange(*PORT_RANGE)
        if port in exclude:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {PORT_RANGE[0]}-{PORT_RANGE[1] - 1}")


def log_tail(path: pathlib.Path, chars: int = 2000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def num_ready_workers(url: str) -> int | None:
    """Workers the gateway's /health reports; None while nobody answers."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
            return json.loads(resp.read())["workers"]
    except urllib.error.HTTPError as err:  # 503: up, but no worker yet
        return json.loads(err.read() or b"{}").get("workers", 0)
    except (urllib.error.URLError, OSError, ValueError):
        return None


class ServerExited(RuntimeError):
    def __init__(self, name: str, returncode: int, logs: str):
        tail = log_tail(pathlib.Path(logs) / f"{name}.log") if logs else ""
        super().__init__(f"{name} exited with {returncode} while starting; logs in {logs}\n{tail}")
        self.name, self.returncode = name, returncode

    @property
    def port_taken(self) -> bool:
        """The gateway exits 1 when its HTTP port or engine endpoint is already bound."""
        return self.name == "gateway" and self.returncode == 1


def wait_ready(url: str, timeout: float, procs: list[subprocess.Popen] = (), logs: str = "") -> None:
    deadline = time.monotonic() + timeout
    while (num_ready_workers(url) or 0) < 1:
        for proc in procs:
            if proc.poll() is not None:
                raise ServerExited(proc.args[3], proc.returncode, logs)
        if time.monotonic() > deadline:
            raise RuntimeError(f"no engine worker ready at {url} after {timeout:g} s; logs in {logs}")
        time.sleep(0.3)


class LocalServers:
    """`with LocalServers(engine_args) as s:` a ready gateway at `s.url`; both processes stop on exit."""

    def __init__(self, engine_args, log_dir: str | None = None):
        self.engine_args = engine_args
        self.log_dir = pathlib.Path(log_dir or tempfile.mkdtemp(prefix="speculant-bench-serve-"))
        self.procs: list[subprocess.Popen] = []
        self._pick_ports()

    def _pick_ports(self) -> None:
        self.port = free_port()
        self.zmq_port = free_port(exclude=(self.port,))
        self.url = f"http://127.0.0.1:{self.port}"

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
        with open(self.log_dir / f"{name}.log", "ab") as log:  # a retry keeps the failed try's lines
            self.procs.append(subprocess.Popen([sys.executable, "-m", "engine.cli", name, *args], env=self._env(),
                                               cwd=REPO, stdout=log, stderr=subprocess.STDOUT))

    def __enter__(self) -> Self:
        for attempt in range(START_TRIES):
            try:
                self._start("gateway", [])
                self._start("engine", self._worker_flags())
                wait_ready(self.url, START_TIMEOUT, self.procs, str(self.log_dir))
                return self
            except ServerExited as exc:
                self.stop()
                if not exc.port_taken or attempt + 1 == START_TRIES:
                    raise
                self.procs.clear()
                self._pick_ports()
            except BaseException:
                self.stop()
                raise

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
