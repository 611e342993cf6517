"""The two generation endpoints: validate, route each of the `n` choices to a worker, then stream or aggregate.

Disconnects: the app runs with `handler_cancellation=True`, so a client that leaves
cancels the handler at its current `await`; `finally` then tells the engine client,
which sends Abort to the worker (its KV blocks are freed on the next step).
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import msgspec
from aiohttp import web

from gateway import responses, sse
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
    """One engine request per choice (`n` per prompt): choice 0 under the response's id, choice i under `{id}-{i}`."""
    client = request.app[ENGINE]
    opts = validated.opts
    choices: list[tuple[RequestStream, ResponseBuilder]] = []
    try:
        for i in range(validated.num_choices):
            engine_id, choice = request_id if i == 0 else f"{request_id}-{i}", validated.choice(i)
            stream = client.submit(opts.model, lambda w, e=engine_id, c=choice: build_generate(e, c, w.max_model_len))
            builder = ResponseBuilder(request_id, opts.model or stream.model, opts, i, counts_prompt=i % opts.n == 0)
            choices.append((stream, builder))
        if opts.stream:
            return await _stream(request, choices)
        return await _aggregate(choices)
    finally:
        for stream, _ in choices:
            client.finish(stream.request_id)  # aborts the engine request if it is still running


async def _together(coros) -> list:
    """Await coroutines concurrently; the first failure cancels the rest and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


async def _collect(stream: RequestStream, builder: ResponseBuilder) -> None:
    while True:
        out = await stream.next()
        builder.add(out)
        if out.finish_reason is not None:
            return


async def _aggregate(choices) -> web.Response:
    await _together(_collect(stream, builder) for stream, builder in choices)
    body = responses.response([builder for _, builder in choices])
    return web.Response(body=_json.encode(body), content_type="application/json")


async def _stream(request: web.Request, choices) -> web.StreamResponse:
    """SSE; headers go out with every choice's first engine output, so a refused request is still a plain 4xx."""
    firsts = await _together(stream.next() for stream, _ in choices)
    response = await sse.open_stream(request)
    try:
        try:
            await _write_chunks(response, choices, firsts)
        except OpenAIError as exc:  # worker lost or refused mid-stream: error event, then [DONE]
            log.warning("request %s failed mid-stream: %s", choices[0][1].request_id, exc.message)
            await response.write(sse.event(exc.body()))
        await sse.close_stream(response)
    except ConnectionResetError:
        log.info("request %s: client disconnected", choices[0][1].request_id)
    return response


async def _write_chunks(response, choices, firsts) -> None:
    """Each choice's chunks as they come (a chat choice opens with its role chunk), then the usage."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(stream: RequestStream, builder: ResponseBuilder, out) -> None:
        try:
            if builder.is_chat:
                for chunk in builder.opening_chunks():
                    queue.put_nowait(chunk)
            while True:
                for chunk in builder.chunks(out):
                    queue.put_nowait(chunk)
                if out.finish_reason is not None:
                    break
                out = await stream.next()
            queue.put_nowait(None)  # this choice is done
        except Exception as exc:  # an OpenAIError becomes the stream's error event; anything else, the handler's
            queue.put_nowait(exc)

    tasks = [asyncio.ensure_future(pump(stream, builder, out)) for (stream, builder), out in zip(choices, firsts)]
    try:
        for _ in choices:
            while (item := await queue.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                await response.write(sse.event(item))
    finally:
        for task in tasks:
            task.cancel()
    builders = [builder for _, builder in choices]
    if builders[0].opts.include_usage:
        await response.write(sse.event(responses.usage_chunk(builders)))
