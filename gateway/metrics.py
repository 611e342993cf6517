"""Prometheus metrics with vLLM's names in the `speculant:` namespace.

Latencies are measured in the gateway when engine outputs arrive (as vLLM's frontend
does); running/waiting/KV gauges and the speculative-decoding counters come from
worker heartbeats, labelled by worker (`engine`). Each app owns its registry so
tests can build several apps in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine.serving import protocol

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
SPEC_COUNTERS = {  # WorkerStats field -> help text; exposed as speculant:spec_decode_<field>_total
    "num_drafts": "Speculative decoding steps that proposed drafts.",
    "num_draft_tokens": "Draft tokens proposed.",
    "num_accepted_tokens": "Draft tokens accepted.",
    "num_grammar_tokens": "Accepted draft tokens that a structured-output grammar forced.",
}


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        m, e = ["model_name"], ["model_name", "engine"]
        self.ttft = Histogram("speculant:time_to_first_token_seconds", "Time to first token.", m,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("speculant:inter_token_latency_seconds",
                             "Time between engine outputs of a request (one sample per step).", m,
                             buckets=ITL_BUCKETS, registry=r)
        self.tpot = Histogram("speculant:request_time_per_output_token_seconds",
                              "Mean time per output token after the first, one sample per request.", m,
                              buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("speculant:e2e_request_latency_seconds", "End-to-end request latency.", m,
                             buckets=REQUEST_BUCKETS, registry=r)
        self.queue_time = Histogram("speculant:request_queue_time_seconds",
                                    "Time a request waited in the engine before it was first scheduled.", m,
                                    buckets=REQUEST_BUCKETS, registry=r)
        self.running = Gauge("speculant:num_requests_running", "Requests running in the engine.", e, registry=r)
        self.waiting = Gauge("speculant:num_requests_waiting", "Requests waiting in the engine.", e, registry=r)
        self.kv_usage = Gauge("speculant:kv_cache_usage_perc", "KV-cache usage (0-1).", e, registry=r)
        self.num_workers = Gauge("speculant:num_engine_workers", "Ready engine workers.", registry=r)
        self.pending = Gauge("speculant:num_requests_pending", "Requests in flight in the gateway.", registry=r)
        self.prompt_tokens = Counter("speculant:prompt_tokens", "Prefill tokens processed.", m, registry=r)
        self.generation_tokens = Counter("speculant:generation_tokens", "Generated tokens.", m, registry=r)
        self.request_success = Counter("speculant:request_success", "Finished requests.",
                                       ["model_name", "finished_reason"], registry=r)
        self.preemptions = Counter("speculant:num_preemptions", "Preemptions.", e, registry=r)
        self.spec = {name: Counter(f"speculant:spec_decode_{name}", help_text, e, registry=r)
                     for name, help_text in SPEC_COUNTERS.items()}
        self.spec_per_pos = Counter("speculant:spec_decode_num_accepted_tokens_per_pos",
                                    "Accepted draft tokens at each draft position.", e + ["position"], registry=r)
        self._last_stats: dict[str, protocol.WorkerStats] = {}

    # ------------------------------------------------------------ per request

    def observe_output(self, model: str, out: protocol.Output, timing: RequestTiming, now: float) -> None:
        num_new = len(out.token_ids)
        if num_new:
            if timing.first_token_time is None:
                timing.first_token_time = now
                self.ttft.labels(model).observe(now - timing.arrival_time)
                self.prompt_tokens.labels(model).inc(out.prompt_tokens)
                if out.queue_time is not None:
                    self.queue_time.labels(model).observe(out.queue_time)
            else:
                self.itl.labels(model).observe(now - timing.last_token_time)
            timing.last_token_time = now
            self.generation_tokens.labels(model).inc(num_new)
        if out.finish_reason is not None:
            self.observe_finish(model, out.finish_reason, timing, now, out.completion_tokens)

    def observe_finish(self, model: str, reason: str, timing: RequestTiming, now: float, num_tokens: int) -> None:
        self.request_success.labels(model, reason).inc()
        self.e2e.labels(model).observe(now - timing.arrival_time)
        if timing.first_token_time is not None and num_tokens > 1:
            self.tpot.labels(model).observe((now - timing.first_token_time) / (num_tokens - 1))

    # ------------------------------------------------------------ per worker

    def observe_heartbeat(self, model: str, worker_id: str, stats: protocol.WorkerStats) -> None:
        labels = (model, worker_id)
        self.running.labels(*labels).set(stats.num_running)
        self.waiting.labels(*labels).set(stats.num_waiting)
        self.kv_usage.labels(*labels).set(stats.kv_usage)
        last = self._last_stats.get(worker_id, protocol.WorkerStats())
        self._last_stats[worker_id] = stats
        self.preemptions.labels(*labels).inc(_delta(stats.num_preemptions, last.num_preemptions))
        for name in SPEC_COUNTERS:
            self.spec[name].labels(*labels).inc(_delta(getattr(stats, name), getattr(last, name)))
        for pos, count in enumerate(stats.accepted_per_pos):
            before = last.accepted_per_pos[pos] if pos < len(last.accepted_per_pos) else 0
            self.spec_per_pos.labels(model, worker_id, str(pos)).inc(_delta(count, before))

    def forget_worker(self, model: str, worker_id: str) -> None:
        """Gauges of a dropped worker disappear; its counters keep their totals."""
        self._last_stats.pop(worker_id, None)
        for gauge in (self.running, self.waiting, self.kv_usage):
            try:
                gauge.remove(model, worker_id)
            except KeyError:
                pass


class RequestTiming:
    __slots__ = ("arrival_time", "first_token_time", "last_token_time")

    def __init__(self, arrival_time: float):
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None
        self.last_token_time = arrival_time


def _delta(now: int, before: int) -> int:
    """Workers report running totals; a smaller total means the worker restarted (never negative)."""
    return now - before if now >= before else max(now, 0)
