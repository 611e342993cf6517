"""OpenAI-shaped errors: one exception type the middleware turns into a JSON body."""

from __future__ import annotations

from engine.serving import protocol


def error_type_for(status: int) -> str:
    """OpenAI `error.type` for an HTTP status."""
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


class OpenAIError(Exception):
    """A request that ends with an OpenAI error body (HTTP error or an SSE error event)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or error_type_for(status)
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def from_worker(cls, err: protocol.RequestError) -> OpenAIError:
        return cls(err.status, err.message, param=err.param, code=err.code, type=err.error_type)


def bad_request(message: str, param: str | None, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)
