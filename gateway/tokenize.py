"""vLLM's /tokenize and /detokenize: a worker's tokenizer over the wire (the gateway holds none).

    POST /tokenize    {"model"?, "prompt": "text"} or {"model"?, "messages": [...], "add_generation_prompt"?,
                       "continue_final_message"?}; either with "add_special_tokens"? (default true: a BOS where
                       the model adds one)
                      -> {"count", "max_model_len", "tokens"}: the ids a completion or chat request would start from
    POST /detokenize  {"model"?, "tokens": [ids]} -> {"prompt": "text"}
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import msgspec
from aiohttp import web

from engine.serving import protocol
from gateway.errors import OpenAIError, bad_request
from gateway.generation import ENGINE
from gateway.openai_schema import ChatMessageIn, decode_with
from gateway.validation import MAX_TOKEN_ID, _messages, prompt_ending, template_kwargs_json

ANSWER_TIMEOUT_S = 30.0  # a worker that never answers (an older one drops messages it does not know)


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """Exactly one of `prompt` (text) and `messages` (rendered with the model's chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_generation_prompt: bool | None = None  # default true; false with continue_final_message
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = True  # vLLM's: false adds no BOS


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


_tokenize_decoder = msgspec.json.Decoder(TokenizeRequest)
_detokenize_decoder = msgspec.json.Decoder(DetokenizeRequest)


async def tokenize(request: web.Request) -> web.Response:
    req = decode_with(_tokenize_decoder, await request.read())
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("send exactly one of prompt and messages", "prompt")
    fields = {"prompt": req.prompt} if req.prompt is not None else {
        "messages": _messages(req), **prompt_ending(req.add_generation_prompt, req.continue_final_message),
        "chat_template_kwargs_json": template_kwargs_json(req.chat_template_kwargs)}
    fields["add_special_tokens"] = req.add_special_tokens
    answer, worker = await _ask(request.app[ENGINE], req.model, lambda rid: protocol.Tokenize(rid, **fields))
    return web.json_response({"count": len(answer.token_ids), "max_model_len": worker.max_model_len,
                              "tokens": answer.token_ids})


async def detokenize(request: web.Request) -> web.Response:
    req = decode_with(_detokenize_decoder, await request.read())
    if not all(0 <= t <= MAX_TOKEN_ID for t in req.tokens):
        raise bad_request("tokens must be non-negative token ids", "tokens")
    answer, _ = await _ask(request.app[ENGINE], req.model, lambda rid: protocol.Detokenize(rid, req.tokens))
    return web.json_response({"prompt": answer.text})


async def _ask(client, model: str | None, make) -> tuple[protocol.Tokens, object]:
    """Send one Tokenize / Detokenize to a worker and wait for its Tokens (or its error)."""
    request_id = f"tok-{uuid.uuid4().hex}"
    chosen = []

    def build(worker):
        chosen.append(worker)
        return make(request_id)

    stream = client.submit(model, build)
    try:
        answer = await asyncio.wait_for(stream.next(), ANSWER_TIMEOUT_S)
    except TimeoutError:
        raise OpenAIError(504, "The engine worker did not answer.", code="worker_timeout") from None
    finally:
        client.finish(request_id)
    return answer, chosen[-1]
