"""Securing the gateway <-> worker ZeroMQ link: loopback by default, CurveZMQ across hosts.

Rules (checked before any socket exists, so a mistake is a start-up error, not a leak):
- `ipc://`, `inproc://` and loopback `tcp://` addresses need nothing: the host is the trust boundary.
- Any other `tcp://` address needs Curve keys (`SPECULANT_CURVE_DIR`), or the explicit opt-out
  `SPECULANT_ALLOW_INSECURE_ZMQ=1` (plaintext, unauthenticated: anyone who can reach the port can
  join as a worker or read prompts).

Key directory, written by `speculant keygen DIR` (pyzmq's `zmq.auth.create_certificates` format):

    gateway.key, gateway.key_secret    the gateway's pair (the secret stays on the gateway host)
    worker.key,  worker.key_secret     a worker pair (`--name` makes more: NAME.key, NAME.key_secret)
    authorized/NAME.key                public keys the gateway accepts; delete one to revoke it

The gateway reads gateway.key_secret and authorized/; a worker reads gateway.key and its own
`$SPECULANT_CURVE_NAME.key_secret` (default `worker`). The gateway runs a ZAP authenticator, so a
peer whose key is not in authorized/ fails the handshake: its messages never reach the gateway.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import pathlib
import re
import shutil
import sys
from collections.abc import Mapping

import zmq
import zmq.auth

log = logging.getLogger("speculant.zmq_security")

CURVE_DIR_ENV = "SPECULANT_CURVE_DIR"
CURVE_NAME_ENV = "SPECULANT_CURVE_NAME"
INSECURE_ENV = "SPECULANT_ALLOW_INSECURE_ZMQ"
ZAP_DOMAIN = b"speculant"
GATEWAY_NAME = "gateway"
DEFAULT_WORKER_NAME = "worker"
AUTHORIZED = "authorized"
# ZMTP heartbeats: a link that carries nothing (cable cut, host gone) is declared dead after
# HEARTBEAT_TIMEOUT_MS, which raises a disconnect event on both ends.
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 3000


@dataclasses.dataclass(frozen=True, slots=True)
class CurveKeys:
    """One side's key pair, the gateway's public key (worker side) or the authorized dir (gateway side)."""

    public_key: bytes
    secret_key: bytes
    server_public_key: bytes | None = None  # worker: whom we expect to talk to
    authorized_dir: pathlib.Path | None = None  # gateway: whom we let in


def is_local_endpoint(endpoint: str) -> bool:
    """True for ipc://, inproc:// and tcp:// on a loopback address; wildcards and names are not local."""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = rest.rsplit(";", 1)[-1].rsplit(":", 1)[0]  # tcp://[src;]host:port
    host = host.strip("[]")
    if host in ("localhost", "lo"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", an interface name, a host name: reachable from elsewhere
        return False


def _flag(environ: Mapping[str, str], name: str) -> bool:
    return environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def insecure_allowed(environ: Mapping[str, str] = os.environ) -> bool:
    return _flag(environ, INSECURE_ENV)


def check_endpoint(endpoint: str, has_keys: bool, allow_insecure: bool) -> None:
    """Refuses a plaintext non-loopback endpoint unless the operator opted out explicitly."""
    if has_keys or allow_insecure or is_local_endpoint(endpoint):
        return
    raise ValueError(
        f"endpoint: {endpoint} is not a loopback or ipc address and no Curve keys are set: "
        f"set {CURVE_DIR_ENV} (make keys with `speculant keygen DIR`) to encrypt and authenticate the link, "
        f"or {INSECURE_ENV}=1 to accept an unauthenticated plaintext link"
    )


def _load_pair(path: pathlib.Path) -> tuple[bytes, bytes]:
    if not path.is_file():
        raise ValueError(f"{CURVE_DIR_ENV}: {path} is missing (make keys with `speculant keygen DIR`)")
    public, secret = zmq.auth.load_certificate(path)
    if secret is None:
        raise ValueError(f"{CURVE_DIR_ENV}: {path} holds no secret key")
    return public, secret


def _load_public(path: pathlib.Path) -> bytes:
    if not path.is_file():
        raise ValueError(f"{CURVE_DIR_ENV}: {path} is missing (copy it from the gateway's key directory)")
    return zmq.auth.load_certificate(path)[0]


def gateway_keys(curve_dir: str) -> CurveKeys:
    root = pathlib.Path(curve_dir).resolve()
    public, secret = _load_pair(root / f"{GATEWAY_NAME}.key_secret")
    authorized = root / AUTHORIZED
    if not authorized.is_dir():
        raise ValueError(f"{CURVE_DIR_ENV}: {authorized} is missing (the public keys of allowed workers)")
    if not any(authorized.glob("*.key")):
        log.warning("%s holds no worker keys: no worker can join", authorized)
    return CurveKeys(public, secret, authorized_dir=authorized)


def worker_keys(curve_dir: str, name: str = DEFAULT_WORKER_NAME) -> CurveKeys:
    root = pathlib.Path(curve_dir).resolve()
    public, secret = _load_pair(root / f"{name}.key_secret")
    return CurveKeys(public, secret, server_public_key=_load_public(root / f"{GATEWAY_NAME}.key"))


def worker_keys_from_env(endpoint: str, environ: Mapping[str, str] = os.environ) -> CurveKeys | None:
    """The worker's keys (or None on a local link); ValueError for an insecure or broken setup."""
    curve_dir = environ.get(CURVE_DIR_ENV) or None
    check_endpoint(endpoint, curve_dir is not None, insecure_allowed(environ))
    if curve_dir is None:
        return None
    return worker_keys(curve_dir, environ.get(CURVE_NAME_ENV) or DEFAULT_WORKER_NAME)


def set_heartbeats(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)


def secure_worker_socket(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Curve client: encrypts the link and proves our key; talks only to the gateway's key."""
    sock.curve_secretkey = keys.secret_key
    sock.curve_publickey = keys.public_key
    sock.curve_serverkey = keys.server_public_key


def start_authenticator(ctx: zmq.Context, keys: CurveKeys):
    """ZAP handler for the gateway's context (before bind): only keys in authorized/ get in."""
    from zmq.auth.asyncio import AsyncioAuthenticator

    auth = AsyncioAuthenticator(ctx, log=logging.getLogger("speculant.zmq_auth"))
    auth.start()
    # Our domain, not "*" (pyzmq looks certificates up by the socket's exact ZAP domain); an
    # absolute path, so never the CURVE_ALLOW_ANY marker.
    auth.configure_curve(domain=ZAP_DOMAIN.decode(), location=str(keys.authorized_dir))
    return auth


def secure_gateway_socket(sock: zmq.Socket, keys: CurveKeys) -> None:
    sock.curve_secretkey = keys.secret_key
    sock.curve_publickey = keys.public_key
    sock.curve_server = True
    sock.zap_domain = ZAP_DOMAIN


def keygen(key_dir: str, name: str = DEFAULT_WORKER_NAME) -> list[pathlib.Path]:
    """Creates the gateway pair (once) and the worker pair `name`, authorized; never overwrites."""
    if not re.fullmatch(r"[A-Za-z0-9_-]+", name or "") or name == GATEWAY_NAME:
        raise ValueError(f"name: {name!r} must be letters, digits, - or _ (and not {GATEWAY_NAME!r})")
    root = pathlib.Path(key_dir)
    if (root / f"{name}.key_secret").exists():
        raise ValueError(f"{root / (name + '.key_secret')} already exists; pick another --name")
    old_umask = os.umask(0o077)  # secret files are readable by their owner only
    try:
        (root / AUTHORIZED).mkdir(parents=True, exist_ok=True)
        written = []
        if not (root / f"{GATEWAY_NAME}.key_secret").exists():
            written += [pathlib.Path(p) for p in zmq.auth.create_certificates(root, GATEWAY_NAME)]
        written += [pathlib.Path(p) for p in zmq.auth.create_certificates(root, name)]
        shutil.copyfile(root / f"{name}.key", root / AUTHORIZED / f"{name}.key")
        written.append(root / AUTHORIZED / f"{name}.key")
    finally:
        os.umask(old_umask)
    return written


def cli_keygen(args) -> int:
    """`speculant keygen DIR [--name NAME]`."""
    try:
        written = keygen(args.dir, args.name)
    except (ValueError, OSError) as exc:
        print(f"speculant keygen: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    print(f"gateway host: {CURVE_DIR_ENV}={args.dir} (uses gateway.key_secret and {AUTHORIZED}/)")
    print(f"worker hosts: copy gateway.key and {args.name}.key_secret; {CURVE_DIR_ENV}=<that dir>"
          + (f" {CURVE_NAME_ENV}={args.name}" if args.name != DEFAULT_WORKER_NAME else ""))
    return 0
