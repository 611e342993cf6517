"""Structured output in the gateway (no engine, no model): each request form becomes an llguidance
grammar that validates and matches what it should, checked with a byte-level tokenizer."""

from __future__ import annotations

import json

import msgspec
import pytest
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper
from pydantic import BaseModel

from engine.serving import protocol
from gateway.constraints import MAX_CONSTRAINT_CHARS, Constraint, GrammarCache, grammar_for
from gateway.errors import OpenAIError
from gateway.openai_schema import decode_chat, decode_completion
from gateway.validation import build_generate, validate_chat, validate_completion


class _ByteVocab:
    """256 one-byte tokens and an EOS: enough for llguidance to run any grammar on any text."""

    def __init__(self):
        self.eos_token_id, self.bos_token_id = 256, None
        self.tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
        self.special_token_ids = [256]

    def __call__(self, text):
        return list(text if isinstance(text, bytes) else text.encode())


BYTES = LLTokenizer(TokenizerWrapper(_ByteVocab()))


def matches(grammar: str, text: str) -> bool:
    matcher = LLMatcher(BYTES, grammar, log_level=0)
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


def grammar_of(body: dict, kind: str = "chat") -> str | None:
    if kind == "chat":
        validated = validate_chat(decode_chat(json.dumps({"messages": [{"role": "user", "content": "hi"}], **body})))
    else:
        validated = validate_completion(decode_completion(json.dumps({"prompt": "x", **body})))
    grammar = build_generate("r", validated, 64).params.grammar
    assert grammar is None or LLMatcher.validate_grammar(grammar) == ""
    return grammar


def rejected(body: dict, kind: str = "chat") -> OpenAIError:
    with pytest.raises(OpenAIError) as err:
        grammar_of(body, kind)
    assert err.value.status == 400 and err.value.type == "invalid_request_error" and err.value.message
    return err.value


class Step(BaseModel):
    explanation: str
    output: str


class MathAnswer(BaseModel):
    steps: list[Step]  # a $defs/$ref pair in the JSON schema
    final_answer: str


def openai_strict_format(model: type[BaseModel]) -> dict:
    """What `client.chat.completions.parse(response_format=model)` sends (openai's strict-schema form)."""
    from openai.lib._pydantic import to_strict_json_schema

    return {"type": "json_schema", "json_schema": {"schema": to_strict_json_schema(model), "name": model.__name__,
                                                   "strict": True}}


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_every_form_reaches_sampling_params_on_both_endpoints(kind):
    assert grammar_of({}, kind) is None
    assert grammar_of({"response_format": {"type": "text"}}, kind) is None
    json_object = grammar_of({"response_format": {"type": "json_object"}}, kind)
    assert matches(json_object, '{"a": [1, 2]}') and not matches(json_object, "[1]")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    by_schema = grammar_of({"response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "description": "a number", "schema": schema, "strict": True}}}, kind)
    assert matches(by_schema, '{"n": 42}') and not matches(by_schema, '{"n": "x"}')
    assert not matches(by_schema, '{"n": 1, "m": 2}')  # additionalProperties: false
    regex = grammar_of({"speculant": {"regex": r"\d{3}-[a-z]+"}}, kind)
    assert matches(regex, "123-abc") and not matches(regex, "12-abc")
    lark = grammar_of({"speculant": {"grammar": 'start: "yes" | "no"'}}, kind)
    assert matches(lark, "yes") and not matches(lark, "maybe")
    gbnf = grammar_of({"speculant": {"grammar": 'root ::= "on" | "off"', "grammar_syntax": "gbnf"}}, kind)
    assert matches(gbnf, "off") and not matches(gbnf, "of")


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_vllm_and_llama_cpp_forms_reach_sampling_params(kind):
    """vLLM's structured_outputs and its earlier guided_* fields, llama.cpp's grammar and json_schema."""
    choice = grammar_of({"guided_choice": ["yes", "no (maybe)", "a.b", "x|y"]}, kind)
    assert all(matches(choice, c) for c in ("yes", "no (maybe)", "a.b", "x|y"))
    assert not any(matches(choice, c) for c in ("axb", "ye", "x", "no"))  # choices are literal, whole
    assert matches(grammar_of({"structured_outputs": {"choice": ["[z]"]}}, kind), "[z]")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    for body in ({"structured_outputs": {"json": schema}}, {"guided_json": json.dumps(schema)},
                 {"json_schema": schema}):
        assert matches(grammar_of(body, kind), '{"n": 3}') and not matches(grammar_of(body, kind), '{"n": "a"}')
    json_object = grammar_of({"structured_outputs": {"json_object": True}, "guided_decoding_backend": "x"}, kind)
    assert matches(json_object, '{"a": 1}') and not matches(json_object, "[1]")
    for body in ({"guided_regex": r"\d+"}, {"structured_outputs": {"regex": r"\d+"}}):
        assert matches(grammar_of(body, kind), "123") and not matches(grammar_of(body, kind), "a")
    for body in ({"guided_grammar": 'root ::= "on" | "off"'}, {"structured_outputs": {"grammar": 'start: "on" | "off"'}},
                 {"grammar": 'root ::= "on" | "off"'}):  # GBNF (::=) or Lark; llama.cpp's is GBNF
        assert matches(grammar_of(body, kind), "off") and not matches(grammar_of(body, kind), "of")


def test_a_pydantic_model_as_the_openai_client_sends_it():
    grammar = grammar_of({"response_format": openai_strict_format(MathAnswer)})
    answer = MathAnswer(steps=[Step(explanation="2 + 2", output="4")], final_answer="4")
    assert matches(grammar, answer.model_dump_json())
    assert not matches(grammar, '{"steps": [{"explanation": "x"}], "final_answer": "4"}')  # output missing
    assert not matches(grammar, '{"steps": [], "final_answer": "4", "extra": 1}')


def test_property_order_is_part_of_the_cache_key():
    """Fields are generated in `properties` order, so canonical JSON must not sort keys."""
    def schema(*names):
        return {"type": "json_schema", "json_schema": {"schema": {
            "type": "object", "properties": {n: {"type": "integer"} for n in names}, "required": list(names),
            "additionalProperties": False}}}
    ab, ba = grammar_of({"response_format": schema("a", "b")}), grammar_of({"response_format": schema("b", "a")})
    assert matches(ab, '{"a": 1, "b": 2}') and not matches(ab, '{"b": 2, "a": 1}')
    assert matches(ba, '{"b": 2, "a": 1}')


# (body, param) -> 400
INVALID = [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"enum": []}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"strict": True, "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format"),
    ({"speculant": {"regex": "[a-"}}, "speculant.regex"),
    ({"speculant": {"regex": ""}}, "speculant.regex"),
    ({"speculant": {"grammar": "start: foo"}}, "speculant.grammar"),
    ({"speculant": {"grammar": "root ::= (", "grammar_syntax": "gbnf"}}, "speculant.grammar"),
    ({"speculant": {"grammar": "  "}}, "speculant.grammar"),
    ({"speculant": {"grammar_syntax": "gbnf"}}, "speculant.grammar_syntax"),
    ({"speculant": {"regex": "a" * (MAX_CONSTRAINT_CHARS + 1)}}, "speculant.regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": 5}, "guided_json"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": " "}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"grammar": 'start: "a"'}, "grammar"),  # llama.cpp's grammar is GBNF
    ({"json_schema": {"type": "objectx"}}, "json_schema"),
    # two constraints: the second one is named
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_json": {"type": "object"}}, "guided_json"),
    ({"response_format": {"type": "json_object"}, "speculant": {"regex": "a"}}, "speculant.regex"),
    ({"speculant": {"regex": "a", "grammar": 'start: "a"'}}, "speculant.grammar"),
]


