"""Hostile HTTP input against a real gateway + worker: every answer is a success or a 4xx OpenAI error.

Bodies for the fuzz come from the gateway's own `/openapi.json`: each documented field gets a
value of its documented type or an arbitrary JSON value, so the fuzz reaches validation, the
worker and the response path, not only the JSON parser. Never a 5xx, never a hung connection.
"""

from __future__ import annotations

import json
import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from servers import gateway_and_worker, http

pytestmark = pytest.mark.slow
BODY_LIMIT = 64 * 1024
VOCAB_SIZE = 49152  # SmolLM2
FUZZ = settings(max_examples=30, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
MAX_FUZZ_TOKENS = 6  # generation cost, not coverage: huge and negative values are kept as they are

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_path):
    env = {"SPECULANT_MAX_BODY_BYTES": str(BODY_LIMIT)}
    with gateway_and_worker(tmp_path_factory.mktemp("hostile"), model_path, env) as c:
        yield c


@pytest.fixture(scope="module")
def spec(cluster):
    status, body, _ = http(f"{cluster.url}/openapi.json")
    assert status == 200
    return body


def test_the_spec_documents_every_api_route():
    from gateway.app import create_app
    from gateway.config import GatewayConfig
    from gateway.openapi import openapi_spec

    app = create_app(GatewayConfig())
    routes = {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}
    api = {(m, path) for m, path in routes if path.startswith("/v1/") or path in ("/health", "/version", "/metrics")}
    documented = {(m.upper(), path) for path, ops in openapi_spec()["paths"].items() for m in ops}
    assert api <= documented and documented <= routes


# ---------------------------------------------------------------- checking answers


def assert_openai_error(status: int, body, path: str) -> None:
    assert 400 <= status < 500, (status, body, path)
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str), error


def assert_well_formed(status, body, path: str, stream: bool) -> None:
    assert status is not None, f"no answer from {path} (hung or dropped connection)"
    if status >= 400:
        assert_openai_error(status, body, path)
        return
    assert status == 200
    if stream:  # SSE: JSON events, possibly one error event, then exactly one [DONE] at the end
        events = [line[6:] for line in body.split("\n") if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]" and events.count("[DONE]") == 1, body[-300:]
        for event in map(json.loads, events[:-1]):
            assert "error" in event or event["choices"] is not None
    elif path.startswith("/v1/") and "completions" in path:
        assert body["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")


def post(cluster, path: str, body, headers: dict | None = None):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http(cluster.url + path, raw, headers=headers, timeout=60)


# ---------------------------------------------------------------- bodies from the OpenAPI document


def from_schema(schema: dict, components: dict, depth: int = 0) -> st.SearchStrategy:
    """A value of the schema's type (roughly), or any JSON value at all."""
    if "$ref" in schema:
        return from_schema(components[schema["$ref"].rsplit("/", 1)[-1]], components, depth)
    if "anyOf" in schema:
        return st.one_of([from_schema(s, components, depth) for s in schema["anyOf"]])
    kind = schema.get("type")
    typed = {"string": st.text(max_size=30), "integer": st.integers(min_value=-3, max_value=2**64),
             "number": st.floats(allow_nan=False, allow_infinity=False), "boolean": st.booleans(),
             "null": st.none()}.get(kind)
    if kind == "array" and depth < 3:
        typed = st.lists(from_schema(schema.get("items", {}), components, depth + 1), max_size=4)
    if kind == "object" and "properties" in schema and depth < 3:
        typed = object_of(schema, components, depth + 1)
    return st.one_of(typed, json_values) if typed is not None else json_values


def object_of(schema: dict, components: dict, depth: int = 0) -> st.SearchStrategy:
    props = {name: from_schema(s, components, depth) for name, s in schema["properties"].items()}
    required = {name: props.pop(name) for name in schema.get("required", []) if name in props}
    return st.fixed_dictionaries(required, optional=props)


def cheap(body):
    """Valid token budgets are capped so that a fuzz example costs milliseconds of generation."""
    if not isinstance(body, dict):
        return body
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and MAX_FUZZ_TOKENS < value <= 10**6:
            body[name] = MAX_FUZZ_TOKENS
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = MAX_FUZZ_TOKENS  # chat's default is "up to the context length"
    return body


