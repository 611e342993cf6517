"""The aiohttp application: routes, the OpenAI error middleware, and the engine client's lifetime."""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from aiohttp import web
from prometheus_client.aiohttp import make_aiohttp_handler

import gateway
from gateway import pages, tokenize
from gateway.auth import api_key_middleware
from gateway.config import GatewayConfig
from gateway.engine_client import EngineClient
from gateway.errors import OpenAIError
from gateway.generation import ENGINE, chat_completions, completions
from gateway.metrics import GatewayMetrics
from gateway.openapi import openapi_spec

log = logging.getLogger("speculant.gateway")

CONFIG = web.AppKey("config", GatewayConfig)
METRICS = web.AppKey("metrics", GatewayMetrics)
STARTED = web.AppKey("started", int)  # unix seconds, the `created` of /v1/models entries
DRAINING = web.AppKey("draining", asyncio.Event)  # set on SIGTERM: no new generation requests
_json = msgspec.json.Encoder()


def json_response(body: dict, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=_json.encode(body), status=status, headers=headers, content_type="application/json")


def error_response(exc: OpenAIError) -> web.Response:
    return json_response(exc.body(), status=exc.status, headers=exc.headers)


def _from_http_exception(exc: web.HTTPException, request: web.Request) -> OpenAIError:
    """aiohttp's own errors (404, 405, 413, ...) in OpenAI's shape."""
    if exc.status == 404:
        return OpenAIError(404, f"Invalid URL ({request.method} {request.path})", code="not_found")
    if exc.status == 405:
        return OpenAIError(405, f"Method {request.method} is not allowed on {request.path}",
                           code="method_not_allowed")
    if exc.status == 413:
        limit = request.app[CONFIG].max_body_bytes
        return OpenAIError(413, f"The request body is larger than the {limit}-byte limit.",
                           code="request_too_large")
    return OpenAIError(exc.status, exc.reason or "HTTP error", code=None)


@web.middleware
async def openai_errors(request: web.Request, handler) -> web.StreamResponse:
    """Every error leaves as an OpenAI error body; client mistakes are never a 500."""
    try:
        return await handler(request)
    except OpenAIError as exc:
        return error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(_from_http_exception(exc, request))
    except ConnectionResetError:
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(OpenAIError(500, "Internal server error.", code="internal_error"))


@web.middleware
async def refuse_while_draining(request: web.Request, handler) -> web.StreamResponse:
    """After SIGTERM the listener is closed; a request that still slips in on an open connection gets 503."""
    if request.app[DRAINING].is_set() and request.method == "POST":
        raise OpenAIError(503, "The gateway is shutting down; retry on another instance.",
                          code="gateway_shutdown", headers={"Connection": "close", "Retry-After": "1"})
    return await handler(request)


async def health(request: web.Request) -> web.Response:
    num_workers = len(request.app[ENGINE].table)
    body = {"status": "ok" if num_workers else "no engine worker ready", "workers": num_workers}
    return json_response(body, status=200 if num_workers else 503)


async def version(request: web.Request) -> web.Response:
    return json_response({"version": gateway.__version__})


async def openapi(request: web.Request) -> web.Response:
    return json_response(openapi_spec())


async def models(request: web.Request) -> web.Response:
    return json_response({"object": "list", "data": _model_entries(request)})


async def model(request: web.Request) -> web.Response:
    """OpenAI's retrieve-a-model (`client.models.retrieve(id)`): the entry, or a 404 model_not_found."""
    wanted = request.match_info["model"]
    for entry in _model_entries(request):
        if entry["id"] == wanted:
            return json_response(entry)
    raise OpenAIError(404, f"The model `{wanted}` does not exist.", param="model", code="model_not_found")


def _model_entries(request: web.Request) -> list[dict]:
    table = request.app[ENGINE].table
    data, seen = [], set()
    for worker in table.workers.values():
        name = table.served_name(worker)
        if name in seen:
            continue
        seen.add(name)
        data.append({"id": name, "object": "model", "created": request.app[STARTED], "owned_by": "speculant",
                     "root": worker.model, "parent": None, "max_model_len": worker.max_model_len,
                     "permission": []})
    return data


async def _engine_client(app: web.Application):
    client = EngineClient(app[CONFIG], app[METRICS])
    await client.start()
    app[ENGINE] = client
    yield
    await client.close()


async def _drain(app: web.Application) -> None:
    """SIGTERM: aiohttp has closed the listener; running requests get `shutdown_grace` seconds to
    finish, then the rest end with an error event and [DONE] (their engine requests are aborted)."""
    app[DRAINING].set()
    client, grace = app[ENGINE], app[CONFIG].shutdown_grace
    if client.num_pending:
        log.info("shutting down: waiting up to %g s for %d requests", grace, client.num_pending)
    deadline = time.monotonic() + grace
    while client.num_pending and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if client.num_pending:
        log.warning("shutdown grace over: ending %d requests with an error", client.num_pending)
    client.fail_all("The gateway is shutting down.")


def create_app(config: GatewayConfig) -> web.Application:
    middlewares = [openai_errors, refuse_while_draining]
    if config.api_keys:
        middlewares.append(api_key_middleware(config.api_keys))
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=middlewares)
    app[CONFIG] = config
    app[DRAINING] = asyncio.Event()
    app[METRICS] = metrics = GatewayMetrics()
    app[STARTED] = int(time.time())
    app.cleanup_ctx.append(_engine_client)
    app.on_shutdown.append(_drain)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", model)
    app.router.add_post("/tokenize", tokenize.tokenize)
    app.router.add_post("/detokenize", tokenize.detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/metrics", make_aiohttp_handler(metrics.registry))
    pages.add_routes(app)  # /, /playground, /dashboard, /static/*, /v1/speculant/stats
    return app
