"""Tool calling, request side (no engine, no model): `tools` / `tool_choice` / tool messages are checked
field by field, reach the wire, and a forced choice becomes a grammar that accepts exactly one valid call."""

from __future__ import annotations

import json

import pytest
from llguidance import LLMatcher

from gateway.errors import OpenAIError
from gateway.openai_schema import decode_chat
from gateway.validation import build_generate, validate_chat
from test_gateway_constraints import matches

USER = {"role": "user", "content": "What is the weather in Paris?"}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no parameters: no arguments
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
HISTORY = [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]


def generate(body: dict):
    return build_generate("r", validate_chat(decode_chat(json.dumps({"messages": [USER], **body}))), 256)


def rejected(body: dict) -> OpenAIError:
    with pytest.raises(OpenAIError) as err:
        generate(body)
    assert err.value.status == 400 and err.value.message
    return err.value


def call(name: str, arguments: dict, newlines: bool = False) -> str:
    nl = "\n" if newlines else ""
    return f"<tool_call>{nl}{json.dumps({'name': name, 'arguments': arguments})}{nl}</tool_call>"


def test_tools_and_tool_messages_reach_the_wire():
    gen = generate({"messages": HISTORY, "tools": [WEATHER, CLOCK]})
    assert json.loads(gen.tools_json) == [WEATHER, CLOCK]
    assert gen.params.grammar is None  # auto: the model chooses, nothing is forced
    user, assistant, tool = gen.messages
    assert (assistant.role, assistant.content, json.loads(assistant.tool_calls_json)) == ("assistant", "", [CALL])
    assert (tool.role, tool.content, tool.tool_call_id, tool.name) == ("tool", "18 C, sunny", "call_1", "get_weather")
    assert user.tool_calls_json is None and user.tool_call_id is None
    assert generate({"messages": HISTORY}).tools_json is None  # a history with calls needs no tools now


def test_tool_choice_none_sends_no_tools_and_parses_nothing():
    validated = validate_chat(decode_chat(json.dumps({"messages": [USER], "tools": [WEATHER], "tool_choice": "none"})))
    assert validated.opts.tool_names == ()
    assert build_generate("r", validated, 64).tools_json is None
    auto = validate_chat(decode_chat(json.dumps({"messages": [USER], "tools": [WEATHER, CLOCK]})))
    assert auto.opts.tool_names == ("get_weather", "get_time")


def test_required_accepts_one_call_of_any_tool_with_valid_arguments():
    grammar = generate({"tools": [WEATHER, CLOCK], "tool_choice": "required", "parallel_tool_calls": True}).params.grammar
    assert LLMatcher.validate_grammar(grammar) == ""
    assert matches(grammar, call("get_weather", {"city": "Paris"}))
    assert matches(grammar, call("get_weather", {"city": "Paris", "unit": "C"}, newlines=True))  # Hermes layout
    assert matches(grammar, call("get_time", {}))
    assert not matches(grammar, call("get_wether", {"city": "Paris"}))  # unknown name
    assert not matches(grammar, call("get_weather", {"town": "Paris"}))  # city missing, extra key
    assert not matches(grammar, call("get_weather", {"city": "Paris", "unit": "K"}))
    assert not matches(grammar, call("get_time", {"x": 1}))  # no parameters: no arguments
    assert not matches(grammar, "It is sunny.")
    assert not matches(grammar, call("get_time", {}) + call("get_time", {}))  # exactly one call
    assert not matches(grammar, '<tool_call>{"arguments": {}, "name": "get_time"}</tool_call>')


def test_a_named_choice_allows_only_that_function():
    choice = {"type": "function", "function": {"name": "get_time"}}
    grammar = generate({"tools": [WEATHER, CLOCK], "tool_choice": choice}).params.grammar
    assert matches(grammar, call("get_time", {}))
    assert not matches(grammar, call("get_weather", {"city": "Paris"}))


