"""Response and chunk shapes, checked against the openai SDK's own models; SSE bytes; routing; metric deltas."""

from __future__ import annotations

import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from engine.serving import protocol
from gateway import sse
from gateway.errors import OpenAIError
from gateway.metrics import GatewayMetrics
from gateway.openai_schema import decode_chat, decode_completion, param_from_error
from gateway.responses import ResponseBuilder, response, token_bytes, usage_chunk
from gateway.validation import build_generate, validate_chat, validate_completion
from gateway.workers import WorkerTable

TOP = [(5, "lo", -0.1), (6, " there", -2.3)]


def outputs() -> list[protocol.Output]:
    """Two engine steps of one request: a drafted+target pair, then a final token."""
    lp = [protocol.TokenLogprob(5, "lo", -0.1, TOP), protocol.TokenLogprob(6, " there", -0.7, TOP)]
    return [
        protocol.Output("r1", "Hello there", [5, 6], None, 7, 2, lp, [True, False], 1, 3, 1),
        protocol.Output("r1", "!", [9], "stop", 7, 3, [protocol.TokenLogprob(9, "!", -0.5, TOP)], [False], 2, 5, 2),
    ]


def builder(body: bytes, kind: str) -> ResponseBuilder:
    validated = validate_chat(decode_chat(body)) if kind == "chat" else validate_completion(decode_completion(body))
    return ResponseBuilder("id-1", "m", validated.opts)


def test_chat_stream_chunks_parse_as_openai_chunks():
    b = builder(b'{"messages": [{"role": "user", "content": "hi"}], "stream": true, "logprobs": true,'
                b' "top_logprobs": 2, "stream_options": {"include_usage": true}}', "chat")
    (role,) = [ChatCompletionChunk.model_validate(c) for c in b.opening_chunks()]
    assert role.choices[0].delta.role == "assistant" and role.choices[0].finish_reason is None
    chunks = [ChatCompletionChunk.model_validate(b.chunk(out)) for out in outputs()]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello there!"
    assert [c.choices[0].finish_reason for c in chunks] == [None, "stop"]
    assert [t.token for t in chunks[0].choices[0].logprobs.content] == ["lo", " there"]
    assert chunks[0].choices[0].logprobs.content[1].top_logprobs[1].bytes == list(b" there")
    usage = ChatCompletionChunk.model_validate(usage_chunk([b]))
    assert usage.choices == [] and (usage.usage.prompt_tokens, usage.usage.completion_tokens) == (7, 3)
    assert usage.usage.total_tokens == 10
    spec = usage.usage.model_extra["speculative"]
    assert spec == {"num_drafts": 2, "num_draft_tokens": 5, "num_accepted_tokens": 2, "num_grammar_tokens": 0,
                    "mean_acceptance_length": 2.0}
    assert "speculant" not in b.chunk(outputs()[0])  # provenance is opt-in


def test_chat_response_aggregates():
    b = builder(b'{"messages": [{"role": "user", "content": "hi"}]}', "chat")
    for out in outputs():
        b.add(out)
    resp = ChatCompletion.model_validate(response([b]))
    assert resp.choices[0].message.content == "Hello there!"
    assert resp.choices[0].finish_reason == "stop" and resp.choices[0].logprobs is None


def test_completion_logprobs_offsets_run_over_the_whole_answer():
    b = builder(b'{"prompt": "x", "logprobs": 2, "stream": true, "speculant": {"provenance": true}}', "completion")
    first, last = (b.chunk(out) for out in outputs())
    assert first["choices"][0]["logprobs"]["text_offset"] == [0, 2]
    assert last["choices"][0]["logprobs"]["text_offset"] == [8]
    assert last["choices"][0]["logprobs"]["top_logprobs"] == [{"lo": -0.1, " there": -2.3}]
    assert first["speculant"] == {"token_ids": [5, 6], "drafted": [True, False], "grammar": []}
    # (The SDK's Completion model types finish_reason as non-null; its stream parser does not validate.)
    assert first["object"] == "text_completion" and first["choices"][0]["finish_reason"] is None
    whole = Completion.model_validate(response([b]))
    assert whole.choices[0].text == "Hello there!"
    assert whole.choices[0].logprobs.tokens == ["lo", " there", "!"]
    assert whole.choices[0].logprobs.text_offset == [0, 2, 8]


def test_return_tokens_as_token_ids_names_every_logprob_token_by_its_id():
    """vLLM's return_tokens_as_token_ids: tokens and alternatives are "token_id:<id>" in both formats; the chat
    bytes and the completion text offsets stay those of the tokens' text."""
    chat = builder(b'{"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 2,'
                   b' "return_tokens_as_token_ids": true}', "chat")
    completion = builder(b'{"prompt": "x", "logprobs": 2, "return_tokens_as_token_ids": true}', "completion")
    for b in (chat, completion):
        for out in outputs():
            b.add(out)
    content = ChatCompletion.model_validate(response([chat])).choices[0].logprobs.content
    assert [t.token for t in content] == ["token_id:5", "token_id:6", "token_id:9"]
    assert [t.token for t in content[1].top_logprobs] == ["token_id:5", "token_id:6"]
    assert content[1].bytes == list(b" there") and content[1].top_logprobs[1].bytes == list(b" there")
    lp = Completion.model_validate(response([completion])).choices[0].logprobs
    assert lp.tokens == ["token_id:5", "token_id:6", "token_id:9"] and lp.text_offset == [0, 2, 8]
    assert lp.top_logprobs[0] == {"token_id:5": -0.1, "token_id:6": -2.3}


