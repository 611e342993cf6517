"""`speculant gateway`: run the HTTP gateway on uvloop until SIGINT/SIGTERM."""

from __future__ import annotations

import logging
import os
import sys

import uvloop
from aiohttp import web

from gateway.app import create_app
from gateway.config import GatewayConfig

log = logging.getLogger("speculant.gateway")


def setup_logging() -> None:
    logging.basicConfig(
        level=os.environ.get("SPECULANT_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def main(args) -> int:
    setup_logging()
    try:
        config = GatewayConfig.from_args(args)
    except ValueError as exc:
        print(f"speculant gateway: {exc}", file=sys.stderr)
        return 2
    log.info("gateway on http://%s:%d, engine endpoint %s", config.host, config.port, config.endpoint)
    log.info("%s; ZeroMQ link %s; shutdown grace %g s",
             f"{len(config.api_keys)} API key(s) required on /v1" if config.api_keys else "no API key required",
             "encrypted with Curve" if config.curve_dir else "plaintext", config.shutdown_grace)
    try:
        web.run_app(
            create_app(config),
            host=config.host,
            port=config.port,
            loop=uvloop.new_event_loop(),
            handler_cancellation=True,  # a client that leaves cancels its handler -> Abort to the engine
            shutdown_timeout=config.shutdown_timeout,
            access_log=None,
            print=None,
        )
    except (RuntimeError, OSError) as exc:  # endpoint or port already taken
        log.error("%s", exc)
        return 1
    return 0
