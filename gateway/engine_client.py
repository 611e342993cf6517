"""The gateway's side of the ZeroMQ link: one ROUTER socket, one reader task, per-request queues.

Handlers never touch the socket. They `submit` a request and read its `RequestStream`;
the reader task fans worker messages out to those queues, so a slow client only ever
slows its own queue. A worker that says Goodbye or stays silent longer than
`worker_timeout` is dropped, and each of its requests gets an error instead of hanging.
A worker whose connection drops (killed, link cut: ZMTP heartbeats notice) is dropped at
once: the socket monitor reports the disconnect and a probe finds which peer is gone.
Only the worker a request was sent to may answer for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from engine.serving import protocol, zmq_security
from gateway.config import GatewayConfig
from gateway.errors import OpenAIError
from gateway.metrics import GatewayMetrics, RequestTiming
from gateway.workers import WorkerInfo, WorkerTable

log = logging.getLogger("speculant.gateway.engine_client")

HWM = 100_000  # messages; outstanding work is bounded by max_pending anyway
HELLO_INTERVAL = 1.0  # seconds between GatewayHellos to the same unknown worker
PROBE_DELAYS = (0.05, 0.25)  # s after a disconnect: libzmq drops the peer's route asynchronously


class RequestStream:
    """One request's outputs, in order; ends with a finished Output or raises OpenAIError."""

    def __init__(self, request_id: str, worker: WorkerInfo, model: str, arrival_time: float):
        self.request_id = request_id
        self.identity = worker.identity
        self.model = model  # served name, for metric labels
        self.queue: asyncio.Queue[protocol.Output | protocol.RequestError | protocol.Tokens] = asyncio.Queue()
        self.is_finished = False  # the engine is done with it (finished, refused or lost)
        self.timing = RequestTiming(arrival_time)

    async def next(self) -> protocol.Output | protocol.Tokens:
        item = await self.queue.get()
        if isinstance(item, protocol.RequestError):
            raise OpenAIError.from_worker(item)
        if isinstance(item, protocol.Output) and item.finish_reason == "abort":
            raise OpenAIError(503, "The engine aborted the request.", code="aborted")
        return item