@pytest.mark.parametrize("body,param", INVALID, ids=[f"{i}:{p}" for i, (_, p) in enumerate(INVALID)])
def test_invalid_constraints_are_400_naming_the_field(body, param):
    assert rejected(body).param == param
    assert rejected(body, "completion").param == param


def test_error_messages_say_what_is_wrong():
    assert "Unimplemented keys" in rejected(INVALID[6][0]).message
    assert "unclosed character class" in rejected({"speculant": {"regex": "[a-"}}).message
    assert 'unknown name: "foo"' in rejected({"speculant": {"grammar": "start: foo"}}).message
    assert "at most one" in rejected(INVALID[-2][0]).message
    deep = rejected({"speculant": {"regex": "(" * 5000 + "a" + ")" * 5000}})  # llguidance quotes the input
    assert deep.param == "speculant.regex" and len(deep.message) < 1100


def test_unenforceable_keywords_are_ignored_unless_strict():
    unique = {"type": "json_schema", "json_schema": {"schema": {"type": "array", "items": {"type": "integer"},
                                                                "uniqueItems": True}}}
    grammar = grammar_of({"response_format": unique})
    assert matches(grammar, "[1, 1]") and not matches(grammar, '["a"]')  # the rest is still enforced


def test_the_cache_compiles_a_repeated_schema_once():
    cache = GrammarCache(maxsize=2)
    schema = {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "integer"}}}}
    body = msgspec.json.encode({"messages": [{"role": "user", "content": "hi"}], **schema})
    first = grammar_for(decode_chat(body), cache)
    spaced = json.dumps({"messages": [{"role": "user", "content": "hi"}], **schema}, indent=2).encode()
    assert grammar_for(decode_chat(spaced), cache) is first  # whitespace is not part of the key
    assert (cache.hits, cache.misses, len(cache)) == (1, 1, 1)
    bad = Constraint("speculant.regex", "regex", "(")
    assert cache.get(bad) is cache.get(bad) and cache.get(bad).error  # failures are cached too
    cache.get(Constraint("speculant.regex", "regex", "a"))
    same_as_first = Constraint("response_format", "json_schema", '{"type":"integer"}', lenient=True)  # strict unset
    assert len(cache) == 2 and cache.get(same_as_first).grammar == first
    assert cache.misses == 4  # the integer schema was evicted (least recently used) and compiled again


def test_grammar_tokens_are_reported_in_usage():
    from gateway.responses import ResponseBuilder, response, usage_chunk

    validated = validate_chat(decode_chat(b'{"messages": [{"role": "user", "content": "hi"}], "stream": true,'
                                          b' "stream_options": {"include_usage": true}}'))
    b = ResponseBuilder("id", "m", validated.opts)
    b.chunk(protocol.Output("r", "{}", [1, 2], "stop", 3, 2, num_drafts=1, num_draft_tokens=2,
                            num_accepted_tokens=1, num_grammar_tokens=1))
    assert usage_chunk([b])["usage"]["speculative"]["num_grammar_tokens"] == 1
    assert response([b])["usage"]["speculative"]["num_grammar_tokens"] == 1
