"""`speculant engine`: one engine worker driving an LLMEngine from a ZeroMQ DEALER socket.

The loop reads top to bottom: receive (add / abort) -> engine.step() -> send outputs.
Heartbeats go from their own thread (engine/serving/heartbeat.py), also during a long step; the two
threads share the socket under a lock. The loop blocks only while idle, never on a send
(NOBLOCK; a full queue drops the message with a log line). The gateway may start before or after us and may
restart: ZeroMQ reconnects the DEALER, and a GatewayHello makes us drop requests the
new gateway does not know and introduce ourselves again with Ready. Cut off from the
gateway for longer than its worker timeout (it has failed our requests by then), we abort
everything we run, so no KV block stays held for a request nobody waits for.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from engine.serving import protocol, zmq_security
from engine.errors import InvalidRequest
from engine.serving.heartbeat import Heartbeat

log = logging.getLogger("speculant.worker")

HEARTBEAT_INTERVAL = 0.5  # seconds, also during a step; the gateway drops a worker after ~5 s of silence
IDLE_POLL_MS = 100  # longest wait for a message while idle (the socket lock is held meanwhile)
HWM = 100_000  # messages queued per direction before a send is dropped
LINGER_MS = 1000  # how long close() may wait to deliver the final Goodbye
MAX_MESSAGES_PER_DRAIN = 1024  # keep stepping under a flood of requests
SLOW_STEP = 1.0  # seconds; longer steps are logged
CUMULATIVE_STATS = ("num_preemptions", "num_drafts", "num_draft_tokens", "num_accepted_tokens",
                    "prefix_cache_hits", "prefix_cache_queries")


class Worker:
    def __init__(self, engine, endpoint: str, worker_id: str, curve: zmq_security.CurveKeys | None = None,
                 link_timeout: float = 5.0):
        self.engine = engine
        self.worker_id = worker_id
        self.is_stopping = False
        self.arrivals: dict[str, float] = {}  # request id -> monotonic arrival, until its first token
        self.baseline = engine.stats()  # counters report work since Ready (not the warm-up)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, worker_id.encode())
        self.sock.setsockopt(zmq.LINGER, LINGER_MS)
        self.sock.setsockopt(zmq.SNDHWM, HWM)
        self.sock.setsockopt(zmq.RCVHWM, HWM)
        if curve is not None:
            zmq_security.secure_worker_socket(self.sock, curve)
        zmq_security.set_heartbeats(self.sock)
        self.link = LinkWatch(self.sock, link_timeout)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.link.monitor, zmq.POLLIN)
        self.sock_lock = threading.Lock()  # the heartbeat thread sends on the same socket
        self.last_stats = self.stats()  # refreshed by the main thread; sent by the heartbeat thread
        self.heartbeat = Heartbeat(self.beat, HEARTBEAT_INTERVAL)
        self.sock.connect(endpoint)
        log.info("worker %s connecting to %s", worker_id, endpoint)

    def run(self) -> None:
        self.send(self.ready())
        self.heartbeat.start()
        while not self.is_stopping:
            self.receive(0 if self.engine.has_unfinished() else IDLE_POLL_MS)
            if self.engine.has_unfinished():
                self.step()
            self.last_stats = self.stats()
            now = time.monotonic()
            if self.link.is_lost(now) and self.engine.request_ids():
                log.warning("cut off from the gateway for over %g s: aborting %d requests",
                            self.link.timeout, len(self.engine.request_ids()))
                for request_id in self.engine.request_ids():
                    self.abort(request_id)
        self.shutdown()

    def beat(self) -> None:
        """One heartbeat with the stats of the last finished loop (called from the heartbeat thread)."""
        self.send(protocol.Heartbeat(worker_id=self.worker_id, stats=self.last_stats))

    # ------------------------------------------------------------ receive

    def receive(self, timeout_ms: int) -> None:
        with self.sock_lock:
            ready = dict(self.poller.poll(timeout_ms))
            if self.link.monitor in ready:
                self.link.read_events(time.monotonic())
            batch = []
            for _ in range(MAX_MESSAGES_PER_DRAIN if self.sock in ready else 0):
                try:
                    batch.append(self.sock.recv_multipart(zmq.NOBLOCK))
                except zmq.Again:
                    break
        for frames in batch:  # handled outside the lock: handling may send
            self.handle(frames)

    def handle(self, frames: list[bytes]) -> None:
        if len(frames) != 1:
            log.warning("dropping a message with %d frames (expected 1)", len(frames))
            return
        try:
            msg = protocol.worker_decoder.decode(frames[0])
        except msgspec.DecodeError as exc:
            log.warning("dropping an undecodable message: %s", exc)
            return
        match msg:
            case protocol.Generate():
                self.add(msg)
            case protocol.Abort(request_id=request_id):
                self.abort(request_id)
            case protocol.Tokenize() | protocol.Detokenize():
                self.tokenize(msg)
            case protocol.GatewayHello(gateway_id=gateway_id, live_request_ids=live):
                stale = self.engine.request_ids() - set(live)
                log.info("gateway %s says hello; aborting %d stale requests", gateway_id, len(stale))
                for request_id in stale:
                    self.abort(request_id)
                self.send(self.ready())

    def add(self, msg: protocol.Generate) -> None:
        if self.is_stopping:
            self.refuse(msg.request_id, 503, "The engine worker is shutting down.", code="worker_stopping")
            return
        try:
            self.engine.add_request(msg)
        except InvalidRequest as exc:
            self.refuse(msg.request_id, 400, exc.message, param=exc.param, code=exc.code)
            return
        except Exception as exc:  # an engine bug must cost one request, not the worker
            log.exception("add_request %s failed", msg.request_id)
            self.refuse(msg.request_id, 500, f"The engine could not accept the request: {exc}")
            return
        self.arrivals[msg.request_id] = time.monotonic()

    def tokenize(self, msg: protocol.Tokenize | protocol.Detokenize) -> None:
        try:
            self.send(self.engine.tokens(msg))
        except InvalidRequest as exc:
            self.refuse(msg.request_id, 400, exc.message, param=exc.param, code=exc.code)
        except Exception as exc:  # a bug must cost one request, not the worker
            log.exception("tokenize %s failed", msg.request_id)
            self.refuse(msg.request_id, 500, f"The engine could not tokenize: {exc}")

    def abort(self, request_id: str) -> None:
        self.arrivals.pop(request_id, None)
        if request_id in self.engine.request_ids():
            self.engine.abort_request(request_id)

    def refuse(self, request_id: str, status: int, message: str, param=None, code=None) -> None:
        error_type = "invalid_request_error" if status < 500 else "server_error"
        self.send(protocol.RequestError(request_id=request_id, message=message, status=status,
                                        error_type=error_type, param=param, code=code))

    # ------------------------------------------------------------ step and send

    def step(self) -> None:
        step_start = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as exc:  # fail what is running, keep serving
            log.exception("engine step failed; failing all running requests")
            for request_id in self.engine.request_ids():
                self.abort(request_id)
                self.refuse(request_id, 500, f"The engine step failed: {exc}", code="engine_error")
            return
        step_time = time.monotonic() - step_start
        if step_time > SLOW_STEP:
            log.warning("one engine step took %.1f s", step_time)
        if outputs:
            self.send(protocol.Outputs(items=[self.stamp(out, step_start) for out in outputs]))

    def stamp(self, out: protocol.Output, step_start: float) -> protocol.Output:
        """Adds queue time to a request's first output: arrival -> start of the step that produced it.

        NOTE: a prompt prefilled in several chunks counts its earlier chunks as queue time.
        """
        if out.finish_reason is not None or out.token_ids:
            arrival = self.arrivals.pop(out.request_id, None)
            if arrival is not None and out.queue_time is None:
                return msgspec.structs.replace(out, queue_time=max(0.0, step_start - arrival))
        return out

    def send(self, msg: msgspec.Struct) -> None:
        data = protocol.encode(msg)
        try:
            with self.sock_lock:
                self.sock.send(data, zmq.NOBLOCK)
        except zmq.Again:
            log.warning("send queue full: dropping %s", type(msg).__name__)

    def ready(self) -> protocol.Ready:
        e = self.engine
        return protocol.Ready(worker_id=self.worker_id, model=e.model_name, max_model_len=e.max_model_len,
                              pid=os.getpid(), speculative_method=e.spec_method,
                              num_speculative_tokens=e.num_speculative_tokens,
                              available_methods=e.available_methods())

    def stats(self) -> protocol.WorkerStats:
        stats, base = self.engine.stats(), self.baseline
        since_ready = {name: getattr(stats, name) - getattr(base, name) for name in CUMULATIVE_STATS}
        per_pos = [n - (base.accepted_per_pos[i] if i < len(base.accepted_per_pos) else 0)
                   for i, n in enumerate(stats.accepted_per_pos)]
        return msgspec.structs.replace(stats, accepted_per_pos=per_pos, **since_ready)

    def shutdown(self) -> None:
        """Goodbye first (the gateway ends our requests with an error event), then free everything."""
        self.heartbeat.stop()
        request_ids = self.engine.request_ids()
        log.info("worker %s stopping; aborting %d requests", self.worker_id, len(request_ids))
        self.send(protocol.Goodbye(worker_id=self.worker_id, reason="shutdown"))
        for request_id in request_ids:
            self.abort(request_id)
        self.link.close()
        self.sock.close(linger=LINGER_MS)
        self.ctx.term()


class LinkWatch:
    """Connection state of the DEALER from its monitor socket (ZMTP heartbeats catch cut links)."""

    EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
              | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)

    def __init__(self, sock: zmq.Socket, timeout: float):
        self.sock = sock
        self.timeout = timeout
        self.monitor = sock.get_monitor_socket(self.EVENTS)
        self.lost_since: float | None = None  # None while connected (or never connected)
        self.is_connected = False
        self.failed = False  # last handshake failed: log once per run of failures

    def read_events(self, now: float) -> None:
        while self.monitor.poll(0):
            event = parse_monitor_message(self.monitor.recv_multipart())["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                log.info("connected to the gateway%s", " again" if self.lost_since is not None else "")
                self.lost_since, self.failed, self.is_connected = None, False, True
            elif event == zmq.EVENT_DISCONNECTED:
                if self.is_connected:
                    log.warning("lost the connection to the gateway; reconnecting")
                    self.lost_since, self.is_connected = now, False
            elif not self.failed:  # handshake refused: wrong Curve keys, or not a speculant gateway
                self.failed = True
                log.error("the gateway refused the handshake (%s): check %s / %s",
                          zmq.Event(event).name, zmq_security.CURVE_DIR_ENV, zmq_security.CURVE_NAME_ENV)

    def is_lost(self, now: float) -> bool:
        return self.lost_since is not None and now - self.lost_since > self.timeout

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)


def warm_up(engine) -> None:
    """One short request through prefill, decode and drafting before Ready.

    JIT compilation then happens here, not inside the first user's request, and no
    step of a real request runs long enough to miss the gateway's heartbeat timeout.
    """
    from engine.spec_decode.verify import compile_kernels

    start = time.monotonic()
    compile_kernels()  # the batched verification kernel too, which one request never reaches
    params = protocol.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request(protocol.Generate(request_id="warmup", params=params, prompt="one two one two one two one"))
    while engine.has_unfinished():
        engine.step()
    log.info("warm-up done in %.1f s", time.monotonic() - start)


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name) or ""
    try:
        value = float(raw) if raw else default
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds") from None
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {raw}")
    return value


def main(args) -> int:
    logging.basicConfig(level=os.environ.get("SPECULANT_LOG_LEVEL", "INFO").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    endpoint = args.endpoint or os.environ.get("SPECULANT_ENGINE_ENDPOINT") or protocol.DEFAULT_ENDPOINT
    worker_id = args.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    try:  # before the model load: a refused setup fails in a second
        curve = zmq_security.worker_keys_from_env(endpoint)
        link_timeout = _env_seconds("SPECULANT_WORKER_TIMEOUT", 5.0)
    except ValueError as exc:
        log.error("cannot start the engine: %s", exc)
        return 2
    from engine.llm_engine import LLMEngine  # heavy (numba); only the engine process pays for it

    from engine.jit_cache import compile_lock

    with compile_lock():  # one process at a time writes the kernel cache (see jit_cache.compile_lock)
        try:
            engine = LLMEngine.from_args(args)
        except (ValueError, FileNotFoundError) as exc:
            log.error("cannot start the engine: %s", exc)
            return 2
        warm_up(engine)
    worker = Worker(engine, endpoint, worker_id, curve, link_timeout)

    def stop(signum, frame) -> None:
        log.info("received %s", signal.Signals(signum).name)
        worker.is_stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    worker.run()
    return 0