COMMON = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 100),
    "seed": st.integers(0, 2**63 - 1), "ignore_eos": st.booleans(), "stream": st.booleans(),
    "stop": st.one_of(st.text(min_size=1, max_size=4), st.lists(st.text(min_size=1, max_size=4), max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=3),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "speculative": st.fixed_dictionaries({"n_max": st.integers(0, 8)}),
    "speculant": st.fixed_dictionaries({"provenance": st.booleans()}),
}
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant"]),
                                 "content": st.text(max_size=40)})
VALID = {
    "/v1/completions": ({"prompt": st.one_of(st.text(min_size=1, max_size=40),
                                             st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=16))},
                        {**COMMON, "logprobs": st.integers(0, 5)}),
    "/v1/chat/completions": ({"messages": st.lists(MESSAGE, min_size=1, max_size=3)},
                             {**COMMON, "logprobs": st.just(True), "top_logprobs": st.integers(0, 5)}),
}


def _stream_options_need_stream(body: dict) -> dict:
    if body.get("stream") is not True:
        body.pop("stream_options", None)
    return body


def generation_bodies(spec: dict, path: str) -> st.SearchStrategy:
    """Mostly valid bodies (they reach the worker and stream back), some with one field fuzzed from
    its documented schema, and some arbitrary JSON."""
    components = spec["components"]["schemas"]
    schema = components[spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"][
        "$ref"].rsplit("/", 1)[-1]]
    required, optional = VALID[path]
    valid = st.fixed_dictionaries({**required, "max_tokens": st.integers(1, MAX_FUZZ_TOKENS)},
                                  optional=optional).map(_stream_options_need_stream)
    fields = sorted(schema["properties"])
    one_fuzzed = st.tuples(valid, st.sampled_from(fields)).flatmap(
        lambda pair: from_schema(schema["properties"][pair[1]], components).map(
            lambda value: cheap({**pair[0], pair[1]: value})))
    return st.one_of(valid, valid, one_fuzzed, one_fuzzed, from_schema(schema, components).map(cheap), json_values)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_fuzzed_generation_bodies_get_a_success_or_a_4xx(cluster, spec, path):
    assert path in spec["paths"]

    @FUZZ
    @given(body=generation_bodies(spec, path))
    def check(body):
        status, reply, _ = post(cluster, path, body)
        assert_well_formed(status, reply, path, stream=isinstance(body, dict) and body.get("stream") is True)

    check()


def test_fuzzed_bytes_and_methods_on_every_route(cluster, spec):
    paths = sorted(spec["paths"])
    methods = ["GET", "POST", "PUT", "DELETE", "PATCH"]

    @settings(FUZZ, max_examples=60)
    @given(path=st.sampled_from(paths), method=st.sampled_from(methods), body=st.binary(max_size=200))
    def check(path, method, body):
        import urllib.request  # a bare request: any method, any bytes

        req = urllib.request.Request(cluster.url + path, data=body or None, method=method)
        status, reply, _ = http_any(req)
        assert status is not None and status < 500 or (path == "/health" and status == 503), (status, path)
        if status >= 400:
            assert_openai_error(status, reply, path)

    check()


def http_any(req):
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            status, raw, headers = resp.status, resp.read(), resp.headers
    except urllib.error.HTTPError as err:
        status, raw, headers = err.code, err.read(), err.headers
    is_json = headers.get("Content-Type", "").startswith("application/json")
    return status, json.loads(raw) if is_json else raw, headers


# ---------------------------------------------------------------- explicit hostile cases


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


