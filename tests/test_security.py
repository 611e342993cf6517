"""Security of the serving path, against a real gateway + worker that use API keys and CurveZMQ.

The intruders are raw ZeroMQ peers speaking our real protocol: with no key, an unknown key,
or (for the isolation test) an authorized key misused to answer for another worker's request.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time

import aiohttp
import openai
import pytest
import zmq
import zmq.auth
from servers import MAX_MODEL_LEN, REPO, free_port, gateway_and_worker, http
from zmq.utils.monitor import parse_monitor_message

from engine.serving import protocol, zmq_security

pytestmark = pytest.mark.slow
KEYS = ("key-one-7f3a", "key-two-91bc")
AUTH = {"Authorization": f"Bearer {KEYS[1]}"}
SERVING_PACKAGES = ("engine", "gateway", "proposers")


@pytest.fixture(scope="module")
def key_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("curve") / "keys"
    zmq_security.keygen(str(path))
    zmq_security.keygen(str(path), "spare")  # a second authorized pair, for the raw peers
    return path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_path, key_dir):
    env = {"SPECULANT_API_KEY": ",".join(KEYS), "SPECULANT_CURVE_DIR": str(key_dir)}
    with gateway_and_worker(tmp_path_factory.mktemp("security"), model_path, env) as c:
        yield c


@pytest.fixture(scope="module")
def model(cluster):
    return http(f"{cluster.url}/v1/models", headers=AUTH)[1]["data"][0]["id"]


# ---------------------------------------------------------------- API keys


def assert_unauthorized(status, body, headers, secret: str | None = None) -> None:
    assert status == 401, body
    assert body["error"]["code"] == "invalid_api_key" and body["error"]["type"] == "invalid_request_error"
    assert headers["WWW-Authenticate"].startswith("Bearer")
    if secret:
        assert secret not in json.dumps(body)  # a wrong key is never echoed


def test_every_v1_route_needs_a_valid_key(cluster, model):
    routes = [("/v1/models", None), ("/v1/completions", {"model": model, "prompt": "a", "max_tokens": 1}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 1}),
              ("/v1/speculant/stats", None), ("/v1/no-such-route", None)]
    bad_headers = [{}, {"Authorization": "Bearer wrong-key"}, {"Authorization": f"Basic {KEYS[0]}"},
                   {"Authorization": f"Bearer {KEYS[0][:-1]}"}, {"Authorization": f"Bearer {KEYS[0]}x"},
                   {"Authorization": "Bearer "}]
    for path, body in routes:
        for headers in bad_headers:
            assert_unauthorized(*http(cluster.url + path, body, headers=headers), secret=KEYS[0][:-1])
    for key in KEYS:  # each configured key works
        status, reply, _ = http(f"{cluster.url}/v1/completions", routes[1][1],
                                headers={"Authorization": f"bearer {key}"})
        assert status == 200 and reply["usage"]["completion_tokens"] == 1


def test_probes_and_spec_stay_open(cluster):
    for path in ("/health", "/metrics", "/version", "/openapi.json"):
        assert http(cluster.url + path)[0] == 200, path


def test_openai_client_with_and_without_the_key(cluster, model):
    good = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key=KEYS[0], max_retries=0)
    assert good.completions.create(model=model, prompt="Hi", max_tokens=2).usage.completion_tokens >= 1
    bad = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="sk-not-ours", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.models.list()
    assert info.value.code == "invalid_api_key"


# ---------------------------------------------------------------- CurveZMQ


def raw_peer(cluster, identity: str, keys: tuple[bytes, bytes, bytes] | None):
    """A DEALER on the gateway's endpoint and its monitor; keys = (public, secret, server public) or None."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = keys
    monitor = sock.get_monitor_socket()
    sock.connect(cluster.env["SPECULANT_ENGINE_ENDPOINT"])
    return sock, monitor


