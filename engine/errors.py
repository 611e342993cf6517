"""Errors that carry an OpenAI-style field name back to the client."""


class InvalidRequest(ValueError):
    """A request the engine refuses; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
