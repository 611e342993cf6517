"""Faults with real processes: killed workers, gateway restarts and SIGTERM, slow and stalled clients.

One gateway and two workers serve the module; tests run in file order and leave the
cluster whole (a killed process is restarted before the test ends). The gateway's
worker timeout is 30 s here, so a loss noticed within seconds proves it came from the
socket's disconnect, not from the heartbeat timeout. The gateway tests' long streams ask for
~2,000 tokens, so they outlive the 2 s grace (and a gateway restart) however fast the kernels get;
480 tokens once fit inside a 3 s grace.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time

import aiohttp
import pytest
from servers import Cluster, Stream, http

pytestmark = pytest.mark.slow
WORKER_TIMEOUT = 30.0
GRACE = 2.0
MAX_MODEL_LEN = 2048  # room for a stream that outlives the grace period
WORKER_ARGS = ("--max-model-len", str(MAX_MODEL_LEN))
STORY = {"prompt": "Tell me a long story about a lighthouse keeper.", "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_path):
    env = {"SPECULANT_WORKER_TIMEOUT": str(WORKER_TIMEOUT), "SPECULANT_SHUTDOWN_GRACE": str(GRACE)}
    c = Cluster(tmp_path_factory.mktemp("faults"), model_path, env=env)
    c.start("gateway", "gateway")
    c.start_worker("w1", *WORKER_ARGS)
    c.start_worker("w2", *WORKER_ARGS)
    try:
        c.wait_workers(2)
        yield c
    finally:
        c.stop_all()


@pytest.fixture(scope="module")
def model(cluster):
    return http(f"{cluster.url}/v1/models")[1]["data"][0]["id"]


async def start_streams(session, cluster, model, bodies: list[dict]) -> list[Stream]:
    streams = [Stream(session, cluster.url, {"model": model, **STORY, **body}) for body in bodies]
    await asyncio.wait_for(asyncio.gather(*(s.first.wait() for s in streams)), 120)
    return streams


async def complete(cluster, model, prompt: str, max_tokens: int = 8) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    status, reply, _ = await asyncio.to_thread(http, f"{cluster.url}/v1/completions", body)
    assert status == 200, reply
    return reply


# ---------------------------------------------------------------- slow and stalled clients


def stalled_request(cluster, body: dict) -> socket.socket:
    """Sends a streaming request on a socket with a tiny receive buffer, and does not read (yet)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", cluster.port))
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload))
    return sock


def read_body(sock: socket.socket) -> bytes:
    """The whole chunked HTTP/1.1 response body (the server closes: we sent Connection: close)."""
    sock.settimeout(60)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"chunked" in head.lower()
    body = b""
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return body
        body, rest = body + rest[:size], rest[size + 2:]