def test_parameters_with_defs_and_lenient_keywords():
    """A pydantic tool (openai.pydantic_function_tool) has $defs; non-strict schemas ignore what cannot be enforced."""
    import openai
    from pydantic import BaseModel

    class City(BaseModel):
        name: str

    class Trip(BaseModel):
        stops: list[City]

    tool = openai.pydantic_function_tool(Trip)
    grammar = generate({"tools": [tool], "tool_choice": "required"}).params.grammar
    assert matches(grammar, call("Trip", {"stops": [{"name": "Oslo"}]}))
    assert not matches(grammar, call("Trip", {"stops": [{"nom": "Oslo"}]}))
    unique = {"type": "function", "function": {"name": "u", "parameters": {
        "type": "object", "properties": {"ids": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}}}
    grammar = generate({"tools": [unique], "tool_choice": "required"}).params.grammar
    assert matches(grammar, call("u", {"ids": [1, 1]})) and not matches(grammar, call("u", {"ids": ["a"]}))
    strict = {"type": "function", "function": {**unique["function"], "strict": True}}
    assert rejected({"tools": [WEATHER, strict], "tool_choice": "required"}).param == "tools[1].function.parameters"
    assert generate({"tools": [strict]}).params.grammar is None  # auto: nothing is enforced, nothing refused


def test_auto_with_a_json_response_format_allows_calls_or_the_answer():
    body = {"tools": [WEATHER], "response_format": {"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {"summary": {"type": "string"}}, "required": ["summary"]}}}}
    grammar = generate(body).params.grammar
    assert matches(grammar, '{"summary": "sunny"}')
    assert matches(grammar, call("get_weather", {"city": "Paris"}) + "\n" + call("get_weather", {"city": "Rome"}))
    assert not matches(grammar, "Sunny.") and not matches(grammar, '{"sum": 1}')
    single = generate({**body, "parallel_tool_calls": False}).params.grammar
    assert matches(single, call("get_weather", {"city": "Paris"}))
    assert not matches(single, call("get_weather", {"city": "Paris"}) * 2)


def test_the_tool_grammar_is_cached():
    from gateway.constraints import CACHE

    body = {"tools": [WEATHER, CLOCK], "tool_choice": "required", "temperature": 0.5}
    generate(body)
    misses = CACHE.misses
    assert generate(body).params.grammar == generate(body).params.grammar
    assert CACHE.misses == misses


NAMED = {"type": "function", "function": {"name": "get_weather"}}
# (body, param) -> 400
INVALID = [
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, CLOCK, WEATHER]}, "tools[2].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "object"}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [CLOCK, {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}}}}], "tool_choice": "required"},
     "tools[1].function.parameters"),
    ({"tools": [CLOCK] * 129}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": 1}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.function"),
    ({"tools": [WEATHER], "tool_choice": {"type": "code", "function": {"name": "get_weather"}}}, "tool_choice.type"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": NAMED, "speculant": {"regex": "a"}}, "tool_choice"),
    ({"tools": [WEATHER], "speculant": {"regex": "a+"}}, "tool_choice"),
    ({"tools": [WEATHER], "response_format": {"type": "json_schema"}}, "response_format"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"messages": [USER, {"role": "tool", "content": "18 C"}]}, "messages[1].tool_call_id"),
    ({"messages": [USER, {"role": "tool", "tool_call_id": "call_9", "content": "x"}]}, "messages[1].tool_call_id"),
    ({"messages": [*HISTORY[:2], {"role": "tool", "tool_call_id": "call_2", "content": "x"}]},
     "messages[2].tool_call_id"),
    ({"messages": [*HISTORY[:2], {"role": "tool", "tool_call_id": "call_1"}]}, "messages[2].content"),
    ({"messages": [USER, {"role": "user", "content": "x", "tool_call_id": "call_1"}]}, "messages[1].tool_call_id"),
    ({"messages": [{**USER, "tool_calls": [CALL]}]}, "messages[0].tool_calls"),
    ({"messages": [USER, {"role": "assistant", "content": None}]}, "messages[1].content"),
    ({"messages": [USER, {"role": "assistant", "tool_calls": [{**CALL, "id": ""}]}]}, "messages[1].tool_calls[0].id"),
    ({"messages": [USER, {"role": "assistant", "tool_calls": [{**CALL, "type": "x"}]}]},
     "messages[1].tool_calls[0].type"),
    ({"messages": [USER, {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [USER, {"role": "assistant", "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": "{city: Paris}"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [USER, {"role": "assistant", "tool_calls": [
        {"id": "c", "function": {"name": "f g", "arguments": "{}"}}]}]}, "messages[1].tool_calls[0].function.name"),
    ({"messages": [USER, {"role": "function", "name": "f", "content": "x"}]}, "messages[1].role"),
]


@pytest.mark.parametrize("body,param", INVALID, ids=[f"{i}:{p}" for i, (_, p) in enumerate(INVALID)])
def test_mistakes_are_400_naming_the_field(body, param):
    assert rejected(body).param == param


def test_error_messages_say_what_is_wrong():
    assert "not among the tools" in rejected(INVALID[14][0]).message
    assert "used twice" in rejected(INVALID[6][0]).message
    assert "get_weather" not in rejected(INVALID[9][0]).message  # names the faulty function, 'f'
    assert "'f'" in rejected(INVALID[9][0]).message
    assert "response_format" in rejected(INVALID[17][0]).message