def handshake_outcome(monitor: zmq.Socket, timeout: float = 20) -> str:
    """'ok' or 'refused', from the peer's own monitor events (the gateway answered either way)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if monitor.poll(100):
            event = parse_monitor_message(monitor.recv_multipart())["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return "ok"
            if event in (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                         zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
                return "refused"
    return "no answer"


def ready(worker_id: str) -> bytes:
    return protocol.encode(protocol.Ready(worker_id=worker_id, model="intruder-model", max_model_len=64, pid=1))


def num_workers(cluster) -> int:
    return http(f"{cluster.url}/health")[1]["workers"]


def wait_num_workers(cluster, expected: int, timeout: float = 10) -> int:
    deadline = time.monotonic() + timeout
    while (n := num_workers(cluster)) != expected and time.monotonic() < deadline:
        time.sleep(0.1)
    return n


def test_only_authorized_keys_join(cluster, key_dir):
    gateway_public = zmq.auth.load_certificate(key_dir / "gateway.key")[0]
    spare = zmq.auth.load_certificate(key_dir / "spare.key_secret")
    stranger = zmq.curve_keypair()
    impostor_server = zmq.curve_keypair()[0]  # the peer expects some other gateway
    intruders = {"plain": None, "stranger": (*stranger, gateway_public), "mixup": (*spare, impostor_server)}
    peers = {name: raw_peer(cluster, name, keys) for name, keys in intruders.items()}
    for name, (sock, _) in peers.items():
        sock.send(ready(name))
        sock.send(protocol.encode(protocol.Heartbeat(worker_id=name, stats=protocol.WorkerStats())))
    assert {name: handshake_outcome(monitor) for name, (_, monitor) in peers.items()} == dict.fromkeys(
        intruders, "refused")
    # Positive control: the same messages with an authorized key do get through.
    friend, friend_monitor = raw_peer(cluster, "friend", (*spare, gateway_public))
    friend.send(ready("friend"))
    assert handshake_outcome(friend_monitor) == "ok"
    assert wait_num_workers(cluster, 2) == 2  # w1 + friend; none of the intruders
    friend.send(protocol.encode(protocol.Goodbye(worker_id="friend")))
    assert wait_num_workers(cluster, 1) == 1
    models = {m["id"] for m in http(f"{cluster.url}/v1/models", headers=AUTH)[1]["data"]}
    assert "intruder-model" not in models
    log = cluster.log("gateway")
    assert "worker friend ready" in log and not re.search(r"worker (plain|stranger|mixup) ready", log)
    for sock, monitor in [*peers.values(), (friend, friend_monitor)]:
        sock.disable_monitor()
        monitor.close()
        sock.close()


async def test_a_peer_cannot_answer_for_another_workers_request(cluster, model, key_dir):
    """Even an authorized peer cannot write into, or fail, a request routed to another worker."""
    gateway_public = zmq.auth.load_certificate(key_dir / "gateway.key")[0]
    spare = zmq.auth.load_certificate(key_dir / "spare.key_secret")
    body = {"model": model, "prompt": "Count: one two three", "stream": True, "max_tokens": 40,
            "ignore_eos": True, "temperature": 0}
    async with aiohttp.ClientSession(headers=AUTH) as session:
        async with session.post(f"{cluster.url}/v1/completions", json=body) as resp:
            lines = aiter(resp.content)  # one iterator, read in two parts
            events, request_id = [], None
            async for line in lines:
                if line.startswith(b"data: {"):
                    events.append(json.loads(line[6:]))
                    request_id = events[0]["id"]
                    break
            rogue, monitor = raw_peer(cluster, "rogue", (*spare, gateway_public))
            rogue.send(ready("rogue"))
            assert await asyncio.to_thread(wait_num_workers, cluster, 2) == 2
            forged = protocol.Output(request_id=request_id, text="INJECTED", token_ids=[1], finish_reason="stop")
            rogue.send(protocol.encode(protocol.Outputs(items=[forged])))
            rogue.send(protocol.encode(protocol.RequestError(request_id=request_id, message="INJECTED")))
            async for line in lines:
                if line.startswith(b"data: {"):
                    events.append(json.loads(line[6:]))
    rogue.send(protocol.encode(protocol.Goodbye(worker_id="rogue")))
    rogue.disable_monitor()
    monitor.close()
    rogue.close()
    assert all("error" not in e for e in events), events
    assert "INJECTED" not in "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert await asyncio.to_thread(wait_num_workers, cluster, 1) == 1


# ---------------------------------------------------------------- start-up refusals


def run_cli(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.cli", *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def test_plaintext_non_loopback_endpoints_are_refused(cluster, model_path):
    env = {k: v for k, v in cluster.env.items() if k not in ("SPECULANT_CURVE_DIR", "SPECULANT_API_KEY")}
    public = f"tcp://0.0.0.0:{free_port()}"
    gateway = run_cli("gateway", "--port", str(free_port()), "--endpoint", public, env=env)
    assert gateway.returncode == 2 and "SPECULANT_CURVE_DIR" in gateway.stderr, gateway.stderr
    worker = run_cli("engine", "--model", str(model_path), "--endpoint", "tcp://10.255.0.1:5557", env=env)
    assert worker.returncode == 2 and "SPECULANT_ALLOW_INSECURE_ZMQ" in worker.stderr, worker.stderr
    port = free_port()  # the explicit opt-out starts
    opted = subprocess.Popen([sys.executable, "-m", "engine.cli", "gateway", "--port", str(port), "--endpoint",
                              public], env={**env, "SPECULANT_ALLOW_INSECURE_ZMQ": "1"}, cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while http(f"http://127.0.0.1:{port}/health")[0] is None:
            assert opted.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        opted.terminate()
        opted.wait(timeout=15)


def test_a_proposer_outside_the_allowlist_is_refused_at_start(cluster, model_path):
    env = {**cluster.env, "SPECULANT_PROPOSERS": "naive"}  # w1's config asks for ngram
    result = run_cli("engine", "--model", str(model_path), "--max-model-len", str(MAX_MODEL_LEN),
                     "--speculative-config", '{"method": "ngram"}', env=env, timeout=120)
    assert result.returncode == 2
    assert "cannot start the engine: speculative_config.method: unknown proposer 'ngram'" in result.stderr
    assert "not in SPECULANT_PROPOSERS" in result.stderr


def test_no_pickle_anywhere_in_the_serving_packages():
    pattern = re.compile(r"^\s*(import|from)\s+(c?pickle|marshal|dill|cloudpickle|shelve)\b|_pyobj\(|jsonpickle",
                         re.MULTILINE)
    offenders = [str(path.relative_to(REPO)) for package in SERVING_PACKAGES
                 for path in (REPO / package).rglob("*.py") if pattern.search(path.read_text())]
    assert offenders == []


# ---------------------------------------------------------------- request isolation


def test_request_ids_are_made_by_the_gateway(cluster, model):
    body = {"model": model, "prompt": "Hi", "max_tokens": 1, "request_id": "cmpl-mine", "id": "cmpl-mine"}
    ids = set()
    for _ in range(2):
        status, reply, _ = http(f"{cluster.url}/v1/completions", body, headers={**AUTH, "X-Request-Id": "cmpl-mine"})
        assert status == 200
        ids.add(reply["id"])
    assert "cmpl-mine" not in ids and len(ids) == 2 and all(re.fullmatch(r"cmpl-[0-9a-f]{32}", i) for i in ids)


async def test_concurrent_requests_with_a_shared_prefix_see_only_their_own_output(cluster, model):
    """Prompts sharing cached prefix blocks, run together, each get exactly what they get alone."""
    prefix = "Here is a shared system preamble about gardens, rivers and old stone bridges. " * 3
    prompts = [prefix + f"Question {i}: name a colour." for i in range(3)]
    client = openai.AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key=KEYS[0], max_retries=0)

    async def run(prompt: str) -> str:
        reply = await client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
        return reply.choices[0].text

    alone = [await run(p) for p in prompts]
    assert len(set(alone)) > 1  # the answers differ, so a mix-up would show
    together = await asyncio.gather(*(run(p) for p in prompts * 2))
    await client.close()
    assert list(together) == alone * 2
