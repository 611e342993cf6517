"""Overload and soak runs against a real gateway + worker on loopback (not part of the test suite).

    python -m benchmarks.load --clients 500 --max-tokens 8          # burst: all at once
    python -m benchmarks.load --soak 10000 --concurrency 32          # soak with random disconnects

Burst: every client sends one streamed completion at the same moment. Each must end with its
full answer (exactly `max_tokens` tokens, one finish, one [DONE], one id of its own) or a 429:
none lost, none duplicated, none stuck (`--timeout`). Prints p50/p99 time to first token.

Soak: `--soak N` requests from `--concurrency` closed-loop clients; a share of them hang up
early (before the first byte, or after a few events). Every `--sample-every` requests it
records the RSS of the gateway and worker processes and the worker's KV usage, prints that
curve, and at the end checks that the engine is idle with every KV block back in the free pool.

By default it starts its own gateway and worker (bounded: loopback only, small KV cache);
`--url` with `--gateway-pid/--worker-pid` measures running servers instead. Exit status 1
when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import urllib.request
from types import SimpleNamespace

import aiohttp
import numpy as np

from benchmarks.serve_servers import LocalServers

PROMPTS = ["Write one sentence about rivers.", "Name three colours:", "The quick brown fox", "Count: one, two,",
           "A short poem about the moon:", "def add(a, b):", "Translate to French: good morning", "Q: 2+2? A:"]


class LoadServers(LocalServers):
    """The bench-serve pair, with our admission limit (so a burst can meet 429s)."""

    def __init__(self, engine_args, max_pending: int, log_dir=None):
        super().__init__(engine_args, log_dir)
        self.max_pending = max_pending

    def _env(self) -> dict:
        return {**super()._env(), "SPECULANT_MAX_PENDING": str(self.max_pending)}


# ---------------------------------------------------------------- one request


async def one_request(session, url: str, max_tokens: int, hang_up_after: int | None, timeout: float) -> dict:
    """Streams one completion; `hang_up_after` = close after that many events (0: before any byte)."""
    body = {"prompt": random.choice(PROMPTS), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    rec = {"status": None, "ids": set(), "finishes": 0, "dones": 0, "tokens": 0, "ttft": None, "error": None}
    start = time.perf_counter()
    if hang_up_after == 0:  # gone within 50 ms: usually before the response headers
        try:
            async with asyncio.timeout(random.uniform(0, 0.05)):
                async with session.post(f"{url}/v1/completions", json=body) as resp:
                    rec["status"] = resp.status
        except TimeoutError:
            pass
        return rec
    try:
        async with asyncio.timeout(timeout):
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                rec["status"] = resp.status
                if resp.status != 200:
                    await resp.read()
                    return rec
                num_events = 0
                async for line in resp.content:
                    if line.startswith(b"data: [DONE]"):
                        rec["dones"] += 1
                    elif line.startswith(b"data: {"):
                        _on_event(rec, json.loads(line[6:]), time.perf_counter() - start)
                        num_events += 1
                        if hang_up_after is not None and num_events >= hang_up_after:
                            return rec  # leaving the block closes the connection mid-stream
    except TimeoutError:
        rec["error"] = "stuck"
    except aiohttp.ClientError as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"
    return rec


def _on_event(rec: dict, event: dict, elapsed: float) -> None:
    if "error" in event:
        rec["error"] = event["error"]["message"]
        return
    rec["ids"].add(event["id"])
    if event.get("usage"):
        rec["tokens"] = event["usage"]["completion_tokens"]
    for choice in event["choices"]:
        if choice.get("text") and rec["ttft"] is None:
            rec["ttft"] = elapsed
        rec["finishes"] += choice.get("finish_reason") is not None


def check_complete(rec: dict, max_tokens: int) -> str | None:
    """Why a 200 stream is not a whole answer, or None."""
    if rec["error"]:
        return rec["error"]
    if (rec["finishes"], rec["dones"], len(rec["ids"])) != (1, 1, 1):
        return f"finishes={rec['finishes']} dones={rec['dones']} ids={len(rec['ids'])}"
    if rec["tokens"] != max_tokens:
        return f"{rec['tokens']} tokens, expected {max_tokens}"
    return None


# ---------------------------------------------------------------- burst


async def burst(url: str, num_clients: int, max_tokens: int, timeout: float) -> dict:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        start = time.perf_counter()
        recs = await asyncio.gather(*(one_request(session, url, max_tokens, None, timeout)
                                      for _ in range(num_clients)))
        wall = time.perf_counter() - start
    ok = [r for r in recs if r["status"] == 200 and check_complete(r, max_tokens) is None]
    refused = [r for r in recs if r["status"] == 429]
    broken = [r for r in recs if r not in ok and r not in refused]
    all_ids = [i for r in ok for i in r["ids"]]
    ttft = [r["ttft"] for r in ok]
    p50, p99 = np.percentile(ttft, [50, 99]) if ttft else (float("nan"),) * 2
    return {"clients": num_clients, "complete": len(ok), "refused_429": len(refused), "lost_or_broken": len(broken),
            "stuck": sum(r["error"] == "stuck" for r in recs), "duplicate_ids": len(all_ids) - len(set(all_ids)),
            "problems": sorted({str(r["status"]) + ": " + str(check_complete(r, max_tokens)) for r in broken})[:5],
            "ttft_p50_ms": round(1000 * p50, 1), "ttft_p99_ms": round(1000 * p99, 1), "wall_s": round(wall, 2)}


# ---------------------------------------------------------------- soak


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            line = next(line for line in f if line.startswith("VmRSS:"))
        return int(line.split()[1]) / 1024
    except (OSError, StopIteration):
        return None


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


async def soak(url: str, num_requests: int, concurrency: int, max_tokens: int, sample_every: int,
               pids: tuple[int | None, int | None], timeout: float) -> dict:
    order = iter(range(num_requests))
    counts = {"complete": 0, "hung_up": 0, "refused_429": 0, "broken": 0}
    problems: list[str] = []
    curve: list[dict] = []
    start = time.perf_counter()

    def sample(done: int) -> None:
        point = {"requests": done, "s": round(time.perf_counter() - start, 1), "gateway_rss_mb": rss_mb(pids[0]),
                 "worker_rss_mb": rss_mb(pids[1]), "kv_usage": round(metric(url, "speculant:kv_cache_usage_perc"), 3)}
        curve.append(point)
        print(json.dumps(point), flush=True)

    async def client(session) -> None:
        for i in order:
            roll = random.random()  # 20 %: hang up before any byte; 20 %: after 1..3 events
            hang_up = 0 if roll < 0.2 else random.randint(1, 3) if roll < 0.4 else None
            rec = await one_request(session, url, max_tokens, hang_up, timeout)
            if rec["status"] == 429:
                counts["refused_429"] += 1
            elif hang_up is not None and rec["error"] is None:
                counts["hung_up"] += 1
            elif rec["status"] == 200 and (why := check_complete(rec, max_tokens)) is None:
                counts["complete"] += 1
            else:
                counts["broken"] += 1
                problems.append(f"{rec['status']}: {rec['error'] or why}")
            if (i + 1) % sample_every == 0:
                await asyncio.to_thread(sample, i + 1)

    await asyncio.to_thread(sample, 0)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    idle = await asyncio.to_thread(wait_idle, url, 30.0)
    sample(num_requests)
    warm = curve[len(curve) // 4]  # the first quarter warms up JIT shapes, allocator pools and caches
    growth = {k: round(curve[-1][k] - warm[k], 1) for k in ("gateway_rss_mb", "worker_rss_mb")
              if curve[-1][k] is not None and warm[k] is not None}
    return {"requests": num_requests, **counts, "problems": sorted(set(problems))[:5], "idle_at_end": idle,
            f"rss_growth_after_{warm['requests']}_requests_mb": growth,
            "wall_s": round(time.perf_counter() - start, 1)}


def wait_idle(url: str, timeout: float) -> bool:
    """Nothing running or pending, every KV block free (the worker's next heartbeats say so)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        names = ("speculant:num_requests_running", "speculant:kv_cache_usage_perc", "speculant:num_requests_pending")
        if all(metric(url, name) == 0 for name in names):
            return True
        time.sleep(0.5)
    return False


# ---------------------------------------------------------------- command line


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.load", description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=0, help="burst: this many concurrent streaming clients")
    p.add_argument("--soak", type=int, default=0, help="soak: this many requests with random disconnects")
    p.add_argument("--concurrency", type=int, default=32, help="soak: closed-loop clients")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--sample-every", type=int, default=0, help="soak: RSS sample interval (default: N/20)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a request counts as stuck")
    p.add_argument("--url", default=None, help="use this running gateway")
    p.add_argument("--gateway-pid", type=int, default=None, help="with --url: for the RSS curve")
    p.add_argument("--worker-pid", type=int, default=None, help="with --url: for the RSS curve")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--max-pending", type=int, default=256, help="the started gateway's 429 threshold")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 3}')
    p.add_argument("--log-dir", default=None)
    args = p.parse_args(argv)
    if not (args.clients > 0) ^ (args.soak > 0):
        p.error("give exactly one of --clients N or --soak N")
    return args


def main(argv=None) -> int:
    args = parse(argv if argv is not None else sys.argv[1:])
    engine_args = SimpleNamespace(model=args.model, max_model_len=512, kv_cache_memory=0.25,
                                  max_num_seqs=args.max_num_seqs, threads=args.threads, max_num_batched_tokens=512,
                                  speculative_config=args.speculative_config)
    if args.url:
        return run(args, args.url, (args.gateway_pid, args.worker_pid))
    with LoadServers(engine_args, args.max_pending, args.log_dir) as servers:
        print(f"servers at {servers.url}, logs in {servers.log_dir}", file=sys.stderr)
        return run(args, servers.url, (servers.procs[0].pid, servers.procs[1].pid))


def run(args, url: str, pids) -> int:
    if args.clients:
        result = asyncio.run(burst(url, args.clients, args.max_tokens, args.timeout))
        failed = result["lost_or_broken"] or result["duplicate_ids"]
    else:
        every = args.sample_every or max(1, args.soak // 20)
        result = asyncio.run(soak(url, args.soak, args.concurrency, args.max_tokens, every, pids, args.timeout))
        failed = result["broken"] or not result["idle_at_end"]
    print(json.dumps(result, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
