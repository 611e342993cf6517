"""End to end over what a request does with its prompt: /tokenize and /detokenize, chat's continue_final_message
and vLLM's prompt_logprobs; a real gateway and worker, the real model, the openai client. Each reference is
computed another way (the tokenizer, a plain completion, the logprobs greedy decoding reported)."""

from __future__ import annotations

import openai
import pytest
from servers import MAX_MODEL_LEN, gateway_and_worker, http

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_path):
    with gateway_and_worker(tmp_path_factory.mktemp("tokens"), model_path) as c:
        yield c


def test_tokenize_and_detokenize(cluster, client, model, tokenizer):
    """vLLM's /tokenize and /detokenize, answered by a worker's tokenizer: a text's ids, a chat's ids as its
    completion counts them, the text back from ids, and 400s naming the field for bad bodies."""
    status, body, _ = http(f"{cluster.url}/tokenize", {"model": model, "prompt": "Hello world, again"})
    assert status == 200 and body["tokens"] == tokenizer.encode("Hello world, again")
    assert (body["count"], body["max_model_len"]) == (len(body["tokens"]), MAX_MODEL_LEN)
    messages = [{"role": "user", "content": "Name three prime numbers."}]
    status, chat, _ = http(f"{cluster.url}/tokenize", {"messages": messages})
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=1)
    assert status == 200 and chat["count"] == reply.usage.prompt_tokens
    status, kwargs, _ = http(f"{cluster.url}/tokenize", {"messages": messages,  # SmolLM2's template reads none
                                                          "chat_template_kwargs": {"enable_thinking": False}})
    assert status == 200 and kwargs["tokens"] == chat["tokens"]
    status, back, _ = http(f"{cluster.url}/detokenize", {"tokens": body["tokens"]})
    assert (status, back) == (200, {"prompt": "Hello world, again"})
    for path, bad, param in (("tokenize", {"prompt": "a", "messages": messages}, "prompt"),
                             ("tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
                             ("tokenize", {"messages": messages, "chat_template_kwargs": {"messages": []}},
                              "chat_template_kwargs"),
                             ("detokenize", {"tokens": [tokenizer.vocab_size]}, "tokens"),
                             ("detokenize", {"tokens": "12"}, "tokens")):
        status, error, _ = http(f"{cluster.url}/{path}", bad)
        assert (status, error["error"]["param"]) == (400, param), error


def test_continue_final_message_continues_a_prefilled_answer(cluster, client, model, tokenizer):
    """vLLM's continue_final_message: the model continues the final (assistant) message. The reference is a plain
    completion of the closed conversation's rendering with SmolLM2's end of turn ('<|im_end|>\\n') cut off by hand."""
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is"}]
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                           extra_body={"continue_final_message": True})
    closed = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert closed.endswith("The capital of France is<|im_end|>\n")
    plain = client.completions.create(model=model, prompt=closed[: -len("<|im_end|>\n")], max_tokens=8,
                                      temperature=0)
    assert reply.choices[0].message.content == plain.choices[0].text != ""
    assert reply.usage.prompt_tokens == plain.usage.prompt_tokens
    status, ids, _ = http(f"{cluster.url}/tokenize", {"messages": messages, "continue_final_message": True})
    assert (status, ids["count"]) == (200, plain.usage.prompt_tokens)
    empty_final = [messages[0], {"role": "assistant", "content": ""}]
    for extra, sent, param in (({"add_generation_prompt": True}, messages, "add_generation_prompt"),
                               ({}, empty_final, "messages")):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=model, messages=sent, max_tokens=4,
                                           extra_body={"continue_final_message": True, **extra})
        assert err.value.body["param"] == param, err.value.body
    assert client.chat.completions.create(model=model, messages=messages[:1], max_tokens=2).choices  # still serving


