"""`speculant bench serve`: a concurrency sweep over real HTTP, against the engine driven in-process.

    speculant bench serve --levels 1,4,16,64 --requests 64 --max-tokens 64 --json serve.json

It starts a gateway and one engine worker (or uses `--url`), then for each concurrency level
runs a fixed number of streamed chat completions from that many closed-loop clients
(aiohttp, one request after another per client) and prints TTFT, inter-token latency per
chunk and per token (a chunk is one engine step and carries several tokens when drafts are
accepted), and output tokens/s. The same prompts then run through `engine.generate.generate`
in this process, in waves of `level` requests, and the difference in wall time per output
token is the serving stack's overhead (HTTP, JSON, SSE, ZeroMQ, the gateway's event loop).

Fairness: greedy decoding with `ignore_eos`, so every request makes exactly `--max-tokens`
tokens in both modes (and, the engine being batch-invariant, the same tokens: reported as
`same_output_fraction`); both modes are warmed up on every prompt first (JIT, prefix cache);
per level the HTTP run and the direct run go back to back, so drifting background load hits
both alike, and never at the same time (the idle worker only sends heartbeats). The load
generator runs on the same machine as the servers and takes some of its CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from types import SimpleNamespace

import msgspec

from benchmarks.prompts import builtin_prompts, load_prompts
from benchmarks.serve_load import run_level, summarize
from benchmarks.serve_servers import LocalServers, wait_ready
from engine.serving.protocol import SamplingParams

DEFAULT_LEVELS = "1,4,16,64"


def parse(argv):
    p = argparse.ArgumentParser(prog="speculant bench serve", description=__doc__.split("\n")[0])
    p.add_argument("--url", default=None, help="use this running gateway instead of starting one")
    p.add_argument("--api-key", default=os.environ.get("SPECULANT_API_KEY"), help="sent as a Bearer token")
    p.add_argument("--model", default="smollm2-135m", help="GGUF path or known name (worker and direct engine)")
    p.add_argument("--levels", default=DEFAULT_LEVELS, help="comma list of concurrent clients")
    p.add_argument("--requests", type=int, default=64, help="requests per level")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--speculative-config", default=None, help="JSON, passed to the worker and the direct engine")
    p.add_argument("--prompts", default=None, help="JSONL prompt file (default: the built-in suite)")
    p.add_argument("--threads", type=int, default=0, help="engine compute threads (0 = all cores)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-memory", type=float, default=1.0, help="GiB")
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: the largest level")
    p.add_argument("--no-direct", action="store_true", help="skip the in-process comparison")
    p.add_argument("--json", default=None, metavar="FILE", help="write the results here")
    p.add_argument("--log-dir", default=None, help="where the started servers log (default: a temp dir)")
    return p.parse_args(argv)


def check(args) -> list[int]:
    """Bad flags -> ValueError naming the flag; returns the levels."""
    try:
        levels = [int(x) for x in args.levels.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--levels: expected a comma list of integers, got {args.levels!r}") from None
    if not levels or min(levels) < 1:
        raise ValueError(f"--levels: every level must be >= 1, got {args.levels!r}")
    for flag in ("requests", "max_tokens"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')}: must be >= 1")
    if not 0.0 <= args.temperature <= 2.0:
        raise ValueError("--temperature: must be in [0, 2]")
    if args.url and args.speculative_config:
        raise ValueError("--speculative-config: configures the worker this command starts; drop --url")
    if args.speculative_config:
        from engine.spec_decode.spec_config import parse_speculative_config

        parse_speculative_config(args.speculative_config)  # raises ValueError naming the field
    return levels


def engine_args(args, levels: list[int]) -> SimpleNamespace:
    return SimpleNamespace(model=args.model, max_model_len=args.max_model_len, kv_cache_memory=args.kv_cache_memory,
                           block_size=16, max_num_seqs=args.max_num_seqs or max(levels),
                           max_num_batched_tokens=512, threads=args.threads, device="cpu",
                           speculative_config=args.speculative_config, served_model_name=None)


def http_params(args) -> dict:
    return {"max_tokens": args.max_tokens, "temperature": args.temperature, "ignore_eos": True}


def auth_headers(args) -> dict:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


async def http_level(url: str, prompts, level: int, args) -> dict:
    records, wall = await run_level(url, prompts, level, args.requests, http_params(args), auth_headers(args))
    row = {"concurrency": level, **summarize(records, wall), "_token_ids": [r.token_ids for r in records]}
    print(f"  http   c={level:<3} {row['output_tokens_per_s']} tok/s, {row['num_errors']} errors", file=sys.stderr)
    return row


async def http_warmup(url: str, prompts, args) -> None:
    """Every prompt once: JIT-compiled paths and prompt KV in the prefix cache, as the direct engine gets."""
    params = {**http_params(args), "max_tokens": 4}
    await run_level(url, prompts, len(prompts), len(prompts), params, auth_headers(args))


class Direct:
    """The same requests through `engine.generate.generate`, `level` at a time, in this process."""

    def __init__(self, args, levels: list[int], prompts):
        from engine.llm_engine import LLMEngine

        self.engine = LLMEngine.from_args(engine_args(args, levels))
        self.prompts, self.num_requests = prompts, args.requests
        self.params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=True)
        self._generate(list(prompts), msgspec.structs.replace(self.params, max_tokens=4))  # warm-up

    def _generate(self, prompts, params):
        from engine.generate import generate

        return generate(self.engine, [list(p) for p in prompts], params)

    def level(self, level: int) -> dict:
        batch = [self.prompts[i % len(self.prompts)] for i in range(self.num_requests)]
        outputs, start = [], time.perf_counter()
        for lo in range(0, len(batch), level):
            outputs += self._generate(batch[lo:lo + level], self.params)
        wall = time.perf_counter() - start
        num_tokens = sum(len(c.token_ids) for c in outputs)
        row = {"wall_s": round(wall, 4), "num_output_tokens": num_tokens,
               "output_tokens_per_s": round(num_tokens / wall, 3), "_token_ids": [c.token_ids for c in outputs]}
        print(f"  direct c={level:<3} {row['output_tokens_per_s']} tok/s", file=sys.stderr)
        return row


def compare(http_row: dict, direct_row: dict) -> dict:
    """Overhead = wall time per output token via HTTP minus in-process, in ms."""
    per_token_http = http_row["wall_s"] / max(http_row["num_output_tokens"], 1)
    per_token_direct = direct_row["wall_s"] / max(direct_row["num_output_tokens"], 1)
    same = sum(a == b for a, b in zip(http_row["_token_ids"], direct_row["_token_ids"]))
    return {"direct_output_tokens_per_s": direct_row["output_tokens_per_s"],
            "direct_wall_s": direct_row["wall_s"],
            "overhead_ms_per_token": round(1000 * (per_token_http - per_token_direct), 4),
            "http_vs_direct_throughput": round(http_row["output_tokens_per_s"] / direct_row["output_tokens_per_s"], 4),
            "same_output_fraction": round(same / max(len(http_row["_token_ids"]), 1), 4)}


def _cell(x, spec: str = "{:.1f}") -> str:
    return "–" if x is None else spec.format(x)


def _pair(row: dict, key: str) -> str:
    return f"{_cell(row[key]['p50'])} / {_cell(row[key]['p99'])}"


def format_table(rows: list[dict]) -> str:
    head = ("clients", "reqs", "TTFT p50/p99 ms", "ITL/chunk p50/p99 ms", "ITL/token p50/p99 ms", "tok/chunk",
            "tok/s http", "tok/s direct", "overhead ms/tok", "AL")
    lines = [" | ".join(head), " | ".join("-" * len(h) for h in head)]
    for r in rows:
        cells = (str(r["concurrency"]), f"{r['num_requests'] - r['num_errors']}/{r['num_requests']}",
                 _pair(r, "ttft_ms"), _pair(r, "itl_chunk_ms"), _pair(r, "itl_token_ms"),
                 _cell(r["tokens_per_chunk"], "{:.2f}"), _cell(r["output_tokens_per_s"]),
                 _cell(r.get("direct_output_tokens_per_s")), _cell(r.get("overhead_ms_per_token"), "{:.2f}"),
                 _cell(r["mean_acceptance_length"], "{:.2f}"))
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def sweep(url: str, args, levels: list[int], prompts) -> list[dict]:
    """Per level, HTTP then direct back to back, so a change in background load hits both alike."""
    direct = None if args.no_direct else Direct(args, levels, prompts)
    asyncio.run(http_warmup(url, prompts, args))
    rows = []
    for level in levels:
        wait_ready(url, timeout=60)  # a worker dropped by the gateway comes back on its own
        row = asyncio.run(http_level(url, prompts, level, args))
        if direct is not None:
            row.update(compare(row, direct.level(level)))
            if args.temperature > 0:
                row["same_output_fraction"] = None  # sampled outputs differ run to run
        row.pop("_token_ids")
        rows.append(row)
    return rows


def run(args, levels: list[int], prompts) -> dict:
    load_before = os.getloadavg()
    if args.url:
        wait_ready(args.url, timeout=30)
        rows = sweep(args.url.rstrip("/"), args, levels, prompts)
    else:
        with LocalServers(engine_args(args, levels), args.log_dir) as servers:
            rows = sweep(servers.url, args, levels, prompts)
    settings = {k: getattr(args, k) for k in ("url", "model", "requests", "max_tokens", "temperature",
                                              "speculative_config", "threads", "max_model_len", "prompts")}
    machine = {"cpus": os.cpu_count(), "load_avg_before": [round(x, 2) for x in load_before],
               "load_avg_after": [round(x, 2) for x in os.getloadavg()]}
    return {"settings": {**settings, "levels": levels, "num_prompts": len(prompts), "ignore_eos": True},
            "machine": machine, "levels": rows}


def main(argv=None) -> int:
    args = parse(argv or [])
    try:
        levels = check(args)
        prompts = [p.messages for p in (load_prompts(args.prompts) if args.prompts else builtin_prompts())]
    except ValueError as exc:
        print(f"speculant bench serve: error: {exc}", file=sys.stderr)
        return 2
    result = run(args, levels, prompts)
    print(format_table(result["levels"]))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=2)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
