"""OpenAI request bodies as msgspec Structs, decoded straight from the HTTP bytes.

msgspec does the type checks; `gateway.validation` does the range checks. Unknown
fields are ignored (as vLLM does) so that clients sending extra keys keep working;
fields we cannot honour are declared here so that a non-default value gets a 400.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

from gateway.errors import bad_request


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class SpeculativeOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Per-request speculation: `n_max` caps drafts per step (llama.cpp's name; 0 turns speculation
    off), `method` picks another installed proposer for this request (the worker builds it with
    its default options on first use). Unknown keys are refused, never ignored.
    """

    n_max: int | None = None
    method: str | None = None


class SpeculantOptions(msgspec.Struct, kw_only=True):
    """Speculant extensions. `provenance`: per-token "drafted vs target" flags on the stream.
    `regex` (Rust regex syntax, matched by the whole output) or `grammar` (`grammar_syntax` "lark",
    the default, or "gbnf" as llama.cpp writes it) constrains the output; at most one output
    constraint per request, counting a JSON `response_format`.
    """

    provenance: bool = False
    regex: str | None = None
    grammar: str | None = None
    grammar_syntax: Literal["lark", "gbnf"] | None = None


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    """OpenAI's `response_format.json_schema` (what `client.chat.completions.parse` sends). `schema`
    is required here. With `strict: true` schema keywords we cannot enforce are a 400; otherwise
    they are ignored and the rest of the schema is still enforced.
    """

    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    """`type`: "text" (no constraint), "json_object" (any JSON object) or "json_schema"."""

    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `structured_outputs`: one of `json` (a JSON schema, as an object or its JSON text), `regex`,
    `choice` (the output is exactly one of these strings), `grammar` (GBNF, or Lark) or `json_object: true`.
    `disable_fallback` is accepted and has no effect (one grammar engine, no fallback); keys we cannot honour
    (`whitespace_pattern`, `structural_tag`, ...) are a 400."""

    json: Any = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool | None = None


class SamplingRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    repetition_penalty: float | None = None  # vLLM's extension
    min_p: float | None = None  # vLLM's and llama.cpp's extension
    min_tokens: int | None = None  # vLLM's extension
    allowed_token_ids: list[int] | None = None  # vLLM's extension
    include_stop_str_in_output: bool | None = None  # vLLM's extension
    truncate_prompt_tokens: int | None = None  # vLLM's extension
    bad_words: list[str] | None = None  # vLLM's extension
    prompt_logprobs: int | None = None  # vLLM's extension
    skip_special_tokens: bool | None = None  # vLLM's extension
    add_special_tokens: bool | None = None  # vLLM's extension: false adds no BOS to a text prompt
    return_tokens_as_token_ids: bool | None = None  # vLLM's extension: logprobs name tokens "token_id:<id>"
    priority: int | None = None  # vLLM's extension: lower first, on an engine with --scheduling-policy priority
    # vLLM's extensions we do not implement: a value that asks for them is a 400, never silently ignored
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    logits_processors: list[Any] | None = None
    user: str | None = None
    speculative: SpeculativeOptions | None = None
    speculative_n_max: int | None = msgspec.field(name="speculative.n_max", default=None)
    speculant: SpeculantOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's
    # vLLM's earlier names (removed in its v0.12, still sent by many clients): structured_outputs' fields
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted, no effect: llguidance is the one backend
    guided_whitespace_pattern: str | None = None  # refused (400)
    # llama.cpp server's: a GBNF grammar, a JSON schema
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None


class CompletionRequest(SamplingRequest, kw_only=True):
    prompt: Any = None  # str | [str] | [int] | [[int]]: checked by hand (msgspec allows one array type per union)
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class FunctionCallIn(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # JSON text of an object, as OpenAI returns it


class ToolCallIn(msgspec.Struct, kw_only=True):
    """One call in an assistant message's `tool_calls` (a reply of ours, sent back as history)."""

    id: str
    type: str = "function"
    function: FunctionCallIn


class ChatMessageIn(msgspec.Struct, kw_only=True):
    """role: system, developer, user, assistant or tool. An assistant message with `tool_calls` may have
    null content; a tool message answers one of them and names it with `tool_call_id`."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class FunctionDef(msgspec.Struct, kw_only=True):
    """`name`: 1-64 of a-z, A-Z, 0-9, '_' and '-'. `parameters`: a JSON schema of an object (absent: no
    arguments). `strict: true` makes schema keywords we cannot enforce a 400 when the call is forced."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(msgspec.Struct, kw_only=True):
    """One entry of `tools` (at most 128, names unique): `{"type": "function", "function": {...}}`."""

    type: str
    function: FunctionDef | None = None


class FunctionName(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    """Force a call of this function: `{"type": "function", "function": {"name": ...}}`."""

    type: str
    function: FunctionName


class ChatCompletionRequest(SamplingRequest, kw_only=True):
    messages: list[ChatMessageIn]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra variables for the chat template
    continue_final_message: bool | None = None  # vLLM's: the model continues the final message (validation.prompt_ending)
    echo: bool | None = None  # vLLM's: the answer starts with the final message's text, if it is the answer's role
    tools: list[ToolDef] | None = None
    # "none" | "auto" (the default with tools) | "required" | NamedToolChoice; required and named
    # choices constrain the answer to exactly one call (see gateway.tool_grammar).
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted; a forced choice makes one call
    functions: list[Any] | None = None  # OpenAI's deprecated form: a 400 pointing to `tools`
    function_call: Any = None


_completion_decoder = msgspec.json.Decoder(CompletionRequest)
_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)

_PATH_RE = re.compile(r" - at `\$\.?([^`]*)`$")
_MISSING_RE = re.compile(r"missing required field `([^`]+)`")


def decode_completion(body: bytes) -> CompletionRequest:
    return decode_with(_completion_decoder, body)


def decode_chat(body: bytes) -> ChatCompletionRequest:
    return decode_with(_chat_decoder, body)


def decode_with(decoder: msgspec.json.Decoder, body: bytes):
    """A JSON body as the decoder's Struct; a 400 naming the field it could not take otherwise."""
    if not body.strip():
        raise bad_request("The request body is empty; send a JSON object.", None, code="invalid_json")
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise bad_request(f"Invalid request: {exc}", param_from_error(str(exc)), code="invalid_type") from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}", None, code="invalid_json") from None
    except UnicodeDecodeError as exc:  # msgspec raises it for invalid UTF-8 inside strings
        raise bad_request(f"The request body is not valid UTF-8: {exc.reason} at byte {exc.start}", None,
                          code="invalid_json") from None
    except RecursionError:
        raise bad_request("The request body is nested too deeply.", None, code="invalid_json") from None


def param_from_error(message: str) -> str | None:
    """The field a msgspec error points at, in OpenAI's dotted form (`messages[0].role`)."""
    path_match = _PATH_RE.search(message)
    path = path_match.group(1).replace("[...]", "") if path_match else ""  # [...]: a value of a JSON object
    missing = _MISSING_RE.search(message)
    if missing:
        path = f"{path}.{missing.group(1)}" if path else missing.group(1)
    return path or None

