"""Tool calling, reply side: `<tool_call>{json}</tool_call>` blocks in the generated text become
OpenAI `tool_calls`.

A block counts as a call when its JSON is an object with a string `name` (one of the request's
tools) and an object `arguments`; any other block stays in the content as it was written. A block
left open at the very end (a stop string cut its closing tag) counts too when its JSON is complete.
The content is what remains, stripped (None when nothing does).

Streaming (`ToolCallStream`): text before the first `<tool_call>` streams as usual, except that a
tail that could still become the tag (and whitespace before it) waits for the next delta; from the
tag on everything is held, and at the end the held text is split into calls and content. The
streamed content then equals the non-streaming content.
"""

from __future__ import annotations

import json
import re
import secrets

OPEN, CLOSE = "<tool_call>", "</tool_call>"
BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _call(body: str, names: tuple[str, ...]) -> dict | None:
    """The OpenAI tool call a block's body holds, or None when it holds none."""
    try:
        found = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(found, dict):
        return None
    name, arguments = found.get("name"), found.get("arguments")
    if not isinstance(name, str) or name not in names or not isinstance(arguments, dict):
        return None
    return {"id": new_call_id(), "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def split_tool_calls(text: str, names: tuple[str, ...]) -> tuple[str, list[dict]]:
    """(the text without its call blocks, unstripped; the calls in order)."""
    calls: list[dict] = []
    kept: list[str] = []
    last = 0
    for match in BLOCK.finditer(text):
        call = _call(match.group(1), names)
        if call is None:
            continue
        calls.append(call)
        kept.append(text[last:match.start()])
        last = match.end()
    kept.append(text[last:])
    return "".join(kept), calls


def parse_tool_calls(text: str, names: tuple[str, ...]) -> tuple[str | None, list[dict]]:
    """A whole answer: (content stripped, or None when empty; the calls)."""
    content, calls = split_tool_calls(text, names)
    return content.strip() or None, calls


def finish_reason(reason: str | None, calls: list[dict]) -> str | None:
    """"tool_calls" for an answer that stopped normally after making calls."""
    return "tool_calls" if calls and reason == "stop" else reason


def stream_deltas(calls: list[dict]) -> list[dict]:
    """The `delta.tool_calls` entries of a stream, one per call, each complete."""
    return [{"index": i, **call} for i, call in enumerate(calls)]


def _partial_tag(text: str) -> int:
    """Length of the longest end of `text` that is a proper start of the `<tool_call>` tag."""
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:size]):
            return size
    return 0


class ToolCallStream:
    """Splits a streamed answer into content deltas that are safe to send now, and the held rest."""

    def __init__(self, names: tuple[str, ...]):
        self.names = names
        self.pending = ""  # text not yet sent: a possible tag start, whitespace, or everything from a tag on
        self.holding = False  # a tag was seen: hold until the end
        self.started = False  # some content was sent (before it, leading whitespace is dropped)

    def feed(self, text: str) -> str:
        """The content of this delta that can be sent now."""
        self.pending += text
        if self.holding:
            return ""
        tag = self.pending.find(OPEN)
        if tag >= 0:
            ready, self.holding = self.pending[:tag], True
        else:
            ready = self.pending[:len(self.pending) - _partial_tag(self.pending)]
        sent = ready.rstrip()  # whitespace waits: it may sit between the content and a call
        self.pending = self.pending[len(sent):]
        return self._send(sent)

    def finish(self) -> tuple[str, list[dict]]:
        """At the end: (the content still to send, the calls)."""
        rest, calls = split_tool_calls(self.pending, self.names)
        self.pending = ""
        return self._send(rest.rstrip()), calls

    def _send(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
        self.started = self.started or bool(text)
        return text