class EngineClient:
    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics):
        self.config = config
        self.metrics = metrics
        self.table = WorkerTable(config.served_model_name)
        self.gateway_id = f"gateway-{time.time_ns():x}"
        self._streams: dict[str, RequestStream] = {}
        self._hello_sent: dict[bytes, float] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._auth = None  # ZAP authenticator when Curve keys are configured
        self._monitor: zmq.asyncio.Socket | None = None

    @property
    def num_pending(self) -> int:
        return len(self._streams)

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        keys = zmq_security.gateway_keys(self.config.curve_dir) if self.config.curve_dir else None
        if keys is not None:
            self._auth = zmq_security.start_authenticator(self._ctx, keys)
        sock = self._ctx.socket(zmq.ROUTER)
        if keys is not None:
            zmq_security.secure_gateway_socket(sock, keys)
        zmq_security.set_heartbeats(sock)
        sock.setsockopt(zmq.LINGER, 1000)  # ms; lets the final Aborts out on shutdown
        sock.setsockopt(zmq.SNDHWM, HWM)
        sock.setsockopt(zmq.RCVHWM, HWM)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown peer raises instead of silently dropping
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted worker may reuse its id
        try:
            sock.bind(self.config.endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            self._stop_auth()
            self._ctx.term()
            raise RuntimeError(f"cannot bind the engine endpoint {self.config.endpoint}: {exc}") from None
        self._sock = sock
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        log.info("engine endpoint bound at %s%s", self.config.endpoint, " (Curve)" if keys else "")
        self._tasks = [asyncio.create_task(loop()) for loop in
                       (self._read_loop, self._watch_loop, self._link_loop)]

    async def close(self) -> None:
        self.fail_all("The gateway is shutting down.")
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._sock is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._sock.close(linger=500)
        self._stop_auth()
        if self._ctx is not None:
            self._ctx.term()

    def _stop_auth(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    # ------------------------------------------------------------ handler API

    def submit(self, model: str | None, make_request: Callable[[WorkerInfo], protocol.Generate]) -> RequestStream:
        """Routes a request to the least busy live worker; raises OpenAIError 429/503/404/400."""
        if len(self._streams) >= self.config.max_pending:
            raise OpenAIError(429, f"Too many requests in flight ({self.config.max_pending}); retry shortly.",
                              code="queue_full", headers={"Retry-After": "1"})
        arrival = time.monotonic()
        while True:
            worker = self.table.pick(model)
            request = make_request(worker)
            error = self._send(worker.identity, request)
            if error is None:
                break
            if error != zmq.EHOSTUNREACH:
                raise OpenAIError(503, "The engine worker is overloaded; retry shortly.", code="engine_overloaded",
                                  headers={"Retry-After": "1"})
            self._drop_worker(worker, "unreachable")
        stream = RequestStream(request.request_id, worker, self.table.served_name(worker), arrival)
        self._streams[request.request_id] = stream
        worker.request_ids.add(request.request_id)
        self.metrics.pending.set(len(self._streams))
        return stream

    def finish(self, request_id: str) -> None:
        """Forgets a request; if the engine still works on it (client left), aborts it there."""
        stream = self._streams.pop(request_id, None)
        self.metrics.pending.set(len(self._streams))
        if stream is None or stream.is_finished:
            return
        stream.is_finished = True
        worker = self.table.get(stream.identity)
        if worker is not None:
            worker.request_ids.discard(request_id)
            self._send(worker.identity, protocol.Abort(request_id=request_id))
        self.metrics.observe_finish(stream.model, "abort", stream.timing, time.monotonic(), 0)
        log.info("request %s aborted (client gone)", request_id)

    def fail_all(self, message: str) -> None:
        for worker in list(self.table.workers.values()):
            for request_id in list(worker.request_ids):
                self._send(worker.identity, protocol.Abort(request_id=request_id))
            self._fail_requests(worker, message, "gateway_shutdown")

    # ------------------------------------------------------------ socket

    def _send(self, identity: bytes, msg: msgspec.Struct) -> int | None:
        """Sends without ever waiting (ROUTER never blocks); returns the errno on failure."""
        if self._sock is None:
            return zmq.ENOTSOCK
        future = self._sock.send_multipart([identity, protocol.encode(msg)], flags=zmq.NOBLOCK)
        exc = future.exception()  # the NOBLOCK send has already completed
        if exc is None:
            return None
        log.warning("send %s to %r failed: %s", type(msg).__name__, identity, exc)
        return getattr(exc, "errno", zmq.EAGAIN)

    async def _read_loop(self) -> None:
        assert self._sock is not None
        while True:
            try:
                frames = await self._sock.recv_multipart()
            except zmq.ZMQError as exc:
                if exc.errno in (zmq.ETERM, zmq.ENOTSOCK):
                    return
                log.warning("receive failed: %s", exc)
                continue
            if len(frames) != 2:
                log.warning("dropping a message with %d frames (expected identity + payload)", len(frames))
                continue
            identity, payload = frames
            try:
                msg = protocol.gateway_decoder.decode(payload)
            except msgspec.DecodeError as exc:
                log.warning("dropping an undecodable message from %r: %s", identity, exc)
                continue
            try:
                self._dispatch(identity, msg, time.monotonic())
            except Exception:  # a bug here must not kill the reader: every stream would hang
                log.exception("failed to handle %s from %r", type(msg).__name__, identity)

    def _dispatch(self, identity: bytes, msg, now: float) -> None:
        worker = self.table.get(identity)
        if isinstance(msg, protocol.Ready):
            self._on_ready(identity, msg, now)
            return
        if worker is None:
            if not isinstance(msg, protocol.Goodbye):
                self._hello(identity, now)  # a worker from before our (re)start
            return
        worker.last_seen = now
        match msg:
            case protocol.Heartbeat(stats=stats):
                worker.stats = stats
                self.metrics.observe_heartbeat(self.table.served_name(worker), worker.worker_id, stats)
            case protocol.Outputs(items=items):
                for out in items:
                    self._on_output(worker, out, now)
            case protocol.RequestError(request_id=request_id) | protocol.Tokens(request_id=request_id):
                stream = self._streams.get(request_id)
                worker.request_ids.discard(request_id)
                if stream is not None and not stream.is_finished and stream.identity == identity:
                    stream.is_finished = True
                    stream.queue.put_nowait(msg)
            case protocol.Goodbye(reason=reason):
                self._drop_worker(worker, f"said goodbye ({reason})")

    def _on_ready(self, identity: bytes, ready: protocol.Ready, now: float) -> None:
        if ready.protocol_version != protocol.PROTOCOL_VERSION:
            log.error("worker %s speaks protocol %d, we speak %d: ignored",
                      ready.worker_id, ready.protocol_version, protocol.PROTOCOL_VERSION)
            return
        known = self.table.get(identity)
        if known is not None and known.pid == ready.pid:
            known.last_seen = now
            return
        if known is not None:  # same id, new process: whatever the old one ran is gone
            self._drop_worker(known, "restarted")
        self._hello_sent.pop(identity, None)
        self.table.add(identity, ready, now)
        self.metrics.num_workers.set(len(self.table))
        log.info("worker %s ready: model %s, max_model_len %d, speculative %s/%d (%d workers)",
                 ready.worker_id, ready.model, ready.max_model_len, ready.speculative_method,
                 ready.num_speculative_tokens, len(self.table))

    def _hello(self, identity: bytes, now: float) -> None:
        """Asks an unknown worker to drop stale requests and introduce itself with Ready."""
        if now - self._hello_sent.get(identity, -HELLO_INTERVAL) < HELLO_INTERVAL:
            return
        self._hello_sent[identity] = now
        self._send(identity, protocol.GatewayHello(gateway_id=self.gateway_id, live_request_ids=[]))

    def _on_output(self, worker: WorkerInfo, out: protocol.Output, now: float) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None or stream.is_finished or stream.identity != worker.identity:
            return  # late output of an aborted request, or a peer answering for another's request
        if out.finish_reason is not None:
            stream.is_finished = True
            worker.request_ids.discard(out.request_id)
        self.metrics.observe_output(stream.model, out, stream.timing, now)
        stream.queue.put_nowait(out)

    # ------------------------------------------------------------ liveness

    async def _watch_loop(self) -> None:
        interval = min(0.5, self.config.worker_timeout / 4)
        while True:
            await asyncio.sleep(interval)
            for worker in self.table.expired(time.monotonic(), self.config.worker_timeout):
                self._drop_worker(worker, f"silent for more than {self.config.worker_timeout:g} s")

    async def _link_loop(self) -> None:
        """After a disconnect, a no-op hello to each worker: ROUTER_MANDATORY refuses a gone peer.

        libzmq drops the peer's route asynchronously, hence a second probe; disconnects already
        queued are covered by the probes about to run (a flood of them costs one round).
        """
        assert self._monitor is not None
        while True:
            try:
                event = parse_monitor_message(await self._monitor.recv_multipart())
                if event["event"] != zmq.EVENT_DISCONNECTED:
                    continue
                await asyncio.sleep(PROBE_DELAYS[0])
                while await self._monitor.poll(0):
                    await self._monitor.recv_multipart()
            except zmq.ZMQError:
                return
            for delay in PROBE_DELAYS:
                await asyncio.sleep(delay)
                for worker in list(self.table.workers.values()):
                    hello = protocol.GatewayHello(gateway_id=self.gateway_id,
                                                  live_request_ids=sorted(worker.request_ids))
                    if self._send(worker.identity, hello) == zmq.EHOSTUNREACH:
                        self._drop_worker(worker, "connection lost")

    def _drop_worker(self, worker: WorkerInfo, reason: str) -> None:
        if self.table.remove(worker.identity) is None:
            return
        log.warning("worker %s dropped: %s; failing its %d requests", worker.worker_id, reason,
                    len(worker.request_ids))
        self._fail_requests(worker, f"The engine worker was lost ({reason}).", "engine_worker_lost")
        self.metrics.forget_worker(self.table.served_name(worker), worker.worker_id)
        self.metrics.num_workers.set(len(self.table))

    def _fail_requests(self, worker: WorkerInfo, message: str, code: str) -> None:
        now = time.monotonic()
        for request_id in list(worker.request_ids):
            stream = self._streams.get(request_id)
            if stream is None or stream.is_finished:
                continue
            stream.is_finished = True
            stream.queue.put_nowait(protocol.RequestError(request_id=request_id, message=message, status=503,
                                                          error_type="server_error", code=code))
            self.metrics.observe_finish(stream.model, "error", stream.timing, now, 0)
        worker.request_ids.clear()