def test_token_bytes_of_partial_characters():
    assert token_bytes("bytes:\\xe2\\x80") == [0xE2, 0x80]
    assert token_bytes("é") == [0xC3, 0xA9]
    assert token_bytes("bytes:plain") == list(b"bytes:plain")


def test_sse_framing_is_exact():
    assert sse.event({"a": 1}) == b'data: {"a":1}\n\n'
    assert sse.DONE == b"data: [DONE]\n\n"
    assert json.loads(sse.event(OpenAIError(503, "gone").body())[6:])["error"]["type"] == "server_error"


def test_max_tokens_is_bounded_by_the_worker_context():
    validated = validate_chat(decode_chat(b'{"messages": [{"role": "user", "content": "hi"}]}'))
    assert build_generate("r", validated, 512).params.max_tokens == 512  # unset: up to the context limit
    validated = validate_completion(decode_completion(b'{"prompt": [1, 2], "max_tokens": 600}'))
    with pytest.raises(OpenAIError) as err:
        build_generate("r", validated, 512)
    assert (err.value.status, err.value.param) == (400, "max_tokens")
    gen = build_generate("r", validate_completion(decode_completion(b'{"prompt": [[1, 2]], "top_k": -1}')), 512)
    assert (gen.prompt_token_ids, gen.params.max_tokens, gen.params.top_k) == ([1, 2], 16, 0)


def test_speculation_cap_and_provenance_reach_sampling_params():
    body = b'{"prompt": "a", "speculative": {"n_max": 0}, "speculant": {"provenance": true}, "stop": "\\n"}'
    params = build_generate("r", validate_completion(decode_completion(body)), 64).params
    assert (params.num_speculative_tokens, params.include_provenance, params.stop) == (0, True, ["\n"])
    flat = validate_completion(decode_completion(b'{"prompt": "a", "speculative.n_max": 3}'))
    assert flat.params.num_speculative_tokens == 3


def test_param_from_msgspec_messages():
    assert param_from_error("Expected `int`, got `str` - at `$.messages[2].role`") == "messages[2].role"
    assert param_from_error("Object missing required field `role` - at `$.messages[0]`") == "messages[0].role"
    assert param_from_error("Expected `object`, got `array`") is None


def ready(worker_id: str, model: str = "m") -> protocol.Ready:
    return protocol.Ready(worker_id=worker_id, model=model, max_model_len=64, pid=1)


def test_routing_picks_the_least_busy_worker_of_the_model():
    table = WorkerTable(served_model_name="alias")
    a, b = table.add(b"a", ready("a"), 0.0), table.add(b"b", ready("b"), 0.0)
    a.request_ids.update({"r1", "r2"})
    b.request_ids.add("r3")
    assert table.pick(None) is b and table.pick("alias") is b and table.pick("m") is b
    with pytest.raises(OpenAIError) as err:
        table.pick("other")
    assert (err.value.status, err.value.param) == (404, "model")
    assert [w.worker_id for w in table.expired(now=10.0, timeout=5.0)] == ["a", "b"]


def test_spec_counters_follow_worker_totals():
    metrics = GatewayMetrics()
    metrics.observe_heartbeat("m", "w", protocol.WorkerStats(num_drafts=4, accepted_per_pos=[3, 1],
                                                             num_grammar_tokens=2))
    metrics.observe_heartbeat("m", "w", protocol.WorkerStats(num_drafts=6, accepted_per_pos=[4, 2],
                                                             num_grammar_tokens=5))
    metrics.observe_heartbeat("m", "w", protocol.WorkerStats(num_drafts=1, accepted_per_pos=[1, 0]))  # restarted
    get = metrics.registry.get_sample_value
    labels = {"model_name": "m", "engine": "w"}
    assert get("speculant:spec_decode_num_drafts_total", labels) == 7
    assert get("speculant:spec_decode_num_grammar_tokens_total", labels) == 5
    assert get("speculant:spec_decode_num_accepted_tokens_per_pos_total", {**labels, "position": "0"}) == 5
    metrics.forget_worker("m", "w")
    assert get("speculant:num_requests_running", labels) is None


@pytest.mark.parametrize("kind, body", [("completion", b'{"prompt": ["a", [5, 6]]'),
                                        ("chat", b'{"messages": [{"role": "user", "content": "hi"}]')])
def test_add_special_tokens_reaches_every_prompt_of_the_engine_request(kind, body):
    """vLLM's add_special_tokens: false travels in each Generate (true or absent: the model's default)."""
    decode, validate = (decode_chat, validate_chat) if kind == "chat" else (decode_completion, validate_completion)
    for extra, want in ((b"}", True), (b', "add_special_tokens": true}', True),
                        (b', "add_special_tokens": false}', False)):
        validated = validate(decode(body + extra))
        generates = [build_generate(f"r{i}", validated.choice(i), 64) for i in range(validated.num_choices)]
        assert [g.add_special_tokens for g in generates] == [want] * validated.num_choices
