"""Tool calling, reply side (no engine): `<tool_call>` blocks in the answer become OpenAI `tool_calls`,
whole or streamed, in shapes the openai SDK parses."""

from __future__ import annotations

import json

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from engine.serving import protocol
from gateway.openai_schema import decode_chat
from gateway.responses import ResponseBuilder, response
from gateway.tool_calls import ToolCallStream, parse_tool_calls
from gateway.validation import validate_chat

NAMES = ("get_weather", "get_time")
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}} for name in NAMES]
PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'


def functions(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("text,content,found", [
    ("It is sunny.", "It is sunny.", []),
    ("  \n", None, []),
    (PARIS, None, [("get_weather", {"city": "Paris"})]),
    (f"Let me check.\n{PARIS}\n{TIME}\n", "Let me check.", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    (f"A {TIME} B", "A  B", [("get_time", {})]),
    ('<tool_call>{"name": "get_time", "arguments": {}}', None, [("get_time", {})]),  # a stop string cut the tag
    ('<tool_call>{"name": "get_time", "argu', '<tool_call>{"name": "get_time", "argu', []),  # cut by max_tokens
    ('<tool_call>{"name": get_time}</tool_call>', '<tool_call>{"name": get_time}</tool_call>', []),  # bad JSON
    ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', []),  # unknown tool
    ('<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>',
     '<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>', []),  # arguments not an object
    ('<tool_call>[1]</tool_call>', "<tool_call>[1]</tool_call>", []),
    (f"<tool_call>oops</tool_call>{TIME}", "<tool_call>oops</tool_call>", [("get_time", {})]),
])
def test_parser(text, content, found):
    got_content, calls = parse_tool_calls(text, NAMES)
    assert got_content == content and functions(calls) == found
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) == 29
    assert len({c["id"] for c in calls}) == len(calls)


def builder(stream: bool, **body) -> ResponseBuilder:
    request = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "stream": stream, **body}
    return ResponseBuilder("chatcmpl-1", "m", validate_chat(decode_chat(json.dumps(request))).opts)


def outputs(text: str, finish_reason: str = "stop", pieces: int = 3) -> list[protocol.Output]:
    """The answer in deltas of `pieces` characters, as the engine sends it."""
    deltas = [text[i:i + pieces] for i in range(0, len(text), pieces)] or [""]
    return [protocol.Output("r", d, [i], finish_reason if i == len(deltas) - 1 else None, 5, i + 1)
            for i, d in enumerate(deltas)]


def whole(text: str, finish_reason: str = "stop", **body) -> ChatCompletion:
    b = builder(False, **body)
    for out in outputs(text, finish_reason):
        b.add(out)
    return ChatCompletion.model_validate(response([b]))


def test_response_with_calls_parses_as_an_openai_completion():
    resp = whole(f"Checking. {PARIS}{TIME}")
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert choice.message.tool_calls[0].type == "function"


def test_response_without_calls_or_cut_short():
    plain = whole("  It is sunny.  ").choices[0]
    assert (plain.message.content, plain.message.tool_calls, plain.finish_reason) == ("It is sunny.", None, "stop")
    cut = whole(PARIS + " and then", "length").choices[0]
    assert cut.finish_reason == "length" and len(cut.message.tool_calls) == 1
    none = whole(PARIS, tool_choice="none").choices[0]  # no tools offered: the text is just text
    assert (none.message.content, none.message.tool_calls, none.finish_reason) == (PARIS, None, "stop")


def stream(text: str, finish_reason: str = "stop", pieces: int = 3) -> list[ChatCompletionChunk]:
    b = builder(True)
    raw = b.opening_chunks() + [c for out in outputs(text, finish_reason, pieces) for c in b.chunks(out)]
    return [ChatCompletionChunk.model_validate(c) for c in raw]


def accumulate(chunks: list[ChatCompletionChunk]):
    """What the openai SDK's own stream helper makes of the chunks."""
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(chunk)
    return state.get_final_completion().choices[0]


@pytest.mark.parametrize("pieces", [1, 3, 1000])
def test_stream_with_calls(pieces):
    text = f"Checking.\n{PARIS}\n{TIME}"
    chunks = stream(text, pieces=pieces)
    contents = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert "".join(contents) == "Checking." and not any("<" in piece for piece in contents)
    deltas = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices[0].delta.tool_calls]
    assert [(d.index, d.type, d.function.name) for d in deltas] == [(0, "function", "get_weather"),
                                                                    (1, "function", "get_time")]
    assert all(d.id.startswith("call_") for d in deltas)
    assert [c.choices[0].finish_reason for c in chunks].count("tool_calls") == 1
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and chunks[-1].choices[0].delta.tool_calls is None
    final = accumulate(chunks)
    assert final.finish_reason == "tool_calls" and final.message.content == "Checking."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in final.message.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]


@pytest.mark.parametrize("text", ["It is sunny.", "Use <b>bold</b> or <tool>?", "A <tool_call>oops</tool_call> B",
                                  f"  {TIME} then text", "x <tool_call", '<tool_call>{"name": "get_ti'])
@pytest.mark.parametrize("pieces", [1, 4])
def test_streamed_content_equals_the_whole_answer(text, pieces):
    chunks = stream(text, pieces=pieces)
    b = builder(False)
    for out in outputs(text):
        b.add(out)
    message = response([b])["choices"][0]["message"]
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == (message["content"] or "")
    assert bool([c for c in chunks if c.choices[0].delta.tool_calls]) == ("tool_calls" in message)


def test_plain_text_streams_without_waiting():
    chunks = stream("Sunny <b>today</b>, 18 C.", pieces=2)
    first_content = next(i for i, c in enumerate(chunks) if c.choices[0].delta.content)
    assert first_content == 1  # right after the role chunk
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_tool_call_stream_holds_a_possible_tag():
    s = ToolCallStream(NAMES)
    assert s.feed("  Hi") == "Hi"  # leading whitespace dropped
    assert s.feed(" <tool") == ""  # could still become <tool_call>
    assert s.feed("s>") == " <tools>"
    assert s.feed(" <tool_call>") == ""
    assert s.feed('{"name": "get_time", "arguments": {}}</tool_call> ok') == ""
    tail, calls = s.finish()
    assert tail == "  ok" and [c["function"]["name"] for c in calls] == ["get_time"]


async def test_the_sse_writer_sends_every_chunk():
    from gateway.generation import _write_chunks

    class Sink:
        def __init__(self):
            self.events = []

        async def write(self, data: bytes):
            self.events.append(json.loads(data[len(b"data: "):]))

    class Stream:
        def __init__(self, items):
            self.items = iter(items)

        async def next(self):
            return next(self.items)

    first, *rest = outputs(f"{PARIS}{TIME}", pieces=7)
    sink, b = Sink(), builder(True, stream_options={"include_usage": True})
    await _write_chunks(sink, [(Stream(rest), b)], [first])
    final = accumulate([ChatCompletionChunk.model_validate(e) for e in sink.events])
    assert final.finish_reason == "tool_calls" and len(final.message.tool_calls) == 2
    assert sink.events[-1]["usage"]["completion_tokens"] == len(rest) + 1
