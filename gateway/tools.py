"""Tool calling, request side: the `tools` list, `tool_choice`, and the tool fields of chat messages.

- `tools`: at most 128 functions with unique names (`^[a-zA-Z0-9_-]{1,64}$`) and, when given,
  `parameters` a JSON schema of an object. They travel to the worker as `Generate.tools_json` (the
  OpenAI shape, JSON text), which renders them into the prompt; `tool_choice: "none"` sends none.
- `tool_choice`: "none", "auto" (the default when tools are given), "required", or a named function.
  Required and named choices constrain the answer to one call (`gateway.tool_grammar`).
- messages: an assistant turn may carry `tool_calls` (its content may then be null); a `tool` turn
  answers one of those calls by `tool_call_id` and must follow it.

Every mistake is a 400 naming the field (`tools[0].function.name`, `messages[2].tool_call_id`, ...).
"""

from __future__ import annotations

import dataclasses
import json
import re

import msgspec

from gateway.errors import OpenAIError, bad_request
from gateway.openai_schema import ChatCompletionRequest, ChatMessageIn, ToolDef

MAX_TOOLS = 128  # OpenAI's limit
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
TOOL_CHOICES = ("none", "auto", "required")


@dataclasses.dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a request asks of its tools. `mode`: "none" | "auto" | "required" | "named"."""

    mode: str
    tools: tuple[dict, ...] = ()  # the validated tools, OpenAI shape
    forced: tuple[str, ...] = ()  # required / named: the names the one call may use
    param_of: dict = dataclasses.field(default_factory=dict)  # name -> the request field of its parameters
    parallel: bool = True  # parallel_tool_calls (a forced choice makes one call either way)

    @property
    def active(self) -> bool:
        """True when the model may answer with calls (the gateway then parses them out of the answer)."""
        return self.mode != "none" and bool(self.tools)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(tool["function"]["name"] for tool in self.tools)

    def tools_json(self) -> str | None:
        return json.dumps(list(self.tools), ensure_ascii=False) if self.active else None

    def strict(self, name: str) -> bool:
        return next(bool(t["function"].get("strict")) for t in self.tools if t["function"]["name"] == name)

    def parameters(self, name: str) -> dict | None:
        return next(t["function"].get("parameters") for t in self.tools if t["function"]["name"] == name)


def _require(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise bad_request(message, param)


def tool_plan(req: ChatCompletionRequest) -> ToolPlan:
    """Checks `tools`, `tool_choice` and the deprecated `functions` / `function_call`."""
    if req.functions is not None or req.function_call is not None:
        param = "functions" if req.functions is not None else "function_call"
        raise OpenAIError(400, f"{param} is deprecated and not supported; use tools and tool_choice",
                          param=param, code="unsupported_parameter")
    tools = req.tools or []
    _require(len(tools) <= MAX_TOOLS, "tools", f"at most {MAX_TOOLS} tools per request")
    checked: list[dict] = []
    for i, tool in enumerate(tools):
        checked.append(_tool(tool, i, {t["function"]["name"] for t in checked}))
    param_of = {t["function"]["name"]: f"tools[{i}].function.parameters" for i, t in enumerate(checked)}
    mode, forced = _choice(req.tool_choice, [t["function"]["name"] for t in checked])
    return ToolPlan(mode, tuple(checked), forced, param_of, req.parallel_tool_calls is not False)


def _tool(tool: ToolDef, i: int, seen: set[str]) -> dict:
    _require(tool.type == "function", f"tools[{i}].type", f"tool type must be 'function'; got {tool.type!r}")
    fn = tool.function
    _require(fn is not None, f"tools[{i}].function", "a function tool needs `function` with at least a name")
    _require(TOOL_NAME.fullmatch(fn.name) is not None, f"tools[{i}].function.name",
             "function names must be 1-64 characters of a-z, A-Z, 0-9, '_' and '-'")
    _require(fn.name not in seen, f"tools[{i}].function.name", f"the function name {fn.name!r} is used twice")
    function: dict = {"name": fn.name}
    if fn.description is not None:
        function["description"] = fn.description
    if fn.parameters is not None:
        kind = fn.parameters.get("type", "object")
        _require(kind == "object", f"tools[{i}].function.parameters",
                 f"parameters must be a JSON schema of an object (type 'object'); got type {kind!r}")
        function["parameters"] = fn.parameters
    if fn.strict:
        function["strict"] = True
    return {"type": "function", "function": function}


def _choice(choice, names: list[str]) -> tuple[str, tuple[str, ...]]:
    if choice is None:
        return ("auto" if names else "none"), ()
    if isinstance(choice, str):
        _require(choice in TOOL_CHOICES, "tool_choice",
                 "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": "
                 f"{{\"name\": ...}}}}; got {choice!r}")
        _require(choice != "required" or bool(names), "tool_choice", "tool_choice 'required' needs tools")
        return choice, (tuple(names) if choice == "required" else ())
    _require(choice.type == "function", "tool_choice.type", f"tool_choice type must be 'function'; got {choice.type!r}")
    name = choice.function.name
    _require(name in names, "tool_choice.function.name", f"tool_choice names {name!r}, which is not among the tools")
    return "named", (name,)


# ---------------------------------------------------------------- messages


def tool_message_fields(messages: list[ChatMessageIn]) -> list[dict]:
    """Per message, its tool fields for `protocol.ChatMessage` ({} for an ordinary message).

    An assistant's calls go over the wire as JSON text; a tool answer must name a call made earlier
    in the conversation, and gets that call's function name unless it gives its own.
    """
    called: dict[str, str] = {}  # tool_call_id -> function name
    fields = []
    for i, m in enumerate(messages):
        _require(m.tool_calls is None or m.role == "assistant", f"messages[{i}].tool_calls",
                 "only assistant messages can carry tool_calls")
        _require(m.tool_call_id is None or m.role == "tool", f"messages[{i}].tool_call_id",
                 "only tool messages can carry a tool_call_id")
        if m.tool_calls:
            calls = [_call(call, f"messages[{i}].tool_calls[{j}]") for j, call in enumerate(m.tool_calls)]
            called.update((c["id"], c["function"]["name"]) for c in calls)
            fields.append({"tool_calls_json": json.dumps(calls, ensure_ascii=False)})
        elif m.role == "tool":
            param = f"messages[{i}].tool_call_id"
            _require(bool(m.tool_call_id), param, "a tool message needs the tool_call_id of the call it answers")
            _require(m.tool_call_id in called, param,
                     f"tool_call_id {m.tool_call_id!r} answers no tool call of an earlier assistant message")
            fields.append({"tool_call_id": m.tool_call_id, "name": m.name or called[m.tool_call_id]})
        else:
            fields.append({})
    return fields


def _call(call, param: str) -> dict:
    _require(bool(call.id), f"{param}.id", "a tool call needs an id")
    _require(call.type == "function", f"{param}.type", f"tool call type must be 'function'; got {call.type!r}")
    _require(TOOL_NAME.fullmatch(call.function.name) is not None, f"{param}.function.name",
             "function names must be 1-64 characters of a-z, A-Z, 0-9, '_' and '-'")
    try:
        arguments = msgspec.json.decode(call.function.arguments)
    except (msgspec.DecodeError, RecursionError):
        arguments = None
    _require(isinstance(arguments, dict), f"{param}.function.arguments", "arguments must be a JSON object as text")
    return {"id": call.id, "type": "function",
            "function": {"name": call.function.name, "arguments": call.function.arguments}}
