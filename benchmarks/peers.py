"""`speculant bench peers`: Speculant beside llama.cpp and Hugging Face transformers, same model, same prompts.

    speculant bench peers --per-category 2 --max-tokens 96 --out results/peers/

On the same GGUF file and the same prompts (the built-in suite or `--prompts`),
greedy, up to `--max-tokens` each, with `--threads` compute threads:
- llama.cpp (llama-cpp-python), plain and with its prompt-lookup decoding;
- transformers (fp32 on the CPU), plain and with `prompt_lookup_num_tokens`;
- Speculant in-process, plain and with each of `--methods` (ngram, suffix), through
  `benchmarks.spec`; the faster method of this run is Speculant's "best".

Every system gets the same text: each prompt is rendered once with our tokenizer's chat template.
Each system is warmed up before it is timed, and the two modes of a peer alternate prompt by
prompt. The printed table gives end-to-end tokens/s, decode tokens/s (1 / mean time per output
token after the first), the decode ratio to Speculant's best and plain modes, and whether each
system's speculative outputs equal its own plain outputs. Ratios use decode speed because the
systems treat a repeated prompt differently (Speculant's prefix cache holds every prompt after
the warm-up, llama.cpp reuses the previous prompt's common prefix, transformers recomputes it).
A peer that is not installed is reported as such and skipped. Each peer runs in its own process
(`benchmarks.peer_child`): one that crashes (a llama.cpp built for another CPU) is reported as
"crashed (signal N)" and the run goes on. The report names the CPU, its vector extensions and the
kernel path Speculant took.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from importlib import metadata
from types import SimpleNamespace

from benchmarks import spec
from benchmarks.isolated import run_isolated
from benchmarks.peers_report import format_markdown, format_table, make_rows
from benchmarks.peers_systems import LOOKUP_TOKENS, PEERS, PeerOptions, PromptRun
from benchmarks.prompts import BenchPrompt

WARMUP_TOKENS = 16
DEFAULT_METHODS = "ngram,suffix"


def parse(argv):
    p = argparse.ArgumentParser(prog="speculant bench peers", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="GGUF path or known name (default: smollm2-135m)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--peers", default=",".join(PEERS), help=f"comma list of peers to run ({', '.join(PEERS)})")
    p.add_argument("--methods", default=DEFAULT_METHODS, help="Speculant's speculative methods; the fastest is its best")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help=f"K for every system (default: Speculant's per-method K; peers {LOOKUP_TOKENS})")
    p.add_argument("--categories", default=None, help="comma list (default: all)")
    p.add_argument("--prompts", default=None, help="JSONL file of your own prompts")
    p.add_argument("--per-category", type=int, default=None, help="use at most this many prompts per category")
    p.add_argument("--threads", type=int, default=0, help="compute threads for every system (0 = all cores)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-memory", type=float, default=0.25, help="GiB per Speculant engine")
    p.add_argument("--out", default=None, help="directory for peers.json and peers.md")
    return p.parse_args(argv)


def check(args) -> list[str]:
    """Bad flags -> ValueError naming the flag; returns the peers to run."""
    for flag in ("max_tokens", "max_model_len"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')}: must be >= 1")
    if args.per_category is not None and args.per_category < 1:
        raise ValueError("--per-category: must be >= 1")
    if args.threads < 0:
        raise ValueError("--threads: must be >= 0")
    if args.num_speculative_tokens is not None and args.num_speculative_tokens < 1:
        raise ValueError("--num-speculative-tokens: must be >= 1")
    peers = [n.strip() for n in args.peers.split(",") if n.strip()]
    for name in peers:
        if name not in PEERS:
            raise ValueError(f"--peers: unknown peer {name!r} (known: {', '.join(PEERS)})")
    methods = [m.strip() for m in args.methods.split(",") if m.strip() and m.strip() != "none"]
    if not methods:
        raise ValueError("--methods: give at least one speculative method")
    args.methods = ",".join(methods)
    return peers


# ---------------------------------------------------------------- Speculant


def run_speculant(args, prompts: list[BenchPrompt]) -> dict:
    """Plain decoding and each method of --methods, timed by `benchmarks.spec` (batch 1)."""
    configs = spec.method_configs("none," + args.methods, [], args.num_speculative_tokens)
    engine_args = SimpleNamespace(model=args.model, max_model_len=args.max_model_len,
                                  kv_cache_memory=args.kv_cache_memory, threads=args.threads)
    engines = {label: spec.build_engine(engine_args, cfg, 1) for label, cfg in configs.items()}
    result = spec.run_spec_bench(engines, prompts, max_tokens=args.max_tokens, concurrency=1)
    modes = []
    for row in (r for r in result["rows"] if r["category"] == "all"):
        method = result["methods"][row["method"]]
        mode = {"mode": "plain" if method is None else f"{row['method']} K={method['num_speculative_tokens']}",
                "speculative": method is not None, "num_prompts": row["num_prompts"],
                "output_tokens": row["output_tokens"], "wall_s": row["wall_s"], "tok_s": row["tok_s"],
                "tpot_ms": row["tpot_ms"], "decode_tok_s": 1000 / row["tpot_ms"] if row["tpot_ms"] else None}
        if method is not None:
            mode.update(same_as_plain=row["num_identical"], al=row["al"])
        modes.append(mode)
    best = max((m for m in modes if m["speculative"]), key=lambda m: m["decode_tok_s"] or 0)
    best["best"] = True
    return {"system": "speculant", "status": "ok", "version": _our_version(),
            "compared_by": "token ids", "same_prompt_ids": len(prompts), "modes": modes,
            "spec_rows": [{k: v for k, v in r.items() if k != "mismatches"} for r in result["rows"]]}


def _our_version() -> str:
    try:
        return metadata.version("speculant")
    except metadata.PackageNotFoundError:
        return "source checkout"


# ---------------------------------------------------------------- peers


def summarize(runs: list[PromptRun]) -> dict:
    """The same sums and means `benchmarks.spec` reports for Speculant, from a peer's runs."""
    tokens, wall = sum(r.num_tokens for r in runs), sum(r.wall_s for r in runs)
    tpots = [(r.wall_s - r.first_s) / (r.num_tokens - 1) for r in runs if r.num_tokens > 1 and r.first_s is not None]
    tpot_ms = 1000 * sum(tpots) / len(tpots) if tpots else None
    return {"num_prompts": len(runs), "output_tokens": tokens, "wall_s": wall, "tok_s": tokens / wall if wall else None,
            "tpot_ms": tpot_ms, "decode_tok_s": 1000 / tpot_ms if tpot_ms else None}


