"""Gateway and workers on three "hosts" (network namespaces joined by veth links) over CurveZMQ.

    test process (10.B.0.1) --veth-- [gateway ns: 10.B.0.2, 10.B.1.1, 10.B.2.1]
                                         |--veth-- [w1 ns: 10.B.1.2]
                                         |--veth-- [w2 ns: 10.B.2.2]

The gateway binds `tcp://*` (allowed only because Curve keys are set); each worker has its own
key pair. Cutting one worker's link ends its request with an error and leaves the other worker's
untouched; when the link comes back, the cut-off worker has dropped its orphaned request and joins
again. Needs root and `ip netns`
(iproute2); skips cleanly elsewhere. Run just these: `pytest -m netns`.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time

import aiohttp
import pytest
from servers import Cluster, Stream, http

from engine.serving import zmq_security

pytestmark = [pytest.mark.slow, pytest.mark.netns]
ZMQ_PORT = 5557  # inside the gateway's namespace nothing else listens
WORKER_TIMEOUT = 3.0
TAG = f"spc{os.getpid() % 100000}"  # interface and namespace names: at most 15 characters
SUBNET = f"10.{100 + os.getpid() % 100}"


def ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", "netns", "exec", ns, "ip", *args] if ns else ["ip", *args]
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


class Hosts:
    """Three namespaces and their links; `delete` removes everything (also after a partial setup)."""

    def __init__(self):
        self.gw, self.w1, self.w2 = f"{TAG}gw", f"{TAG}w1", f"{TAG}w2"
        self.made: list[str] = []
        self.http_host = f"{SUBNET}.0.2"

    def create(self) -> None:
        for ns in (self.gw, self.w1, self.w2):
            ip("netns", "add", ns)
            self.made.append(ns)
            ip("link", "set", "lo", "up", ns=ns)
        ip("link", "add", f"{TAG}h", "type", "veth", "peer", "name", f"{TAG}g0", "netns", self.gw)
        ip("addr", "add", f"{SUBNET}.0.1/24", "dev", f"{TAG}h")
        ip("link", "set", f"{TAG}h", "up")
        ip("addr", "add", f"{SUBNET}.0.2/24", "dev", f"{TAG}g0", ns=self.gw)
        ip("link", "set", f"{TAG}g0", "up", ns=self.gw)
        for i, ns in ((1, self.w1), (2, self.w2)):
            ip("link", "add", f"{TAG}g{i}", "netns", self.gw, "type", "veth", "peer", "name", f"{TAG}a{i}",
               "netns", ns)
            ip("addr", "add", f"{SUBNET}.{i}.1/24", "dev", f"{TAG}g{i}", ns=self.gw)
            ip("link", "set", f"{TAG}g{i}", "up", ns=self.gw)
            ip("addr", "add", f"{SUBNET}.{i}.2/24", "dev", f"{TAG}a{i}", ns=ns)
            ip("link", "set", f"{TAG}a{i}", "up", ns=ns)

    def set_worker_link(self, i: int, up: bool) -> None:
        ns = self.w1 if i == 1 else self.w2
        ip("link", "set", f"{TAG}a{i}", "up" if up else "down", ns=ns)

    def delete(self) -> None:
        for ns in self.made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", f"{TAG}h"], capture_output=True, timeout=30)  # gone with its peer


@pytest.fixture(scope="module")
def hosts():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 (`ip netns`)")
    h = Hosts()
    try:
        h.create()
    except (subprocess.CalledProcessError, OSError) as exc:
        h.delete()
        detail = (getattr(exc, "stderr", None) or b"").decode(errors="replace").strip() or str(exc)
        pytest.skip(f"cannot create network namespaces here: {detail}")
    yield h
    h.delete()


@pytest.fixture(scope="module")
def cluster(hosts, tmp_path_factory, model_path):
    keys = tmp_path_factory.mktemp("multihost-keys")
    zmq_security.keygen(str(keys))  # gateway + "worker" (w1)
    zmq_security.keygen(str(keys), "host2")  # w2's own pair
    env = {"SPECULANT_CURVE_DIR": str(keys), "SPECULANT_WORKER_TIMEOUT": str(WORKER_TIMEOUT)}
    c = Cluster(tmp_path_factory.mktemp("multihost"), model_path, env=env, host=hosts.http_host)
    c.start("gateway", "gateway", env={"SPECULANT_ENGINE_ENDPOINT": f"tcp://*:{ZMQ_PORT}"},
            prefix=("ip", "netns", "exec", hosts.gw))
    for i, ns in ((1, hosts.w1), (2, hosts.w2)):
        env = {"SPECULANT_ENGINE_ENDPOINT": f"tcp://{SUBNET}.{i}.1:{ZMQ_PORT}",
               "SPECULANT_CURVE_NAME": "worker" if i == 1 else "host2"}
        # A long context, so the victim's request surely outlives the link timeouts on any machine.
        c.start_worker(f"w{i}", "--max-model-len", "2048", "--kv-cache-memory", "0.25", env=env,
                       prefix=("ip", "netns", "exec", ns))
    try:
        c.wait_workers(2)
        yield c
    finally:
        c.stop_all()


def test_workers_on_other_hosts_join_over_curve(cluster):
    assert "(Curve)" in cluster.log("gateway")
    status, body, _ = http(f"{cluster.url}/v1/completions", {"prompt": "Hello", "max_tokens": 3})
    assert status == 200 and body["usage"]["completion_tokens"] >= 1


async def running_on(cluster, worker_ids: tuple[str, ...]) -> str:
    """The worker whose heartbeat reports a running request (call it only after `wait_idle`)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        busy = [w for w in worker_ids if cluster.metric("speculant:num_requests_running", engine=w) > 0]
        if len(busy) == 1:
            return busy[0]
        await asyncio.sleep(0.1)
    raise AssertionError(f"no single busy worker\n{cluster.logs()}")


