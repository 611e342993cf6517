"""Real gateway and engine subprocesses on free ports, for the end-to-end test modules.

Not a test module: `test_serving`, `test_prompts_over_http`, `test_faults`, `test_security`, `test_hostile_input` and
`test_multihost` import it (pytest puts tests/ on sys.path).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.serve_servers import free_port

REPO = pathlib.Path(__file__).resolve().parents[1]
MAX_MODEL_LEN = 512
MAX_PENDING = 8
# One compute thread per worker: two workers must not oversubscribe a small CI machine.
ENGINE_ARGS = ["--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", "0.05", "--max-num-seqs", "16",
               "--threads", "1", "--speculative-config", '{"method":"ngram","num_speculative_tokens":3}']
START_TIMEOUT = 300  # s: model load + JIT warm-up on a cold cache
LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0}  # outlives any test step


@contextlib.contextmanager
def gateway_and_worker(tmp: pathlib.Path, model_path: pathlib.Path, env: dict[str, str] | None = None):
    """A gateway and one ready worker ("w1") for a test module; everything stopped afterwards."""
    c = Cluster(tmp, model_path, env=env)
    c.start("gateway", "gateway")
    c.start_worker("w1")
    try:
        c.wait_workers(1)
        yield c
    finally:
        c.stop_all()


class Cluster:
    """Subprocesses of one test module, their logs, and small HTTP helpers.

    `env` is added to every process's environment; `host` is where the gateway's HTTP listens.
    """

    def __init__(self, tmp: pathlib.Path, model_path: pathlib.Path, env: dict[str, str] | None = None,
                 host: str = "127.0.0.1", max_pending: int = MAX_PENDING):
        self.tmp, self.model_path = tmp, model_path
        self.port = free_port()
        self.zmq_port = free_port(exclude=(self.port,))
        self.url = f"http://{host}:{self.port}"
        pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        self.env = {**os.environ, "PYTHONPATH": pythonpath, "PYTHONUNBUFFERED": "1", "SPECULANT_HOST": host,
                    "SPECULANT_PORT": str(self.port),
                    "SPECULANT_ENGINE_ENDPOINT": f"tcp://127.0.0.1:{self.zmq_port}",
                    "SPECULANT_MAX_PENDING": str(max_pending), **(env or {})}
        self.procs: dict[str, subprocess.Popen] = {}
        self.killed: set[str] = set()  # killed (or stopped) on purpose by a test

    def start(self, name: str, *args: str, env: dict[str, str] | None = None,
              prefix: tuple[str, ...] = ()) -> subprocess.Popen:
        """`python -m engine.cli ARGS`, logging to NAME.log; `prefix` wraps it (e.g. `ip netns exec`)."""
        self.killed.discard(name)
        with open(self.tmp / f"{name}.log", "ab") as log:  # the child keeps its own copy of the fd
            proc = subprocess.Popen([*prefix, sys.executable, "-m", "engine.cli", *args],
                                    env={**self.env, **(env or {})}, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        self.procs[name] = proc
        return proc

    def start_worker(self, worker_id: str, *extra: str, env: dict[str, str] | None = None,
                     prefix: tuple[str, ...] = ()) -> subprocess.Popen:
        return self.start(worker_id, "engine", "--model", str(self.model_path), "--worker-id", worker_id,
                          *ENGINE_ARGS, *extra, env=env, prefix=prefix)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        self.killed.add(name)
        self.procs[name].send_signal(sig)

    def log(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.tmp.glob("*.log"))

    def wait_workers(self, num_workers: int, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                assert name in self.killed or proc.poll() is None, f"{name} exited early\n{self.logs()}"
            status, body, _ = http(f"{self.url}/health")
            if status in (200, 503) and body["workers"] == num_workers:
                return
            time.sleep(0.3)
        pytest.fail(f"no {num_workers} ready workers after {timeout} s\n{self.logs()}")

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        _, text, _ = http(f"{self.url}/metrics")
        return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
                   if s.name == name and labels.items() <= s.labels.items())

    def wait_idle(self, timeout: float = 20) -> None:
        """Running requests and KV usage back to 0 (both come from worker heartbeats)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.metric("speculant:num_requests_running") == 0 and self.metric("speculant:kv_cache_usage_perc") == 0:
                return
            time.sleep(0.2)
        pytest.fail(f"engine not idle after {timeout} s\n{self.logs()}")


def http(url: str, body: dict | bytes | None = None, headers: dict[str, str] | None = None, timeout: float = 120):
    """(status, parsed JSON or text, headers) without raising on 4xx/5xx; status None if nobody listens."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw, headers = resp.status, resp.read(), resp.headers
    except urllib.error.HTTPError as err:
        status, raw, headers = err.code, err.read(), err.headers
    except (urllib.error.URLError, ConnectionError):
        return None, None, {}
    is_json = headers.get("Content-Type", "").startswith("application/json")
    return status, json.loads(raw) if is_json else raw.decode(), headers


class Stream:
    """One streamed completion read in the background: its events, whether [DONE] came, and when."""

    def __init__(self, session: aiohttp.ClientSession, url: str, body: dict):
        self.events: list[dict] = []
        self.event_times: list[float] = []
        self.done = False
        self.failure: str | None = None  # the connection broke
        self.first = asyncio.Event()
        self.task = asyncio.create_task(self._read(session, url, body))

    async def _read(self, session, url: str, body: dict) -> None:
        try:
            async with session.post(f"{url}/v1/completions", json={**body, "stream": True}) as resp:
                assert resp.status == 200, await resp.text()
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        self.events.append(json.loads(line[6:]))
                        self.event_times.append(time.monotonic())
                        self.first.set()
                    elif line.startswith(b"data: [DONE]"):
                        self.done = True
        except (TimeoutError, aiohttp.ClientError) as exc:
            self.failure = type(exc).__name__
        finally:
            self.first.set()

    @property
    def error(self) -> dict | None:
        return next((e["error"] for e in self.events if "error" in e), None)

    @property
    def finish_reason(self) -> str | None:
        return next((e["choices"][0]["finish_reason"] for e in self.events
                     if e.get("choices") and e["choices"][0]["finish_reason"]), None)

    @property
    def text(self) -> str:
        return "".join(e["choices"][0]["text"] for e in self.events if e.get("choices"))
