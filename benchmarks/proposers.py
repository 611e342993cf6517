"""CPU cost of the built-in proposers at long contexts: microseconds per proposal.

    python -m benchmarks.proposers --context-len 8192 --batch-sizes 1,16

Contexts are windows of a code-like token stream (Python's own standard library split into words,
ids taken modulo a 49152-token vocabulary), so matches occur about as often as in code. A second
row uses uniformly random tokens: nothing repeats, the n-gram scan never exits early (its worst
case) and suffix matching stops at once (its best case).
"""

from __future__ import annotations

import argparse
import os
import re
import sysconfig
import time

import numpy as np

from engine.spec_decode.spec_config import SpeculativeConfig
from proposers.base import DraftRequest
from proposers.ngram import NgramProposer
from proposers.suffix import SuffixProposer

VOCAB = 49152


def code_like_tokens(num_tokens: int) -> np.ndarray:
    """Words of the stdlib's .py files as ids: real repetition structure, no tokenizer needed."""
    stdlib = sysconfig.get_paths()["stdlib"]
    ids: dict[str, int] = {}
    out: list[int] = []
    for name in sorted(os.listdir(stdlib)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(stdlib, name), encoding="utf-8", errors="ignore") as f:
            out += [ids.setdefault(w, len(ids)) % VOCAB for w in re.findall(r"\w+|[^\w\s]|\n", f.read())]
        if len(out) >= num_tokens:
            break
    return np.resize(np.array(out, dtype=np.int32), num_tokens)


def time_proposals(proposer, requests: list[DraftRequest], iters: int) -> float:
    """Median microseconds per request of one batched propose() call."""
    proposer.propose(requests)  # warm
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        proposer.propose(requests)
        samples.append(time.perf_counter() - start)
    return float(np.median(samples)) / len(requests) * 1e6


def make_requests(stream: np.ndarray, batch: int, context_len: int, k: int) -> list[DraftRequest]:
    stride = max(1, (len(stream) - context_len) // batch)
    return [DraftRequest(f"r{i}", stream[i * stride: i * stride + context_len], context_len // 2, k, 0.0)
            for i in range(batch)]


def bench(kind: str, stream: np.ndarray, args) -> None:
    config = lambda method: SpeculativeConfig(method=method, num_speculative_tokens=args.k)  # noqa: E731
    skip = 2 * args.context_len  # cached responses come from text the contexts do not contain
    cached = code_like_tokens(skip + args.num_cached * 500)[skip:]
    for batch in args.batch_sizes:
        requests = make_requests(stream, batch, args.context_len, args.k)
        ngram = NgramProposer(config("ngram"), VOCAB)
        ngram_us = time_proposals(ngram, requests, args.iters)
        suffix = SuffixProposer(config("suffix"), VOCAB)
        for i in range(args.num_cached):  # finished requests fill the global tree
            suffix.start_request(f"old{i}", cached[:1])
            suffix.extend_request(f"old{i}", cached[i * 500: (i + 1) * 500].tolist())
            suffix.stop_request(f"old{i}")
        start = time.perf_counter()
        for r in requests:
            suffix.start_request(r.request_id, r.token_ids)
        build_us = (time.perf_counter() - start) / (batch * args.context_len) * 1e6
        suffix_us = time_proposals(suffix, requests, args.iters)
        print(f"{kind:<10} {batch:>5} {ngram_us:>12.1f} {suffix_us:>12.1f} {build_us:>16.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="speculant bench proposers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context-len", type=int, default=8192)
    parser.add_argument("--batch-sizes", default="1,16", help="comma-separated")
    parser.add_argument("--k", type=int, default=8, help="max draft tokens per request")
    parser.add_argument("--num-cached", type=int, default=200, help="finished responses in the suffix cache")
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    print(f"context {args.context_len} tokens, K={args.k}, {args.num_cached} cached responses; "
          "us per proposal (median), suffix tree build in us per prompt token")
    print(f"{'tokens':<10} {'batch':>5} {'ngram us':>12} {'suffix us':>12} {'suffix build us':>16}")
    longest = 2 * args.context_len
    bench("code-like", code_like_tokens(longest), args)
    bench("random", np.random.default_rng(0).integers(0, VOCAB, longest, dtype=np.int32), args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
