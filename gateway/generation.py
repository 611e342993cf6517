"""The two generation endpoints: validate, route to a worker, then stream or aggregate.

Disconnects: the app runs with `handler_cancellation=True`, so a client that leaves
cancels the handler at its current `await`; `finally` then tells the engine client,
which sends Abort to the worker (its KV blocks are freed on the next step).
"""

from __future__ import annotations

import logging
import uuid

import msgspec
from aiohttp import web

from gateway import sse
from gateway.engine_client import EngineClient, RequestStream
from gateway.errors import OpenAIError
from gateway.openai_schema import decode_chat, decode_completion
from gateway.responses import ResponseBuilder
from gateway.validation import Validated, build_generate, validate_chat, validate_completion

log = logging.getLogger("speculant.gateway")

ENGINE = web.AppKey("engine", EngineClient)
_json = msgspec.json.Encoder()


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    validated = validate_completion(decode_completion(body))
    return await _generate(request, validated, f"cmpl-{uuid.uuid4().hex}")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    validated = validate_chat(decode_chat(body))
    return await _generate(request, validated, f"chatcmpl-{uuid.uuid4().hex}")


async def _generate(request: web.Request, validated: Validated, request_id: str) -> web.StreamResponse:
    client = request.app[ENGINE]
    opts = validated.opts
    stream = client.submit(opts.model, lambda worker: build_generate(request_id, validated, worker.max_model_len))
    builder = ResponseBuilder(request_id, opts.model or stream.model, opts)
    try:
        if opts.stream:
            return await _stream(request, stream, builder)
        return await _aggregate(stream, builder)
    finally:
        client.finish(request_id)  # aborts the engine request if it is still running


async def _aggregate(stream: RequestStream, builder: ResponseBuilder) -> web.Response:
    while True:
        out = await stream.next()
        builder.add(out)
        if out.finish_reason is not None:
            break
    return web.Response(body=_json.encode(builder.response()), content_type="application/json")


async def _stream(request: web.Request, stream: RequestStream, builder: ResponseBuilder) -> web.StreamResponse:
    """SSE; headers go out with the first engine output, so a refused request is still a plain 4xx."""
    out = await stream.next()
    response = await sse.open_stream(request)
    try:
        try:
            await _write_chunks(response, stream, builder, out)
        except OpenAIError as exc:  # worker lost or refused mid-stream: error event, then [DONE]
            log.warning("request %s failed mid-stream: %s", builder.request_id, exc.message)
            await response.write(sse.event(exc.body()))
        await sse.close_stream(response)
    except ConnectionResetError:
        log.info("request %s: client disconnected", builder.request_id)
    return response


async def _write_chunks(response, stream: RequestStream, builder: ResponseBuilder, out) -> None:
    if builder.is_chat:
        await response.write(sse.event(builder.role_chunk()))
    while True:
        for chunk in builder.chunks(out):
            await response.write(sse.event(chunk))
        if out.finish_reason is not None:
            break
        out = await stream.next()
    if builder.opts.include_usage:
        await response.write(sse.event(builder.usage_chunk()))
