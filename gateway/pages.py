"""The browser side of the gateway: a chat playground, a live dashboard, and the stats they read.

The pages are static files under `gateway/static/` (plain HTML, CSS and JavaScript, no build
step, nothing fetched from elsewhere). The playground streams from our own
`/v1/chat/completions` with the opt-in provenance extension; the dashboard polls
`GET /v1/speculant/stats`, which sums the stats the workers send in their heartbeats
and adds the gateway's own token counters.
"""

from __future__ import annotations

import collections
import pathlib
import time

import msgspec
from aiohttp import web

from gateway.generation import ENGINE
from gateway.metrics import GatewayMetrics
from gateway.workers import WorkerInfo

STATIC_DIR = pathlib.Path(__file__).resolve().parent / "static"
STATS_PATH = "/v1/speculant/stats"
RATE_WINDOW = 5.0  # seconds of token-counter history behind `tokens_per_s`
RATE_MIN_SPACING = 0.2  # seconds between kept samples (many dashboards may poll at once)

_json = msgspec.json.Encoder()


class TokenRate:
    """Generated tokens per second over a sliding window, sampled whenever stats are read."""

    def __init__(self, window: float = RATE_WINDOW):
        self.window = window
        self.samples: collections.deque[tuple[float, float]] = collections.deque()  # (monotonic s, total tokens)

    def update(self, now: float, total: float) -> float:
        if not self.samples or now - self.samples[-1][0] >= RATE_MIN_SPACING:
            self.samples.append((now, total))
        while len(self.samples) > 2 and now - self.samples[0][0] > self.window:
            self.samples.popleft()  # sparse polls: the last two samples, however far apart
        first_time, first_total = self.samples[0]
        span = now - first_time
        return (total - first_total) / span if span > 0 else 0.0


TOKEN_RATE = web.AppKey("token_rate", TokenRate)


def add_routes(app: web.Application) -> None:
    app[TOKEN_RATE] = TokenRate()
    app.router.add_get("/", playground)
    app.router.add_get("/playground", playground)
    app.router.add_get("/dashboard", dashboard)
    app.router.add_get(STATS_PATH, stats)
    app.router.add_static("/static/", STATIC_DIR, append_version=False)


async def playground(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC_DIR / "playground.html")


async def dashboard(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC_DIR / "dashboard.html")


async def stats(request: web.Request) -> web.Response:
    client = request.app[ENGINE]
    workers = [_worker_stats(w) for w in client.table.workers.values()]
    gateway = _gateway_counters(client.metrics)
    gateway["num_pending"] = client.num_pending
    gateway["tokens_per_s"] = round(request.app[TOKEN_RATE].update(time.monotonic(), gateway["generation_tokens"]), 3)
    body = {"time": time.time(), "window_s": RATE_WINDOW, "gateway": gateway,
            "totals": aggregate(workers), "workers": workers}
    return web.Response(body=_json.encode(body), content_type="application/json",
                        headers={"Cache-Control": "no-store"})


def _worker_stats(worker: WorkerInfo) -> dict:
    s = worker.stats
    return {"worker_id": worker.worker_id, "model": worker.model, "pid": worker.pid,
            "speculative_method": worker.speculative_method, "num_speculative_tokens": worker.num_speculative_tokens,
            "available_methods": worker.available_methods,
            "num_in_flight": len(worker.request_ids), **msgspec.structs.asdict(s)}


def aggregate(workers: list[dict]) -> dict:
    """Sums over workers; rates follow vLLM's conventions (AL counts the bonus/recovered token)."""
    def total(name: str) -> int:
        return sum(w[name] for w in workers)

    num_total_blocks = total("num_total_blocks")
    num_used_blocks = num_total_blocks - total("num_free_blocks")
    num_positions = max((len(w["accepted_per_pos"]) for w in workers), default=0)
    accepted_per_pos = [sum(w["accepted_per_pos"][i] for w in workers if i < len(w["accepted_per_pos"]))
                        for i in range(num_positions)]  # [num_positions]
    num_drafts, num_draft_tokens = total("num_drafts"), total("num_draft_tokens")
    num_accepted = total("num_accepted_tokens")
    num_queries = total("prefix_cache_queries")
    return {
        "num_workers": len(workers),
        "num_running": total("num_running"),
        "num_waiting": total("num_waiting"),
        "kv_usage": num_used_blocks / num_total_blocks if num_total_blocks else 0.0,
        "num_preemptions": total("num_preemptions"),
        "num_drafts": num_drafts,
        "num_draft_tokens": num_draft_tokens,
        "num_accepted_tokens": num_accepted,
        "acceptance_rate": num_accepted / num_draft_tokens if num_draft_tokens else None,
        "mean_acceptance_length": 1 + num_accepted / num_drafts if num_drafts else None,
        "accepted_per_pos": accepted_per_pos,
        "acceptance_per_pos": [n / num_drafts for n in accepted_per_pos] if num_drafts else [],
        "prefix_cache_hit_rate": total("prefix_cache_hits") / num_queries if num_queries else None,
    }


def _counter_total(counter) -> float:
    """Sum of a labelled prometheus Counter over all its label values."""
    return sum(s.value for family in counter.collect() for s in family.samples if s.name.endswith("_total"))


def _gateway_counters(metrics: GatewayMetrics) -> dict:
    return {"generation_tokens": _counter_total(metrics.generation_tokens),
            "prompt_tokens": _counter_total(metrics.prompt_tokens),
            "num_requests_finished": _counter_total(metrics.request_success)}
