"""Tool calling, constrained: the llguidance grammar (`SamplingParams.grammar`) of a request with tools.

- `tool_choice` "required" or a named function: the answer is exactly one call,
  `<tool_call>` + `{"name": <an allowed name>, "arguments": <its parameters schema>}` + `</tool_call>`
  (the Hermes / Qwen format the worker's prompt asks for), with an optional newline inside each tag.
  Together with any other output constraint (response_format, speculant.regex / grammar) it is a 400.
- "auto" with a JSON `response_format`: the answer is either tool calls (one, or several unless
  `parallel_tool_calls` is false) or the JSON answer. "auto" with `speculant.regex` / `grammar`: a 400.
- "auto" alone, or "none": no tool grammar (the request's own constraint, if any).

Each function is its own `%json` alternative, so a parameters schema keeps its `$defs` at a schema
root. A function without `strict: true` is lenient: schema keywords llguidance does not implement are
ignored; with `strict: true` they are a 400 naming `tools[i].function.parameters`. Grammars are
compiled and cached by `gateway.constraints.GrammarCache`, keyed by their Lark text.
"""

from __future__ import annotations

import json

from gateway.constraints import (CACHE, MAX_CONSTRAINT_CHARS, Constraint, GrammarCache, grammar_for,
                                 request_constraints, shorten_error)
from gateway.errors import bad_request
from gateway.openai_schema import ChatCompletionRequest
from gateway.tools import ToolPlan

NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
TOOL_CALL_RULES = 'tool_call: "<tool_call>" "\\n"? call "\\n"? "</tool_call>"'


def tool_grammar(req: ChatCompletionRequest, plan: ToolPlan, cache: GrammarCache = CACHE) -> str | None:
    """`SamplingParams.grammar` for a chat request with its tool plan; a 400 naming the field otherwise."""
    if not plan.active:
        return grammar_for(req, cache)
    constraints = request_constraints(req)
    if plan.forced:
        if constraints:
            raise bad_request(f"tool_choice {plan.mode!r} forces a tool call, so it cannot be combined with "
                              f"{constraints[0].param}; drop one of them", "tool_choice")
        return _compile(plan, plan.forced, None, cache)
    if not constraints:
        return None
    grammar_for(req, cache)  # the constraint alone first: its own mistakes name its own field
    answer = constraints[0]
    if answer.kind != "json_schema":
        raise bad_request(f"tools can be combined with a JSON response_format but not with {answer.param}; "
                          "send tool_choice 'none' to use it", "tool_choice")
    return _compile(plan, plan.names, answer, cache)


def call_schema(plan: ToolPlan, name: str) -> dict:
    """The JSON schema of one call of `name`: {"name": name, "arguments": <its parameters>}."""
    arguments = dict(plan.parameters(name) or NO_ARGUMENTS)
    schema: dict = {"type": "object", "properties": {"name": {"const": name}, "arguments": arguments},
                    "required": ["name", "arguments"], "additionalProperties": False}
    for key in ("$defs", "definitions"):  # `#/$defs/...` references resolve against the schema root
        if key in arguments:
            schema[key] = arguments.pop(key)
    if not plan.strict(name):
        schema["x-guidance"] = {"lenient": True}
    return schema


def tool_lark(plan: ToolPlan, names: tuple[str, ...], answer: Constraint | None = None) -> str:
    """The Lark grammar: one forced call (`answer` None), or calls or the JSON `answer`."""
    calls = [f"call_{i}: %json {json.dumps(call_schema(plan, name))}" for i, name in enumerate(names)]
    lines = [TOOL_CALL_RULES, "call: " + " | ".join(f"call_{i}" for i in range(len(names))), *calls]
    if answer is None:
        return "\n".join(["start: tool_call", *lines]) + "\n"
    schema = json.loads(answer.source)
    if answer.lenient and isinstance(schema, dict):
        schema = {**schema, "x-guidance": {"lenient": True}}
    more = ' ("\\n"? tool_call)*' if plan.parallel else ""
    head = ["start: tool_calls | answer", f"tool_calls: tool_call{more}", f"answer: %json {json.dumps(schema)}"]
    return "\n".join([*head, *lines]) + "\n"


def _compile(plan: ToolPlan, names: tuple[str, ...], answer: Constraint | None, cache: GrammarCache) -> str:
    source = tool_lark(plan, names, answer)
    if len(source) > MAX_CONSTRAINT_CHARS:
        raise bad_request(f"the tools' parameter schemas are too long to enforce (at most {MAX_CONSTRAINT_CHARS} "
                          "characters in all)", "tools")
    compiled = cache.get(Constraint("tool_choice", "lark", source))
    if compiled.error is None:
        return compiled.grammar
    for name in names:  # which function's schema is at fault?
        alone = cache.get(Constraint("tool_choice", "lark", tool_lark(plan, (name,))))
        if alone.error is not None:
            raise bad_request(f"the parameters schema of function {name!r} cannot be enforced: "
                              f"{shorten_error(alone.error)}", plan.param_of[name])
    raise bad_request(f"the tool call grammar is not valid: {shorten_error(compiled.error)}", "tool_choice")
