"""The gateway's OpenAPI 3.1 document, served at `/openapi.json`.

Request schemas come from the msgspec Structs the gateway really decodes with
(`gateway.openai_schema`), so the document cannot drift from the parser; response
schemas are written out here. Range limits live in `gateway.validation` and are
described, not encoded, so the document never promises more than the code checks.
"""

from __future__ import annotations

import functools
import inspect

import msgspec

import gateway
from gateway.openai_schema import ChatCompletionRequest, CompletionRequest
from gateway.tokenize import DetokenizeRequest, TokenizeRequest

REF = "#/components/schemas/{name}"


def _ref(name: str) -> dict:
    return {"$ref": REF.format(name=name)}


_NULLABLE_STR = {"anyOf": [{"type": "string"}, {"type": "null"}]}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
PROMPT_SCHEMA = {
    "description": "A prompt (text or token ids), or a list of up to 64 prompts: each gets `n` choices, in order.",
    "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 64},
        _TOKEN_IDS,
        {"type": "array", "items": _TOKEN_IDS, "minItems": 1, "maxItems": 64},
    ],
}

RESPONSE_FORMAT_TYPE = {
    "type": "string", "enum": ["text", "json_object", "json_schema"],
    "description": "text: no constraint; json_object: any JSON object; json_schema: the JSON schema in "
                   "`json_schema.schema` (an llguidance grammar enforces it while decoding).",
}
TOOL_CHOICE = {
    "description": "none: tools are not offered to the model; auto (the default with tools): the model answers "
                   "or calls; required: exactly one call of any tool; {\"type\": \"function\", \"function\": "
                   "{\"name\": ...}}: exactly one call of that tool. Required and named choices are enforced with "
                   "a grammar (arguments follow the tool's parameters schema) and cannot be combined with "
                   "response_format or speculant.regex / grammar; auto can be combined with a JSON response_format.",
    "anyOf": [{"type": "string", "enum": ["none", "auto", "required"]}, _ref("NamedToolChoice"), {"type": "null"}],
}
CHAT_ROLE = {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]}
TOOL_CALL = {
    "type": "object",
    "description": "One call the model made: its answer held `<tool_call>{\"name\": ..., \"arguments\": {...}}"
                   "</tool_call>` naming one of the request's tools. In a stream each call arrives whole in one "
                   "chunk's `delta.tool_calls` (with its `index`), after the content.",
    "required": ["id", "type", "function"],
    "properties": {"id": {"type": "string", "description": "call_<hex>; a tool message answers it by this id."},
                   "type": {"const": "function"},
                   "function": {"type": "object", "required": ["name", "arguments"], "properties": {
                       "name": {"type": "string"},
                       "arguments": {"type": "string", "description": "A JSON object, as text."}}}},
}
CHAT_MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {"role": {"const": "assistant"},
                   "content": {**_NULLABLE_STR, "description": "With tools: the answer without its tool calls, "
                                                               "stripped; null when nothing remains."},
                   "tool_calls": {"type": "array", "items": _ref("ToolCall")}},
}
FINISH_REASON = {"anyOf": [{"type": "string", "enum": ["stop", "length", "tool_calls", "abort"]}, {"type": "null"}],
                 "description": "tool_calls: the answer stopped normally after making calls."}
_COUNT = {"type": "integer", "minimum": 0}
SPECULATIVE_USAGE = {
    "type": "object",
    "description": "Speculant extension: the request's speculative decoding totals.",
    "properties": {
        "num_drafts": {**_COUNT, "description": "Steps that proposed drafts."},
        "num_draft_tokens": {**_COUNT, "description": "Draft tokens proposed."},
        "num_accepted_tokens": {**_COUNT, "description": "Draft tokens accepted."},
        "num_grammar_tokens": {**_COUNT, "description": "Accepted draft tokens that the output constraint "
                               "(response_format, speculant.regex or speculant.grammar) forced: 0 unconstrained."},
        "mean_acceptance_length": {"anyOf": [{"type": "number"}, {"type": "null"}],
                                   "description": "1 + accepted / drafts (vLLM's convention); null without drafts."},
    },
}

RESPONSE_SCHEMAS = {
    "ErrorResponse": {
        "type": "object",
        "required": ["error"],
        "properties": {"error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                           "param": _NULLABLE_STR, "code": _NULLABLE_STR},
        }},
    },
    "Usage": {
        "type": "object",
        "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
        "properties": {"prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
                       "total_tokens": {"type": "integer"},
                       "speculative": SPECULATIVE_USAGE},
    },
    "Completion": {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices"],
        "properties": {
            "id": {"type": "string"}, "object": {"const": "text_completion"}, "created": {"type": "integer"},
            "model": {"type": "string"}, "usage": _ref("Usage"),
            "choices": {"type": "array", "items": {"type": "object", "required": ["index", "text", "finish_reason"],
                                                   "properties": {"index": {"type": "integer"},
                                                                  "text": {"type": "string"},
                                                                  "logprobs": {}, "finish_reason": _NULLABLE_STR}}},
        },
    },
    "ChatCompletion": {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices"],
        "properties": {
            "id": {"type": "string"}, "object": {"const": "chat.completion"}, "created": {"type": "integer"},
            "model": {"type": "string"}, "usage": _ref("Usage"),
            "choices": {"type": "array", "items": {"type": "object", "required": ["index", "message", "finish_reason"],
                                                   "properties": {"index": {"type": "integer"},
                                                                  "message": _ref("ChatMessage"),
                                                                  "logprobs": {}, "finish_reason": FINISH_REASON}}},
        },
    },
    "ChatMessage": CHAT_MESSAGE,
    "ToolCall": TOOL_CALL,
    "Model": {
        "type": "object", "required": ["id", "object", "created", "owned_by"],
        "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                       "owned_by": {"type": "string"}, "max_model_len": {"type": "integer"}},
    },
    "ModelList": {
        "type": "object",
        "required": ["object", "data"],
        "properties": {"object": {"const": "list"},
                       "data": {"type": "array", "items": {"$ref": REF.format(name="Model")}}},
    },
    "Health": {
        "type": "object",
        "required": ["status", "workers"],
        "properties": {"status": {"type": "string"}, "workers": {"type": "integer"}},
    },
}

