"""Optional API keys: `SPECULANT_API_KEY=key1,key2` makes every route but the open ones need
`Authorization: Bearer <key>`.

Default-deny: only the probes, the spec and the browser pages' static shells stay open (load
balancers and Prometheus scrape without keys; a browser cannot put a Bearer header on a page
load, and the pages hold no data: their scripts send the key on every /v1 call). A route added
later is protected without anyone remembering to.
Keys are compared with `hmac.compare_digest` against every configured key, so neither the
time taken nor the answer says which key came close. The key is never echoed back.
"""

from __future__ import annotations

import hmac

from aiohttp import web

from gateway.errors import OpenAIError

OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/openapi.json", "/", "/playground", "/dashboard"})
OPEN_PREFIXES = ("/static/",)


def bearer_token(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header (scheme case-insensitive)."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def key_matches(token: str, keys: tuple[bytes, ...]) -> bool:
    """Constant-time against each key; every key is compared, whichever matches."""
    given = token.encode("utf-8", "surrogateescape")
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(given, key)
    return matched


def _unauthorized(message: str) -> OpenAIError:
    return OpenAIError(401, message, code="invalid_api_key", type="invalid_request_error",
                       headers={"WWW-Authenticate": 'Bearer realm="speculant"'})


def api_key_middleware(api_keys: tuple[str, ...]):
    """An aiohttp middleware that answers 401 (OpenAI error body) without a valid key."""
    keys = tuple(key.encode() for key in api_keys)

    @web.middleware
    async def require_api_key(request: web.Request, handler) -> web.StreamResponse:
        if request.method in ("GET", "HEAD") and (request.path in OPEN_PATHS
                                                  or request.path.startswith(OPEN_PREFIXES)):
            return await handler(request)
        token = bearer_token(request.headers.get("Authorization"))
        if token is None:
            raise _unauthorized("You didn't provide an API key. Send it in an Authorization header "
                                "using Bearer auth (Authorization: Bearer YOUR_KEY).")
        if not key_matches(token, keys):
            raise _unauthorized("Incorrect API key provided.")
        return await handler(request)

    return require_api_key