def assert_whole_stream(raw: bytes, num_tokens: int) -> None:
    events = [json.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: {")]
    assert raw.count(b"data: [DONE]") == 1 and raw.rstrip().endswith(b"data: [DONE]")
    assert sum(len(e["choices"][0]["logprobs"]["tokens"]) for e in events) == num_tokens
    assert events[-1]["choices"][0]["finish_reason"] == "length"


async def test_slow_and_stalled_clients_do_not_hold_up_others(cluster, model):
    # top-20 logprobs make each chunk ~1 KB, so these replies are large.
    heavy = {"model": model, **STORY, "max_tokens": 200, "logprobs": 20, "stream": True}
    stalled = stalled_request(cluster, heavy)
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{cluster.url}/v1/completions", json=heavy) as slow:
            first = await slow.content.readline()  # then read nothing more until the others are done
            others = [await complete(cluster, model, f"Question {i}: what is {i} plus {i}?", 12) for i in range(4)]
            assert all(r["usage"]["completion_tokens"] == 12 for r in others)
            deadline = time.monotonic() + 120
            while cluster.metric("speculant:num_requests_running") > 0:  # the engine finished both
                assert time.monotonic() < deadline, cluster.logs()
                await asyncio.sleep(0.3)
            await complete(cluster, model, "Still serving?")
            rest = b"".join([chunk async for chunk in slow.content.iter_any()])
    assert_whole_stream(first + rest, 200)  # nothing lost or repeated for the slow reader ...
    assert_whole_stream(await asyncio.to_thread(read_body, stalled), 200)  # ... or the one that waited
    stalled.close()
    deadline = time.monotonic() + 30
    while cluster.metric("speculant:num_requests_pending") > 0:
        assert time.monotonic() < deadline, cluster.logs()
        await asyncio.sleep(0.2)
    await asyncio.to_thread(cluster.wait_idle)


# ---------------------------------------------------------------- a worker killed mid-stream


async def test_killed_worker_fails_only_its_requests_promptly_and_a_restart_rejoins(cluster, model):
    async with aiohttp.ClientSession() as session:
        streams = await start_streams(session, cluster, model, [{"max_tokens": 300}] * 4)
        killed_at = time.monotonic()
        cluster.kill("w2")
        await asyncio.wait_for(asyncio.gather(*(s.task for s in streams)), 180)
    lost = [s for s in streams if s.error is not None]
    finished = [s for s in streams if s.error is None]
    assert len(lost) == 2 and len(finished) == 2  # fewest-in-flight routing put two on each worker
    for s in lost:
        assert s.error["code"] == "engine_worker_lost" and s.done  # error event, then [DONE]
        error_at = s.event_times[-1]
        assert error_at - killed_at < WORKER_TIMEOUT / 3  # the disconnect, not the 30 s heartbeat timeout
    assert all(s.finish_reason == "length" and s.done and s.failure is None for s in finished)
    status, body, _ = http(f"{cluster.url}/health")
    assert (status, body["workers"]) == (200, 1)

    cluster.start_worker("w2", *WORKER_ARGS)  # same id, new process, same gateway
    await asyncio.to_thread(cluster.wait_workers, 2)
    async with aiohttp.ClientSession() as session:
        # long enough to span several worker heartbeats (0.5 s), which carry the running gauge: with 64 tokens
        # a fast machine finished one of the two between two beats, and its worker was never seen running
        streams = await start_streams(session, cluster, model, [{"max_tokens": 300}] * 2)
        seen_running = set()
        while not all(s.task.done() for s in streams):
            for worker in ("w1", "w2"):
                if cluster.metric("speculant:num_requests_running", engine=worker) > 0:
                    seen_running.add(worker)
            await asyncio.sleep(0.1)
    assert all(s.finish_reason == "length" for s in streams)
    assert seen_running == {"w1", "w2"}  # the restarted worker took one of the two


# ---------------------------------------------------------------- the gateway stopped or killed


async def test_sigterm_lets_streams_finish_within_the_grace_then_ends_the_rest(cluster, model):
    gateway = cluster.procs["gateway"]
    async with aiohttp.ClientSession() as session:
        short, long = await start_streams(session, cluster, model, [{"max_tokens": 24}, {"max_tokens": MAX_MODEL_LEN - 64}])
        num_before = len(long.events)
        cluster.kill("gateway", signal.SIGTERM)
        await asyncio.sleep(0.5)
        status, _, _ = await asyncio.to_thread(http, f"{cluster.url}/v1/completions",
                                               {"model": model, "prompt": "new", "max_tokens": 2})
        assert status in (None, 503)  # refused: the listener is closed
        await asyncio.wait_for(asyncio.gather(short.task, long.task), 60)
    assert short.finish_reason == "length" and short.done and short.error is None
    assert len(long.events) > num_before + 1  # it kept streaming during the grace period ...
    assert long.error["code"] == "gateway_shutdown" and long.done  # ... then got a clear end
    assert "shutting down" in long.error["message"]
    assert await asyncio.to_thread(gateway.wait, 30) == 0
    cluster.start("gateway", "gateway")
    await asyncio.to_thread(cluster.wait_workers, 2)
    await asyncio.to_thread(cluster.wait_idle)  # the ended request was aborted on its worker


async def test_killed_gateway_workers_rejoin_a_new_one_and_drop_orphaned_requests(cluster, model):
    async with aiohttp.ClientSession() as session:
        streams = await start_streams(session, cluster, model, [{"max_tokens": MAX_MODEL_LEN - 64}] * 2)
        cluster.kill("gateway")
        await asyncio.wait_for(asyncio.gather(*(s.task for s in streams)), 30)
    assert all(s.failure is not None and not s.done for s in streams)  # the connections broke
    stale_logs = sum(cluster.log(w).count("aborting 1 stale requests") for w in ("w1", "w2"))
    cluster.start("gateway", "gateway")
    await asyncio.to_thread(cluster.wait_workers, 2)  # ZeroMQ reconnected them; hello -> Ready
    await asyncio.to_thread(cluster.wait_idle)  # no KV block held for the dead gateway's requests
    deadline = time.monotonic() + 10
    while sum(cluster.log(w).count("aborting 1 stale requests") for w in ("w1", "w2")) < stale_logs + 2:
        assert time.monotonic() < deadline, cluster.logs()
        await asyncio.sleep(0.2)
    reply = await complete(cluster, model, "Hello again")
    assert reply["usage"]["completion_tokens"] >= 1
