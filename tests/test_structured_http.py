"""Structured output through the real gateway and worker (SmolLM2, the ngram worker of tests/servers.py):

- `response_format: json_schema` on both endpoints, streaming and not: the text validates against the
  schema and is byte-identical with speculation on and off (`speculative.n_max: 0`);
- the `openai` client's `chat.completions.parse(response_format=PydanticModel)` returns a parsed object;
- a schema the grammar library rejects is a 400 naming `response_format`, and the server keeps serving.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pydantic
import pytest
from servers import gateway_and_worker

pytestmark = pytest.mark.slow

# Every field bounded, so that any answer the grammar allows closes within max_tokens=80: with the population
# unbounded, a change of the last bit of softmax's exp led SmolLM2 to "32000000..." until the token limit.
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "country", "population"],
          "properties": {"city": {"type": "string", "maxLength": 24}, "country": {"type": "string", "maxLength": 24},
                         "population": {"type": "integer", "minimum": 0, "maximum": 100_000_000}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Give the largest city of France as JSON."}]


class City(pydantic.BaseModel):
    city: str
    country: str
    population: int


@pytest.fixture(scope="module")
def client(tmp_path_factory, model_path):
    with gateway_and_worker(tmp_path_factory.mktemp("structured"), model_path) as c:
        yield openai.OpenAI(base_url=f"{c.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def chat(client, model, n_max=None, stream=False) -> str:
    extra = {"response_format": FORMAT} | ({} if n_max is None else {"speculative": {"n_max": n_max}})
    reply = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=80, temperature=0,
                                           stream=stream, extra_body=extra)
    if stream:
        return "".join(chunk.choices[0].delta.content or "" for chunk in reply if chunk.choices)
    return reply.choices[0].message.content


def test_json_schema_output_validates_and_is_lossless(client, model):
    plain = chat(client, model, n_max=0)
    jsonschema.validate(json.loads(plain), SCHEMA)
    assert chat(client, model) == plain
    assert chat(client, model, stream=True) == plain
    completion = client.completions.create(model=model, prompt="The capital of Japan as JSON: ", max_tokens=80,
                                           temperature=0, extra_body={"response_format": FORMAT})
    jsonschema.validate(json.loads(completion.choices[0].text), SCHEMA)
    assert completion.usage.model_extra["speculative"]["num_grammar_tokens"] >= 0


def test_vllm_structured_outputs_and_guided_fields(client, model):
    """vLLM's `structured_outputs` and its earlier `guided_choice` / `guided_json`, as its users send them in
    extra_body: the answer is one of the choices / validates, the same with drafting on and off."""
    ask = [{"role": "user", "content": "Is the sky green? Answer yes or no."}]
    for extra in ({"guided_choice": ["yes", "no"]}, {"structured_outputs": {"choice": ["yes", "no"]}}):
        texts = {client.chat.completions.create(model=model, messages=ask, max_tokens=8, temperature=0,
                                                extra_body={**extra, "speculative": {"n_max": n}}).choices[0].message.content
                 for n in (0, 4)}
        assert len(texts) == 1 and texts <= {"yes", "no"}
    for extra in ({"structured_outputs": {"json": SCHEMA}}, {"guided_json": json.dumps(SCHEMA)}):
        reply = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=80, temperature=0,
                                               extra_body=extra)
        jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)


def test_openai_parse_with_a_pydantic_model(client, model):
    reply = client.chat.completions.parse(model=model, messages=MESSAGES, max_tokens=80, temperature=0,
                                          response_format=City)
    assert isinstance(reply.choices[0].message.parsed, City)


def test_rejected_schema_is_a_400_and_serving_goes_on(client, model):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, extra_body={
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}})
    assert err.value.body["param"] == "response_format"
    assert json.loads(chat(client, model))["city"]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current temperature of a city in celsius",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 30}}}}}


def test_required_tool_call_round_trips_through_the_openai_client(client, model):
    """A tool-calling loop as an agent writes it: a forced call, our answer, then the final reply."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], tool_choice="required",
                                           max_tokens=60, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"celsius": 21})}]
    final = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], max_tokens=30,
                                           temperature=0)
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    streamed = client.chat.completions.create(model=model, messages=messages[:1], tools=[WEATHER], stream=True,
                                              tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                              max_tokens=60, temperature=0)
    chunks = list(streamed)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == json.loads(call.function.arguments)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
