"""The real gateway app with no engine worker: every client mistake is a 4xx OpenAI error naming the field."""

from __future__ import annotations

import pytest
import zmq
import zmq.asyncio
from aiohttp.test_utils import TestClient, TestServer

from benchmarks.serve_servers import free_port
from engine.serving import protocol
from gateway.app import create_app
from gateway.config import GatewayConfig

BODY_LIMIT = 64 * 1024
CHAT = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def config():
    return GatewayConfig(endpoint=f"tcp://127.0.0.1:{free_port()}", max_body_bytes=BODY_LIMIT)


@pytest.fixture(scope="module")
async def client(config):
    server = TestServer(create_app(config), handler_cancellation=True)
    async with TestClient(server) as c:
        yield c


def assert_openai_error(body: dict, param: str | None) -> None:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["param"] == param


# (endpoint, body, param named in the 400)
BAD_REQUESTS = [
    ("completions", {"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "a", "max_tokens": "8"}, "max_tokens"),
    ("completions", {"prompt": "a", "temperature": 2.5}, "temperature"),
    ("completions", {"prompt": "a", "temperature": -0.1}, "temperature"),
    ("completions", {"prompt": "a", "temperature": "hot"}, "temperature"),
    ("completions", {"prompt": "a", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "a", "top_p": 1.5}, "top_p"),
    ("completions", {"prompt": "a", "top_k": -2}, "top_k"),
    ("completions", {"prompt": "a", "seed": 1.5}, "seed"),
    ("completions", {"prompt": "a", "seed": -1}, "seed"),
    ("completions", {"prompt": "a", "seed": True}, "seed"),
    ("completions", {"prompt": "a", "stop": [""]}, "stop"),
    ("completions", {"prompt": "a", "stop": [str(i) for i in range(17)]}, "stop"),
    ("completions", {"prompt": "a", "stop": [1]}, "stop[0]"),
    ("completions", {"prompt": "a", "stop_token_ids": [-1]}, "stop_token_ids"),
    ("completions", {"prompt": "a", "logprobs": 21}, "logprobs"),
    ("completions", {"prompt": "a", "logprobs": True}, "logprobs"),
    ("completions", {"prompt": "a", "n": 0}, "n"),
    ("completions", {"prompt": "a", "n": 17}, "n"),
    ("completions", {"prompt": "a", "best_of": 3}, "best_of"),
    ("completions", {"prompt": "a", "n": 2, "best_of": 3}, "best_of"),
    ("completions", {"prompt": "a", "echo": "yes"}, "echo"),
    ("completions", {"prompt": "a", "echo": False, "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "a", "suffix": "z"}, "suffix"),
    ("completions", {"prompt": "a", "use_beam_search": True}, "use_beam_search"),
    ("completions", {"prompt": "a", "bad_words": [""]}, "bad_words"),
    ("completions", {"prompt": "a", "bad_words": ["x"] * 129}, "bad_words"),
    ("completions", {"prompt": "a", "prompt_logprobs": -1}, "prompt_logprobs"),
    ("completions", {"prompt": "a", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("completions", {"prompt": "a", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("chat/completions", {"messages": CHAT, "prompt_logprobs": -2}, "prompt_logprobs"),
    ("chat/completions", {"messages": CHAT, "prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    ("chat/completions", {"messages": CHAT, "length_penalty": 0.5}, "length_penalty"),
    ("chat/completions", {"messages": CHAT, "skip_special_tokens": "no"}, "skip_special_tokens"),
    ("chat/completions", {"messages": CHAT, "priority": 2**31}, "priority"),
    ("completions", {"prompt": "a", "priority": "high"}, "priority"),
    ("chat/completions", {"messages": CHAT, "echo": "yes"}, "echo"),
    ("chat/completions", {"messages": CHAT, "echo": True, "max_tokens": 0}, "max_tokens"),
    ("chat/completions", {"messages": CHAT, "continue_final_message": True, "add_generation_prompt": True},
     "add_generation_prompt"),
    ("chat/completions", {"messages": CHAT, "continue_final_message": "yes"}, "continue_final_message"),
    ("completions", {"prompt": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("completions", {"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {"prompt": "a", "speculative": {"n_max": -1}}, "speculative.n_max"),
    ("completions", {"prompt": "a", "speculative.n_max": 65}, "speculative.n_max"),
    ("completions", {"prompt": "a", "presence_penalty": -2.5}, "presence_penalty"),
    ("completions", {"prompt": "a", "frequency_penalty": 3}, "frequency_penalty"),
    ("completions", {"prompt": "a", "logit_bias": {"5": 101}}, "logit_bias"),
    ("completions", {"prompt": "a", "repetition_penalty": 0}, "repetition_penalty"),
    ("chat/completions", {"messages": CHAT, "repetition_penalty": 2.5}, "repetition_penalty"),
    ("completions", {"prompt": "a", "min_p": 1.5}, "min_p"),
    ("chat/completions", {"messages": CHAT, "min_p": -0.1}, "min_p"),
    ("completions", {"prompt": "a", "logit_bias": {"-5": 1.0}}, "logit_bias"),
    ("completions", {"prompt": "a", "logit_bias": {"a": 1.0}}, "logit_bias"),
    ("completions", {"prompt": "a", "logit_bias": {"5": "up"}}, "logit_bias"),
    ("completions", {"prompt": "a", "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    ("chat/completions", {"messages": CHAT, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ("chat/completions", {"messages": CHAT, "chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ("completions", {"prompt": "a", "min_tokens": -1}, "min_tokens"),
    ("completions", {"prompt": "a", "max_tokens": 5, "min_tokens": 6}, "min_tokens"),
    ("chat/completions", {"messages": CHAT, "max_completion_tokens": 5, "min_tokens": 6}, "min_tokens"),
    ("completions", {"prompt": "a", "allowed_token_ids": []}, "allowed_token_ids"),
    ("completions", {"prompt": "a", "allowed_token_ids": [-3]}, "allowed_token_ids"),
    ("completions", {"prompt": "a", "allowed_token_ids": "5"}, "allowed_token_ids"),
    ("completions", {"prompt": "a", "model": 5}, "model"),
    ("completions", {"max_tokens": 4}, "prompt"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": ["a", ""]}, "prompt[1]"),
    ("completions", {"prompt": [[1, 2], [3, -1]]}, "prompt[1]"),
    ("completions", {"prompt": ["a"] * 65}, "prompt"),
    ("completions", {"prompt": [1, -2]}, "prompt"),
    ("completions", {"prompt": {"text": "a"}}, "prompt"),
    ("chat/completions", {}, "messages"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": "hi"}, "messages"),
    ("chat/completions", {"messages": [{"content": "hi"}]}, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ("chat/completions", {"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content"),
    ("chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat/completions", {"messages": CHAT, "max_tokens": -5}, "max_tokens"),
    ("chat/completions", {"messages": CHAT, "logprobs": 3}, "logprobs"),
    ("chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat/completions", {"messages": CHAT, "n": -1}, "n"),
    ("chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools[0].function"),
    ("chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools[0].function.name"),
    ("chat/completions", {"messages": CHAT, "tools": [TOOL], "tool_choice": "any"}, "tool_choice"),
    ("chat/completions", {"messages": [*CHAT, {"role": "assistant", "content": "ok"},
                                       {"role": "tool", "tool_call_id": "call_1", "content": "x"}]},
     "messages[2].tool_call_id"),
    ("chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema"}}, "response_format"),
    ("chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "objectx"}}}}, "response_format"),
    ("chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "schema": "object"}}}, "response_format.json_schema.schema"),
    ("completions", {"prompt": "a", "response_format": {"type": "yaml"}}, "response_format"),
    ("completions", {"prompt": "a", "speculant": {"regex": "("}}, "speculant.regex"),
    ("completions", {"prompt": "a", "speculant": {"grammar": "start: x"}}, "speculant.grammar"),
    ("completions", {"prompt": "a", "speculant": {"grammar": "x", "grammar_syntax": "ebnf"}},
     "speculant.grammar_syntax"),
    ("completions", {"prompt": "a", "response_format": {"type": "json_object"}, "speculant": {"regex": "a"}},
     "speculant.regex"),
    ("chat/completions", {"messages": CHAT, "stream": True, "stream_options": {"include_usage": 1}},
     "stream_options.include_usage"),
]


@pytest.mark.parametrize("endpoint,body,param", BAD_REQUESTS, ids=[f"{e}:{p}" for e, _, p in BAD_REQUESTS])
async def test_bad_request_names_the_field(client, endpoint, body, param):
    resp = await client.post(f"/v1/{endpoint}", json=body)
    assert resp.status == 400
    body = await resp.json()
    assert_openai_error(body, param)
    assert body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b'"text"', b"\xff\xfe"])
async def test_unparseable_body_is_400(client, raw):
    resp = await client.post("/v1/completions", data=raw, headers={"Content-Type": "application/json"})
    assert resp.status == 400
    assert_openai_error(await resp.json(), None)


@pytest.mark.parametrize("extra", [{}, {"response_format": {"type": "json_object"}},
                                   {"speculant": {"regex": "[0-9]+", "provenance": True}},
                                   {"tools": [TOOL], "tool_choice": "required"},
                                   {"presence_penalty": 0.5, "frequency_penalty": -1, "logit_bias": {"5": -100}},
                                   {"repetition_penalty": 1.2, "min_p": 0.05}, {"n": 3, "seed": 5},
                                   {"min_tokens": 4, "allowed_token_ids": [5, 6]},
                                   {"chat_template_kwargs": {"enable_thinking": False}},
                                   {"continue_final_message": True}, {"prompt_logprobs": 0}, {"prompt_logprobs": 20},
                                   {"continue_final_message": True, "add_generation_prompt": False},
                                   {"include_stop_str_in_output": True, "truncate_prompt_tokens": 5,
                                    "use_beam_search": False, "skip_special_tokens": True, "bad_words": ["x"]}])
async def test_valid_request_without_workers_is_503(client, extra):
    resp = await client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4, **extra})
    assert resp.status == 503
    assert resp.headers["Retry-After"] == "1"
    body = await resp.json()
    assert_openai_error(body, None)
    assert body["error"]["code"] == "no_workers"


async def test_the_openai_clients_parse_request_passes_validation(client):
    """`client.chat.completions.parse(response_format=PydanticModel)` as the SDK sends it (a strict
    json_schema with additionalProperties false and $defs/$ref) compiles to a grammar: it gets past
    validation to the 503 of a gateway with no worker, after one new entry in the grammar cache."""
    import openai
    from pydantic import BaseModel

    from gateway.constraints import CACHE

    class Item(BaseModel):
        name: str
        count: int

    class Order(BaseModel):
        items: list[Item]
        note: str | None

    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)
    misses = CACHE.misses
    for _ in range(2):
        with pytest.raises(openai.APIStatusError) as err:
            await sdk.chat.completions.parse(model="m", messages=CHAT, response_format=Order)
        assert err.value.status_code == 503, err.value.body
    assert CACHE.misses == misses + 1  # compiled once, then served from the cache
    await sdk.close()


async def test_the_openai_clients_tool_request_passes_validation(client):
    """Tools, a forced choice and a replayed call with its answer, as the SDK sends them: on to the 503."""
    import openai
    from pydantic import BaseModel

    class GetTime(BaseModel):
        timezone: str

    call = {"id": "call_1", "type": "function", "function": {"name": "GetTime", "arguments": '{"timezone": "UTC"}'}}
    messages = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)
    for choice in ["auto", "required", {"type": "function", "function": {"name": "GetTime"}}]:
        with pytest.raises(openai.APIStatusError) as err:
            await sdk.chat.completions.create(model="m", messages=messages, tool_choice=choice,
                                              tools=[openai.pydantic_function_tool(GetTime)])
        assert err.value.status_code == 503, err.value.body
    await sdk.close()


async def test_health_is_503_until_a_worker_is_ready(client):
    resp = await client.get("/health")
    assert resp.status == 503
    assert (await resp.json())["workers"] == 0


async def test_oversized_body_is_413(client):
    resp = await client.post("/v1/completions", json={"prompt": "x" * (BODY_LIMIT + 10)})
    assert resp.status == 413
    body = await resp.json()
    assert_openai_error(body, None)
    assert body["error"]["code"] == "request_too_large"


async def test_unknown_route_is_404_json(client):
    resp = await client.post("/v1/embeddings", json={})
    assert resp.status == 404
    assert_openai_error(await resp.json(), None)


async def test_wrong_method_is_405_json(client):
    resp = await client.get("/v1/completions")
    assert resp.status == 405
    assert_openai_error(await resp.json(), None)


async def test_models_lists_nothing_without_workers(client):
    resp = await client.get("/v1/models")
    assert resp.status == 200
    assert await resp.json() == {"object": "list", "data": []}


async def test_version(client):
    resp = await client.get("/version")
    assert resp.status == 200
    assert isinstance((await resp.json())["version"], str)


async def test_metrics_exposes_vllm_style_names(client):
    resp = await client.get("/metrics")
    assert resp.status == 200
    text = await resp.text()
    for name in [
        "speculant:time_to_first_token_seconds",
        "speculant:inter_token_latency_seconds",
        "speculant:e2e_request_latency_seconds",
        "speculant:request_queue_time_seconds",
        "speculant:num_requests_running",
        "speculant:num_requests_waiting",
        "speculant:kv_cache_usage_perc",
        "speculant:prompt_tokens_total",
        "speculant:generation_tokens_total",
        "speculant:request_success_total",
        "speculant:spec_decode_num_drafts_total",
        "speculant:spec_decode_num_draft_tokens_total",
        "speculant:spec_decode_num_accepted_tokens_total",
        "speculant:spec_decode_num_accepted_tokens_per_pos_total",
        "speculant:spec_decode_num_grammar_tokens_total",
    ]:
        assert f"# TYPE {name} " in text, name


def test_config_reads_environment_and_rejects_bad_values():
    class Args:
        host = port = endpoint = served_model_name = None

    env = {"SPECULANT_PORT": "9001", "SPECULANT_ENGINE_ENDPOINT": "ipc:///tmp/x", "PORT": "5100"}
    config = GatewayConfig.from_args(Args(), env)
    assert (config.port, config.endpoint) == (9001, "ipc:///tmp/x")  # PORT (set by honcho) is ignored
    with pytest.raises(ValueError, match="SPECULANT_MAX_PENDING"):
        GatewayConfig.from_args(Args(), {"SPECULANT_MAX_PENDING": "many"})
    with pytest.raises(ValueError, match="worker_timeout"):
        GatewayConfig(worker_timeout=0)


async def test_bad_frames_are_dropped_and_an_unknown_worker_gets_a_hello(client, config):
    """A peer that was connected before the gateway (re)started is asked to introduce itself."""
    ctx = zmq.asyncio.Context()
    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.IDENTITY, b"old-worker")
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(config.endpoint)
    try:
        await peer.send(b"\x00not msgpack")
        await peer.send_multipart([b"two", b"frames"])
        await peer.send(protocol.encode(protocol.Heartbeat(worker_id="old-worker", stats=protocol.WorkerStats())))
        assert await peer.poll(5000), "no reply from the gateway"
        hello = protocol.worker_decoder.decode(await peer.recv())
        assert isinstance(hello, protocol.GatewayHello) and hello.live_request_ids == []
        resp = await client.get("/health")  # still serving, and the peer is not a ready worker
        assert resp.status == 503
    finally:
        peer.close()
        ctx.term()