def test_prompt_logprobs_score_the_prompt_as_generation_scored_it(client, model, tokenizer):
    """vLLM's prompt_logprobs (not streamed): per prompt token {id: {logprob, rank, decoded_token}} for the token
    and its top alternatives, None for the first; the tokens greedy decoding appended to a prefix get the logprobs
    and alternatives that decoding reported, at rank 1. Chat's list sits at the top level of the response."""
    prefix = tokenizer.encode("The capital of France is")
    made = client.completions.create(model=model, prompt=prefix, max_tokens=6, temperature=0, logprobs=3,
                                     extra_body={"speculant": {"provenance": True}})
    generated = made.model_extra["speculant"]["token_ids"]
    scored = client.completions.create(model=model, prompt=prefix + generated, max_tokens=1, temperature=0,
                                       extra_body={"prompt_logprobs": 3})
    entries = scored.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == len(prefix) + len(generated) and entries[0] is None
    assert scored.choices[0].logprobs is None and scored.usage.prompt_tokens == len(entries)
    reported = made.choices[0].logprobs
    for token_id, entry, logprob, top in zip(generated, entries[len(prefix):], reported.token_logprobs,
                                             reported.top_logprobs):
        first_key = next(iter(entry))
        assert first_key == str(token_id) and entry[first_key]["rank"] == 1
        assert entry[first_key]["logprob"] == pytest.approx(logprob, abs=1e-6)
        assert {e["decoded_token"]: pytest.approx(e["logprob"], abs=1e-6) for e in entry.values()} == top
        assert sorted(e["rank"] for e in entry.values()) == [1, 2, 3]
    for entry, token_id in zip(entries[1:], prefix[1:]):  # each prompt token leads its own entry
        assert next(iter(entry)) == str(token_id) and 3 <= len(entry) <= 4
    messages = [{"role": "user", "content": "Say hello."}]
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=2,
                                           extra_body={"prompt_logprobs": 0})
    chat_entries = reply.model_extra["prompt_logprobs"]
    assert len(chat_entries) == reply.usage.prompt_tokens and chat_entries[0] is None
    assert all(len(entry) == 1 and next(iter(entry.values()))["rank"] >= 1 for entry in chat_entries[1:])


def test_priority_reaches_the_engine_which_schedules_first_come_first_served(cluster, client, model):
    """vLLM's priority crosses the wire: this worker runs the default fcfs policy and refuses any other value than 0
    with a 400 naming `priority` (streamed or not); 0 is served. The ordering itself: test_scheduling_policy."""
    for stream in (False, True):
        status, error, _ = http(f"{cluster.url}/v1/completions",
                                {"model": model, "prompt": "Hi", "max_tokens": 2, "priority": 1, "stream": stream})
        assert (status, error["error"]["param"]) == (400, "priority"), error
        assert "--scheduling-policy priority" in error["error"]["message"]
    reply = client.completions.create(model=model, prompt="Hi", max_tokens=2, extra_body={"priority": 0})
    assert reply.choices[0].finish_reason == "length"


def test_chat_echo_starts_the_answer_with_the_message_it_continues(cluster, client, model):
    """vLLM's chat echo: with continue_final_message the answer is the prefilled text and then its continuation
    (the reference: the same request without echo), streamed as the role chunk, the echoed text, then the rest;
    after a user message (a new assistant turn) echo adds nothing."""
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is"}]
    common = dict(model=model, messages=messages, max_tokens=8, temperature=0)
    plain = client.chat.completions.create(**common, extra_body={"continue_final_message": True})
    echoed = client.chat.completions.create(**common, extra_body={"continue_final_message": True, "echo": True})
    continuation = plain.choices[0].message.content
    assert continuation and echoed.choices[0].message.content == "The capital of France is" + continuation
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens
    stream = client.chat.completions.create(**common, stream=True,
                                            extra_body={"continue_final_message": True, "echo": True})
    deltas = [chunk.choices[0].delta.content for chunk in stream if chunk.choices]
    assert deltas[:2] == ["", "The capital of France is"] and "".join(d or "" for d in deltas[2:]) == continuation
    question = messages[:1]
    alone = client.chat.completions.create(model=model, messages=question, max_tokens=8, temperature=0)
    echo = client.chat.completions.create(model=model, messages=question, max_tokens=8, temperature=0,
                                          extra_body={"echo": True})
    assert echo.choices[0].message.content == alone.choices[0].message.content