async def test_a_cut_link_fails_only_that_workers_requests(hosts, cluster):
    model = http(f"{cluster.url}/v1/models")[1]["data"][0]["id"]
    story = {"model": model, "prompt": "Write a long story about the sea.", "temperature": 0, "ignore_eos": True}
    # No drafting: the long request must outlive the link timeouts on any machine.
    long_body = {**story, "max_tokens": 1900, "speculative": {"n_max": 0}}
    # The running gauges come from heartbeats (0.5 s): right after the previous test, the worker that served
    # it may still report its request. Once both report none, only the long request's worker can turn busy.
    await asyncio.to_thread(cluster.wait_idle)
    async with aiohttp.ClientSession() as session:
        long = Stream(session, cluster.url, long_body)
        await asyncio.wait_for(long.first.wait(), 120)
        victim = await running_on(cluster, ("w1", "w2"))
        short = Stream(session, cluster.url, {**story, "max_tokens": 60})  # fewest in flight: the other worker
        await asyncio.wait_for(short.first.wait(), 120)
        hosts.set_worker_link(int(victim[1]), up=False)
        await asyncio.wait_for(asyncio.gather(long.task, short.task), 180)
    assert long.error["code"] == "engine_worker_lost" and long.done  # an error event, then [DONE]
    assert short.error is None and short.finish_reason == "length" and short.done
    assert http(f"{cluster.url}/health")[1]["workers"] == 1

    # Cut off for longer than the timeout, the victim dropped its orphaned request by itself.
    deadline = time.monotonic() + 60
    while "cut off from the gateway" not in cluster.log(victim):
        assert time.monotonic() < deadline, cluster.logs()
        await asyncio.sleep(0.2)
    hosts.set_worker_link(int(victim[1]), up=True)
    await asyncio.to_thread(cluster.wait_workers, 2, 60)
    await asyncio.to_thread(cluster.wait_idle)
    status, reply, _ = http(f"{cluster.url}/v1/completions", {"prompt": "Back again", "max_tokens": 3})
    assert status == 200 and reply["usage"]["completion_tokens"] >= 1
