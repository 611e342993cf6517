"""Gateway settings: command-line flags first, then SPECULANT_* environment variables.

The gateway never reads `PORT`: honcho sets it for every process type.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from engine.serving import zmq_security
from engine.serving.protocol import DEFAULT_ENDPOINT


@dataclasses.dataclass(frozen=True, slots=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    endpoint: str = DEFAULT_ENDPOINT  # ZeroMQ ROUTER bind address
    served_model_name: str | None = None  # alias accepted next to the workers' model name
    max_pending: int = 1024  # outstanding requests before 429
    worker_timeout: float = 5.0  # seconds of silence before a worker is dropped
    max_body_bytes: int = 4 * 1024 * 1024  # larger request bodies get 413
    shutdown_timeout: float = 2.0  # seconds aiohttp waits for handlers after the grace period
    shutdown_grace: float = 10.0  # seconds in-flight requests may still finish after SIGTERM
    api_keys: tuple[str, ...] = ()  # Bearer keys accepted on /v1 (empty: no auth)
    curve_dir: str | None = None  # CurveZMQ key directory (`speculant keygen`)
    allow_insecure_zmq: bool = False  # plaintext on a non-loopback endpoint, explicitly

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if "://" not in self.endpoint:
            raise ValueError(f"endpoint must look like tcp://host:port or ipc://path, got {self.endpoint!r}")
        if self.max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {self.max_pending}")
        if self.worker_timeout <= 0:
            raise ValueError(f"worker_timeout must be > 0, got {self.worker_timeout}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if not 0 <= self.shutdown_grace <= 3600:
            raise ValueError(f"shutdown_grace must be in 0..3600 s, got {self.shutdown_grace}")
        if any(not key or key != key.strip() for key in self.api_keys):
            raise ValueError("api_keys must be non-empty and have no surrounding spaces")
        zmq_security.check_endpoint(self.endpoint, self.curve_dir is not None, self.allow_insecure_zmq)
        if self.curve_dir is not None:
            zmq_security.gateway_keys(self.curve_dir)  # fail at start-up, naming the missing file

    @classmethod
    def from_args(cls, args, environ: Mapping[str, str] = os.environ) -> GatewayConfig:
        """Flags win over environment variables, which win over defaults."""
        d = cls()
        return cls(
            host=getattr(args, "host", None) or environ.get("SPECULANT_HOST") or d.host,
            port=_pick(getattr(args, "port", None), environ, "SPECULANT_PORT", int, d.port),
            endpoint=getattr(args, "endpoint", None) or environ.get("SPECULANT_ENGINE_ENDPOINT") or DEFAULT_ENDPOINT,
            served_model_name=getattr(args, "served_model_name", None)
            or environ.get("SPECULANT_SERVED_MODEL_NAME")
            or None,
            max_pending=_pick(None, environ, "SPECULANT_MAX_PENDING", int, d.max_pending),
            worker_timeout=_pick(None, environ, "SPECULANT_WORKER_TIMEOUT", float, d.worker_timeout),
            max_body_bytes=_pick(None, environ, "SPECULANT_MAX_BODY_BYTES", int, d.max_body_bytes),
            shutdown_grace=_pick(None, environ, "SPECULANT_SHUTDOWN_GRACE", float, d.shutdown_grace),
            api_keys=tuple(k.strip() for k in environ.get("SPECULANT_API_KEY", "").split(",") if k.strip()),
            curve_dir=environ.get(zmq_security.CURVE_DIR_ENV) or None,
            allow_insecure_zmq=zmq_security.insecure_allowed(environ),
        )


def _pick(flag, environ: Mapping[str, str], name: str, convert, default):
    if flag is not None:
        return flag
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return convert(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a valid {convert.__name__}") from None
