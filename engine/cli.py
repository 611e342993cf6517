"""`speculant` console script: one entry point, several subcommands.

Each subcommand imports its own module lazily, so `speculant gateway` never
imports numba and `speculant proposers` never loads a model.
"""

from __future__ import annotations

import argparse
import os
import sys


def _env(flag: str, default):
    """Default of --flag from $SPECULANT_FLAG (so honcho's .env can set every engine flag)."""
    value = os.environ.get("SPECULANT_" + flag.upper().replace("-", "_"))
    if value is None or value == "":
        return default
    return type(default)(value) if default is not None else value


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """Engine flags; each also reads $SPECULANT_<FLAG> (e.g. SPECULANT_SPECULATIVE_CONFIG)."""
    p.add_argument("--model", default=_env("model", "smollm2-135m"), help="GGUF path or a known name (default: smollm2-135m)")
    p.add_argument("--max-model-len", type=int, default=_env("max-model-len", 4096), help="longest prompt + output, in tokens")
    p.add_argument("--kv-cache-memory", type=float, default=_env("kv-cache-memory", 1.0), help="KV cache budget in GiB")
    p.add_argument("--block-size", type=int, default=_env("block-size", 16), help="tokens per KV cache block")
    p.add_argument("--max-num-seqs", type=int, default=_env("max-num-seqs", 256), help="most requests running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=_env("max-num-batched-tokens", 512),
                   help="token budget of one engine step")
    p.add_argument("--threads", type=int, default=_env("threads", 0), help="compute threads (0 = all cores)")
    p.add_argument("--scheduling-policy", default=_env("scheduling-policy", "fcfs"), choices=["fcfs", "priority"],
                   help="fcfs: requests in arrival order; priority: by the request's `priority` (lower first), then "
                        "arrival (as vLLM's)")
    p.add_argument("--numerics", default=_env("numerics", "int8"), choices=["int8", "exact"],
                   help="cpu: int8 = integer weight products on int8-quantized activations (fast); "
                        "exact = strict float32 (matches transformers to 1e-3)")
    p.add_argument("--kv-cache-dtype", default=_env("kv-cache-dtype", "auto"), choices=["auto", "float16", "float32", "int8"],
                   help="cpu: KV cache element type (auto: float16 with int8 numerics, float32 with exact; "
                        "int8: q8_0 blocks of 32, half float16's bytes)")
    p.add_argument("--device", default=_env("device", "cpu"), choices=["cpu", "cuda", "auto"], help="compute backend")
    p.add_argument("--gpu-memory-utilization", type=float, default=_env("gpu-memory-utilization", None),
                   help="cuda: fraction of GPU memory for weights, buffers and KV cache (default: --kv-cache-memory)")
    p.add_argument("--gpu-dtype", default=_env("gpu-dtype", "float16"), choices=["float16", "bfloat16", "float32"])
    p.add_argument("--gpu-batch-invariant", action="store_true",
                   help="cuda: batch-independent weight products (speculative output == plain output)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="cuda: run every step eagerly")
    p.add_argument(
        "--speculative-config",
        default=_env("speculative-config", None),
        help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 5}\'',
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="speculant", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("engine", help="run one engine worker (connects to the gateway over ZeroMQ)")
    _add_model_args(p)
    p.add_argument("--endpoint", default=None, help="gateway endpoint (default: $SPECULANT_ENGINE_ENDPOINT)")
    p.add_argument("--worker-id", default=None, help="worker identity (default: host-pid)")

    p = sub.add_parser("gateway", help="run the OpenAI-compatible HTTP gateway")
    p.add_argument("--host", default=None, help="HTTP host (default: $SPECULANT_HOST or 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="HTTP port (default: $SPECULANT_PORT or 8000)")
    p.add_argument("--endpoint", default=None, help="ZeroMQ endpoint to bind (default: $SPECULANT_ENGINE_ENDPOINT)")
    p.add_argument("--served-model-name", default=None, help="model name shown in /v1/models")

    p = sub.add_parser("fetch", help="download and verify a known model (smollm2-135m, gemma3-270m) into the cache")
    p.add_argument("model", nargs="?", default="smollm2-135m", help="known model name (default: smollm2-135m)")
    p = sub.add_parser("fetch-model", help="the same as `fetch`, with the name as --model")
    p.add_argument("--model", default="smollm2-135m")

    sub.add_parser("proposers", help="list installed proposers (entry point group speculant.proposers)")

    p = sub.add_parser("keygen", help="write CurveZMQ key pairs for a gateway and its workers (SPECULANT_CURVE_DIR)")
    p.add_argument("dir", help="key directory (created; existing keys are never overwritten)")
    p.add_argument("--name", default="worker", help="name of the worker key pair to add (default: worker)")

    p = sub.add_parser("generate", help="generate text in-process (no server), for quick checks")
    _add_model_args(p)
    p.add_argument("prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--chat", action="store_true", help="wrap the prompt with the chat template")

    p = sub.add_parser("bench", help="benchmarks: all (one report), model, spec, serve, peers, ...")
    p.add_argument("what", choices=["all", "model", "spec", "serve", "peers", "proposers", "linear", "gpu"])
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for that benchmark (see --help there)")

    p = sub.add_parser("train-head", help="self-distil an EAGLE / MTP / Medusa draft head (needs speculant[train])")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments (see `speculant train-head --help`)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train-head"]:  # its arguments all start with "--", which argparse's REMAINDER cannot take first
        from proposers.training.cli import main as train_main

        return int(train_main(argv[1:]) or 0)
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        import importlib

        module = importlib.import_module(f"benchmarks.{args.what}")
        return int(module.main(args.rest) or 0)
    handlers = {
        "engine": ("engine.serving.worker", "main"),
        "gateway": ("gateway.server", "main"),
        "fetch": ("engine.model.model_files", "cli_fetch"),
        "fetch-model": ("engine.model.model_files", "cli_fetch"),
        "proposers": ("proposers.registry", "cli_list"),
        "keygen": ("engine.serving.zmq_security", "cli_keygen"),
        "generate": ("engine.generate", "cli_generate"),
    }
    import importlib

    module_name, func = handlers[args.command]
    return int(getattr(importlib.import_module(module_name), func)(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
