"""Server-sent events exactly as OpenAI clients parse them: `data: <json>\\n\\n`, then `data: [DONE]\\n\\n`."""

from __future__ import annotations

import msgspec
from aiohttp import web

HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # tells nginx-style proxies not to buffer the stream
}
DONE = b"data: [DONE]\n\n"

_encoder = msgspec.json.Encoder()


def event(payload: dict) -> bytes:
    return b"data: " + _encoder.encode(payload) + b"\n\n"


async def open_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(status=200, headers=HEADERS)
    if request.version >= (1, 1):  # HTTP/1.0 has no chunked encoding: the stream ends when the connection closes
        response.enable_chunked_encoding()
    await response.prepare(request)
    return response


async def close_stream(response: web.StreamResponse) -> None:
    await response.write(DONE)
    await response.write_eof()