def run_peer(name: str, opts: PeerOptions, texts: dict[str, str], our_ids: dict[str, list[int]],
             max_tokens: int) -> dict:
    """One peer's result, or its status when it is not installed or fails (reported, never fatal)."""
    peer = PEERS[name]()
    missing = peer.missing()
    if missing:
        return {"system": name, "status": missing}
    try:
        peer.load(opts)
        runs = time_peer(peer, peer.modes(opts), texts, max_tokens)
    except Exception as exc:
        print(f"speculant bench peers: {name} failed: {exc!r}", file=sys.stderr)
        return {"system": name, "status": f"failed: {type(exc).__name__}: {exc}"}
    modes = list(runs)
    plain = {r.prompt_id: r.output for r in runs[modes[0]]}
    out_modes = []
    for mode in modes:
        row = {"mode": mode, "speculative": mode != modes[0], **summarize(runs[mode])}
        if row["speculative"]:
            row["same_as_plain"] = sum(r.output == plain[r.prompt_id] for r in runs[mode])
        out_modes.append(row)
    return {"system": name, "status": "ok", "version": peer.version, "compared_by": peer.compared_by,
            "same_prompt_ids": sum(peer.prompt_ids(t) == our_ids[pid] for pid, t in texts.items()),
            "modes": out_modes, "outputs": {mode: {r.prompt_id: r.output for r in rs} for mode, rs in runs.items()}}


