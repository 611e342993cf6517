"""The parent's side of llama.cpp in `speculant bench model --peers`: the job, and the ratio rows."""

from __future__ import annotations

import importlib.util
import pathlib

from benchmarks.isolated import run_isolated


def llama_cpp_side(args, model_path: pathlib.Path, prompt_ids: list[int], threads: int,
                   verify_ts: tuple[int, ...]) -> dict | str:
    """llama.cpp's measurements (benchmarks/model_peer.py), or why there are none."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "not installed (benchmarks/install_peers.sh)"
    job = {"model_path": str(model_path), "threads": threads, "context": args.context,
           "long_context": args.long_context, "prefill_tokens": args.prefill_tokens,
           "decode_tokens": args.decode_tokens, "repeats": args.repeats, "verify_ts": list(verify_ts),
           "prompt_ids": prompt_ids}
    return run_isolated("benchmarks.model_peer", job)


def _row(name: str, ours: float, theirs: float, unit: str, higher_is_better: bool) -> str:
    ratio = ours / theirs if higher_is_better else theirs / ours
    return f"  {name:<24s} ours {ours:8.2f} {unit:<6s} llama.cpp {theirs:8.2f} {unit:<6s} -> {ratio:.2f}x llama.cpp"


def report_llama_cpp(res: dict) -> None:
    peer = res["llama_cpp"]
    if isinstance(peer, str):
        print(f"llama.cpp               {peer}")
        return
    print(f"llama.cpp {peer['version']} (same GGUF, same threads; speed ratio: >1 = we are faster):")
    print(_row("decode batch 1", res["decode_tok_s_b1"], peer["decode_tok_s_b1"], "tok/s", True))
    print(_row(f"prefill {res['prefill_tokens']}", res["prefill_tok_s"], peer["prefill_tok_s"], "tok/s", True))
    for t, ms in res["verify_ms"].items():
        theirs = peer["verify_ms"][str(t)] if str(t) in peer["verify_ms"] else peer["verify_ms"][t]
        print(_row(f"append T={t}", ms, theirs, "ms", False) + f"   (their T/T=1 {theirs / _t1(peer):.2f})")
    if "long_decode_ms" in res and "long_decode_ms" in peer:
        print(_row(f"decode step at {res['long_context']}", res["long_decode_ms"], peer["long_decode_ms"], "ms", False))


def _t1(peer: dict) -> float:
    v = peer["verify_ms"]
    return v["1"] if "1" in v else v[1]
