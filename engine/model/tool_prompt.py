"""Tools in the prompt: the model's chat template renders them where it knows how (its source uses
`tools`, as Qwen's, Llama 3's and Mistral's do), otherwise a system note describes them.

Either way the model is asked to answer a call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(the Hermes / Qwen format, which the gateway parses back into `tool_calls`), and earlier assistant
calls and tool answers go back into the conversation in the form the template expects.
"""

from __future__ import annotations

import json
from typing import Any

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"

_NOTE = ("You can call functions. The available functions, as JSON schemas:\n<tools>\n{tools}\n</tools>\n"
         "To call one, reply with only " + TOOL_CALL_OPEN + '{{"name": <function name>, "arguments": <arguments '
         'object>}}' + TOOL_CALL_CLOSE + ". Otherwise answer normally.")


def knows_tools(template_source: str) -> bool:
    return "tools" in template_source and "tool_call" in template_source


def render_inputs(messages, tools_json: str | None, template_source: str) -> tuple[list[dict[str, Any]], dict]:
    """(message dicts, extra template context) for a conversation with tool fields and optional tools."""
    aware = knows_tools(template_source)
    tools = json.loads(tools_json) if tools_json else None
    out = [_message(m, aware) for m in messages]
    if tools and not aware:
        note = _NOTE.format(tools="\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = dict(out[0], content=out[0]["content"] + "\n\n" + note)
        else:
            out.insert(0, {"role": "system", "content": note})
    return out, ({"tools": tools} if tools and aware else {})


def _message(m, aware: bool) -> dict[str, Any]:
    d: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.name is not None:
        d["name"] = m.name
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    if m.tool_calls_json:
        calls = json.loads(m.tool_calls_json)
        if aware:  # transformers' convention: arguments as a mapping
            d["tool_calls"] = [{"type": "function", "id": c.get("id"), "function": {
                "name": c["function"]["name"], "arguments": _arguments(c["function"].get("arguments"))}}
                for c in calls]
        else:
            d["content"] = (m.content + "\n" if m.content else "") + "\n".join(
                TOOL_CALL_OPEN + json.dumps({"name": c["function"]["name"],
                                             "arguments": _arguments(c["function"].get("arguments"))},
                                            ensure_ascii=False) + TOOL_CALL_CLOSE for c in calls)
    return d


def _arguments(arguments) -> dict:
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments or "{}")
        except json.JSONDecodeError:
            return {"_raw": arguments}
        return value if isinstance(value, dict) else {"_value": value}
    return arguments or {}