def run_peer_isolated(name: str, opts: PeerOptions, texts: dict[str, str], our_ids: dict[str, list[int]],
                      max_tokens: int) -> dict:
    """`run_peer` in a child process (benchmarks/peer_child.py); a crash becomes the peer's status."""
    missing = PEERS[name]().missing()  # asked here: cheap, and no child for a peer that is not there
    if missing:
        return {"system": name, "status": missing}
    job = {"name": name, "model_path": str(opts.model_path), "threads": opts.threads,
           "max_model_len": opts.max_model_len, "num_lookup_tokens": opts.num_lookup_tokens,
           "texts": texts, "our_ids": our_ids, "max_tokens": max_tokens}
    result = run_isolated("benchmarks.peer_child", job)
    if isinstance(result, str):
        print(f"speculant bench peers: {name} {result}", file=sys.stderr)
        return {"system": name, "status": result}
    return result


def time_peer(peer, modes: list[str], texts: dict[str, str], max_tokens: int) -> dict[str, list[PromptRun]]:
    """Every prompt in every mode, the modes alternating prompt by prompt, after one warm-up per mode."""
    first_id, first_text = next(iter(texts.items()))
    for mode in modes:
        peer.generate(mode, first_id, first_text, min(WARMUP_TOKENS, max_tokens))
    runs: dict[str, list[PromptRun]] = {mode: [] for mode in modes}
    for prompt_id, text in _progress(list(texts.items()), peer.name):
        for mode in modes:
            runs[mode].append(peer.generate(mode, prompt_id, text, max_tokens))
    return runs


def _progress(items, desc: str):
    from tqdm import tqdm

    return tqdm(items, desc=f"bench peers: {desc}", unit="prompt", file=sys.stderr)


def render_prompts(model_path: pathlib.Path, prompts: list[BenchPrompt]) -> tuple[dict, dict]:
    """prompt id -> text rendered with our chat template, and -> our token ids of that text."""
    from engine.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(model_path)
    texts = {p.prompt_id: tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in p.messages])
             for p in prompts}
    return texts, {pid: tokenizer.encode(text) for pid, text in texts.items()}


# ---------------------------------------------------------------- CLI


def run(args, peers: list[str], prompts: list[BenchPrompt]) -> dict:
    from engine.model.model_files import resolve_model

    load_before = os.getloadavg()[0]
    model_path = resolve_model(args.model)
    texts, our_ids = render_prompts(model_path, prompts)
    systems = [run_speculant(args, prompts)]
    opts = PeerOptions(model_path, args.threads, args.max_model_len, args.num_speculative_tokens or LOOKUP_TOKENS)
    systems += [run_peer_isolated(name, opts, texts, our_ids, args.max_tokens) for name in peers]
    config = {"model": args.model, "model_path": str(model_path), "max_tokens": args.max_tokens,
              "threads": args.threads, "temperature": 0.0, "num_prompts": len(prompts),
              "prompts": {p.prompt_id: p.category for p in prompts}, "load_avg_1m_before": round(load_before, 2),
              "machine": spec.machine_info()}
    return {"config": config, "systems": systems, "rows": make_rows(systems)}


def write_all(result: dict, out_dir: str | pathlib.Path) -> list[pathlib.Path]:
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "peers.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "peers.md").write_text(format_markdown(result))
    return [out / "peers.json", out / "peers.md"]


def main(argv=None) -> int:
    args = parse(argv or [])
    try:
        peers = check(args)
        spec.method_configs("none," + args.methods, [], args.num_speculative_tokens)  # names the bad field
        prompts = spec.load_suite(args)
    except ValueError as exc:
        print(f"speculant bench peers: error: {exc}", file=sys.stderr)
        return 2
    result = run(args, peers, prompts)
    print(format_table(result))
    if args.out:
        for path in write_all(result, args.out):
            print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