SSE_DESCRIPTION = ("With `stream: true`: server-sent events `data: <chunk JSON>`, ending with `data: [DONE]`; "
                   "an error after the stream started arrives as `data: {\"error\": {...}}` before `[DONE]`.")


def _errors(*statuses: int) -> dict:
    body = {"application/json": {"schema": _ref("ErrorResponse")}}
    return {str(s): {"description": "OpenAI error body", "content": body} for s in statuses}


def _generation(summary: str, request: str, response: str) -> dict:
    return {"post": {
        "summary": summary,
        "security": [{"bearer": []}, {}],
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {
            "200": {"description": SSE_DESCRIPTION, "content": {
                "application/json": {"schema": _ref(response)},
                "text/event-stream": {"schema": {"type": "string"}}}},
            **_errors(400, 401, 404, 413, 429, 503),
        },
    }}


def _get(summary: str, schema: dict, *errors: int, content_type: str = "application/json", secured=False,
         path_param: str | None = None) -> dict:
    op = {"summary": summary, "responses": {
        "200": {"description": "OK", "content": {content_type: {"schema": schema}}}, **_errors(*errors)}}
    if secured:
        op["security"] = [{"bearer": []}, {}]
    if path_param:
        op["parameters"] = [{"name": path_param, "in": "path", "required": True, "schema": {"type": "string"}}]
    return {"get": op}


def _post(summary: str, request: str, response: dict) -> dict:
    return {"post": {
        "summary": summary,
        "security": [{"bearer": []}, {}],
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {"200": {"description": "OK", "content": {"application/json": {"schema": response}}},
                      **_errors(400, 401, 404, 413, 429, 503, 504)},
    }}


def _health() -> dict:
    op = _get("200 when at least one engine worker is ready", _ref("Health"))
    op["get"]["responses"]["503"] = {"description": "No engine worker is ready",
                                     "content": {"application/json": {"schema": _ref("Health")}}}
    return op


@functools.cache
def openapi_spec() -> dict:
    """The document (built once; the Structs do not change at run time)."""
    _, components = msgspec.json.schema_components([CompletionRequest, ChatCompletionRequest, TokenizeRequest,
                                                    DetokenizeRequest], ref_template=REF)
    components["CompletionRequest"]["properties"]["prompt"] = PROMPT_SCHEMA
    components["CompletionRequest"]["required"] = ["prompt"]
    components["ResponseFormat"]["properties"]["type"] = RESPONSE_FORMAT_TYPE
    components["ChatCompletionRequest"]["properties"]["tool_choice"] = TOOL_CHOICE
    components["ChatMessageIn"]["properties"]["role"] = CHAT_ROLE
    for schema in components.values():  # Struct docstrings, without their source indentation
        if "description" in schema:
            schema["description"] = inspect.cleandoc(schema["description"])
    return {
        "openapi": "3.1.0",
        "info": {"title": "Speculant", "version": gateway.__version__,
                 "description": "OpenAI-compatible completions served with speculative decoding. "
                                "`security` applies only when SPECULANT_API_KEY is set."},
        "paths": {
            "/v1/completions": _generation("Text completion", "CompletionRequest", "Completion"),
            "/v1/chat/completions": _generation("Chat completion", "ChatCompletionRequest", "ChatCompletion"),
            "/v1/models": _get("Served models", _ref("ModelList"), 401, secured=True),
            "/v1/models/{model}": _get("One served model (OpenAI's retrieve)", _ref("Model"), 401, 404, secured=True,
                                       path_param="model"),
            "/v1/speculant/stats": _get("Worker and gateway stats behind the dashboard", {"type": "object"}, 401,
                                        secured=True),
            "/tokenize": _post("A prompt's token ids (vLLM's route)", "TokenizeRequest", {"type": "object", "properties": {
                "count": {"type": "integer"}, "max_model_len": {"type": "integer"},
                "tokens": {"type": "array", "items": {"type": "integer"}}}}),
            "/detokenize": _post("Token ids as text (vLLM's route)", "DetokenizeRequest", {
                "type": "object", "properties": {"prompt": {"type": "string"}}}),
            "/health": _health(),
            "/version": _get("Gateway version", {"type": "object", "properties": {"version": {"type": "string"}}}),
            "/metrics": _get("Prometheus metrics", {"type": "string"}, content_type="text/plain"),
            "/openapi.json": _get("This document", {"type": "object"}),
        },
        "components": {"schemas": {**components, **RESPONSE_SCHEMAS},
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
