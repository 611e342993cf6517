"""Speculant gateway: OpenAI-compatible HTTP + SSE in front of ZeroMQ engine workers."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("speculant")
except PackageNotFoundError:  # running from a source checkout
    __version__ = "unknown"
