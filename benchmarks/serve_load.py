"""The HTTP side of `speculant bench serve`: closed-loop streaming clients and their latency statistics.

Each client streams `/v1/chat/completions` and asks for the opt-in provenance extension,
whose per-chunk `token_ids` tell how many tokens a chunk carries. That matters under
speculative decoding: one chunk (one engine step) may carry several tokens, so the
inter-token latency is reported per chunk (what a client sees between updates) and per
token (each chunk's gap shared out over its tokens).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import aiohttp
import numpy as np

from engine.serving.protocol import ChatMessage


@dataclasses.dataclass(slots=True)
class RequestRecord:
    start: float  # perf_counter seconds
    first_token: float | None = None
    end: float | None = None
    chunk_times: list[float] = dataclasses.field(default_factory=list)  # chunks that carry tokens
    chunk_tokens: list[int] = dataclasses.field(default_factory=list)  # [num_chunks]
    token_ids: list[int] = dataclasses.field(default_factory=list)
    completion_tokens: int = 0  # from the usage chunk
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    error: str | None = None


def request_body(messages: tuple[ChatMessage, ...], params: dict) -> dict:
    return {"messages": [{"role": m.role, "content": m.content} for m in messages], "stream": True,
            "stream_options": {"include_usage": True}, "speculant": {"provenance": True}, **params}


async def stream_chat(session: aiohttp.ClientSession, url: str, body: dict, headers: dict) -> RequestRecord:
    """One streamed chat completion, timed on arrival of each SSE event."""
    record = RequestRecord(start=time.perf_counter())
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return record
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    _on_event(record, json.loads(line[6:]), time.perf_counter())
    except (aiohttp.ClientError, TimeoutError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.end = time.perf_counter()
    return record


def _on_event(record: RequestRecord, event: dict, now: float) -> None:
    if "error" in event:
        record.error = event["error"].get("message", "error event")
        return
    usage = event.get("usage")
    if usage:
        record.completion_tokens = usage["completion_tokens"]
        spec = usage.get("speculative") or {}
        record.num_drafts = spec.get("num_drafts", 0)
        record.num_draft_tokens = spec.get("num_draft_tokens", 0)
        record.num_accepted_tokens = spec.get("num_accepted_tokens", 0)
    token_ids = (event.get("speculant") or {}).get("token_ids") or []
    if not token_ids:
        return
    if record.first_token is None:
        record.first_token = now
    record.chunk_times.append(now)
    record.chunk_tokens.append(len(token_ids))
    record.token_ids.extend(token_ids)


async def run_level(url: str, prompts: list[tuple[ChatMessage, ...]], concurrency: int, num_requests: int,
                    params: dict, headers: dict | None = None) -> tuple[list[RequestRecord], float]:
    """`concurrency` clients, each sending its next request when the last one ends; request i uses
    prompts[i % len(prompts)]. Returns the records in request order and the wall time."""
    order = iter(range(num_requests))
    records: list[RequestRecord | None] = [None] * num_requests
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    connector = aiohttp.TCPConnector(limit=0)

    async def client(session: aiohttp.ClientSession) -> None:
        for i in order:
            body = request_body(prompts[i % len(prompts)], params)
            records[i] = await stream_chat(session, url, body, headers or {})

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        start = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(min(concurrency, num_requests))))
        wall = time.perf_counter() - start
    return records, wall


def percentiles(values, qs=(50, 99)) -> list[float | None]:
    if len(values) == 0:
        return [None for _ in qs]
    return [float(v) for v in np.percentile(np.asarray(values, dtype=np.float64), qs)]


def _p50_p99_ms(seconds) -> dict:
    p50, p99 = percentiles(seconds)
    return {"p50": None if p50 is None else round(1000 * p50, 3), "p99": None if p99 is None else round(1000 * p99, 3)}


def summarize(records: list[RequestRecord], wall: float) -> dict:
    """Latency percentiles in milliseconds and throughput over the level's wall time."""
    ok = [r for r in records if r.error is None]
    ttft = [r.first_token - r.start for r in ok if r.first_token is not None]
    itl_chunk: list[float] = []
    itl_token: list[float] = []  # [num_tokens after each request's first chunk]
    for r in ok:
        gaps = np.diff(r.chunk_times)  # [num_chunks - 1]
        itl_chunk.extend(gaps)
        for gap, num in zip(gaps, r.chunk_tokens[1:]):
            itl_token.extend([gap / num] * num)
    num_tokens = sum(r.completion_tokens for r in ok)
    num_drafts = sum(r.num_drafts for r in ok)
    num_accepted = sum(r.num_accepted_tokens for r in ok)
    num_chunks = sum(len(r.chunk_tokens) for r in ok)
    return {
        "num_requests": len(records),
        "num_errors": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "wall_s": round(wall, 4),
        "num_output_tokens": num_tokens,
        "num_streamed_tokens": sum(sum(r.chunk_tokens) for r in ok),
        "num_chunks": num_chunks,
        "tokens_per_chunk": round(num_tokens / num_chunks, 4) if num_chunks else None,
        "output_tokens_per_s": round(num_tokens / wall, 3) if wall > 0 else None,
        "requests_per_s": round(len(ok) / wall, 4) if wall > 0 else None,
        "ttft_ms": _p50_p99_ms(ttft),
        "itl_chunk_ms": _p50_p99_ms(itl_chunk),
        "itl_token_ms": _p50_p99_ms(itl_token),
        "num_drafts": num_drafts,
        "num_draft_tokens": sum(r.num_draft_tokens for r in ok),
        "num_accepted_tokens": num_accepted,
        "mean_acceptance_length": round(1 + num_accepted / num_drafts, 4) if num_drafts else None,
    }