EXPLICIT = [
    # (name, path, raw body, expected status, param named in the error or None)
    ("over the size limit", "/v1/completions", b'{"prompt": "' + b"a" * (BODY_LIMIT + 1) + b'"}', 413, None),
    ("deeply nested prompt", "/v1/completions", b'{"prompt": ' + nested(20_000) + b"}", 400, None),
    ("deeply nested unknown field", "/v1/completions", b'{"prompt": "a", "x": ' + nested(20_000) + b"}", 400,
     None),
    ("deeply nested message", "/v1/chat/completions", b'{"messages": ' + nested(20_000) + b"}", 400,
     "messages[0]"),
    ("invalid UTF-8", "/v1/completions", b'{"prompt": "\xff\xfe caf\xc3"}', 400, None),
    ("invalid UTF-8 in chat", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}', 400, None),
    ("lone surrogate escape", "/v1/completions", rb'{"prompt": "a\udc80"}', 400, None),
    ("not an object", "/v1/completions", b"[1, 2, 3]", 400, None),
    ("empty body", "/v1/completions", b"", 400, None),
]
NUMBERS = [
    ({"max_tokens": 10**30}, "max_tokens"), ({"max_tokens": -5}, "max_tokens"), ({"max_tokens": 1e308}, "max_tokens"),
    ({"temperature": 1e308}, "temperature"), ({"temperature": -1e-300}, "temperature"),
    ({"top_k": 10**20}, "top_k"), ({"top_k": -(10**20)}, "top_k"), ({"seed": 2**64}, "seed"),
    ({"seed": -(2**70)}, "seed"), ({"logprobs": 10**12}, "logprobs"), ({"n": 10**20}, "n"),
    ({"stop_token_ids": [2**70]}, "stop_token_ids"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [VOCAB_SIZE]}, "stop_token_ids"),
    ({"prompt": [2**64]}, "prompt"), ({"prompt": [2**31]}, "prompt"), ({"prompt": [VOCAB_SIZE]}, "prompt"),
    ({"prompt": [1, -1]}, "prompt"), ({"prompt": [[VOCAB_SIZE + 7]]}, "prompt"),
    ({"stop": [f"s{i}" for i in range(5000)]}, "stop"), ({"stop": ["x" * 10_000]}, "stop"),
    ({"speculative": "fast"}, "speculative"), ({"speculative": {"n_max": "3"}}, "speculative.n_max"),
    ({"speculative": {"n_max": -1}}, "speculative.n_max"), ({"speculative": {"n_max": 10**20}}, "speculative.n_max"),
    ({"speculative": {"method": "no such method!"}}, "speculative.method"), ({"speculative": {"n_max": 2, "proposer": "x"}},
                                                            "speculative"),
    ({"speculative.n_max": 1.5}, "speculative.n_max"), ({"speculant": {"provenance": "yes"}}, "speculant.provenance"),
]


@pytest.mark.parametrize("name, path, raw, status, param", EXPLICIT, ids=[c[0] for c in EXPLICIT])
def test_malformed_bodies(cluster, name, path, raw, status, param):
    got, reply, _ = post(cluster, path, raw)
    assert got == status, reply
    assert_openai_error(got, reply, path)
    assert reply["error"]["param"] == param


@pytest.mark.parametrize("fields, param", NUMBERS, ids=[json.dumps(f)[:40] for f, _ in NUMBERS])
def test_out_of_range_values_name_their_field(cluster, fields, param):
    body = {"prompt": "Hello", "max_tokens": 2, **fields}
    got, reply, _ = post(cluster, "/v1/completions", body)
    assert_openai_error(got, reply, "/v1/completions")
    assert reply["error"]["param"] == param, reply


def test_a_chunked_body_over_the_limit_is_refused_without_reading_it_all(cluster):
    """No Content-Length: the gateway must stop at the limit, not buffer whatever comes."""
    with socket.create_connection(("127.0.0.1", cluster.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b'{"prompt": "' + b"a" * 8000
        try:
            for _ in range(4 * BODY_LIMIT // len(chunk)):
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                chunk = b"a" * 8000
        except (BrokenPipeError, ConnectionResetError):
            pass  # the gateway answered and closed before we were done
        reply = sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 413")


def test_an_http10_stream_request_is_served_or_refused_cleanly(cluster):
    """HTTP/1.0 has no chunked encoding: the stream must still not become a 500."""
    body = json.dumps({"prompt": "Hi", "max_tokens": 3, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", cluster.port), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    status = int(reply.split(b" ", 2)[1])
    assert status == 200 and reply.rstrip().endswith(b"data: [DONE]") or 400 <= status < 500, reply[:300]


def test_still_serving_after_all_that(cluster):
    status, reply, _ = post(cluster, "/v1/completions", {"prompt": "Hello", "max_tokens": 3})
    assert status == 200 and reply["usage"]["completion_tokens"] >= 1
    assert http(f"{cluster.url}/health")[1]["workers"] == 1
