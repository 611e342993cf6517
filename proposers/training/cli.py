"""`speculant train-head`: self-distil an EAGLE / MTP / Medusa draft head for a target GGUF.

    speculant train-head --kind eagle --model smollm2-135m --out heads/

1. prompts (built-in corpus or --prompts FILE.jsonl) -> the target's own answers (the engine, in-process);
2. the target's final-normed hidden state at every position (cached in an .npz: the three kinds share it);
3. train the head (torch, CPU) on the training split; 4. report held-out loss and simulated acceptance
   (headline: along the greedy serving walk; beside it: over all answer starts);
5. write NAME.safetensors + NAME.json (see proposers/heads/head_file.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

KINDS = ("eagle", "mtp", "medusa")
DEFAULT_MODULES = {"eagle": 1, "mtp": 2, "medusa": 4}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="speculant train-head", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", required=True, choices=KINDS)
    p.add_argument("--model", default="smollm2-135m", help="target GGUF path or known name (default: smollm2-135m)")
    p.add_argument("--num-modules", type=int, default=None, help="mtp: modules (depths), medusa: heads (default 2 / 4)")
    p.add_argument("--out", default="heads", help="output directory (default: ./heads)")
    p.add_argument("--name", default=None, help="file name stem (default: MODEL-KIND)")
    g = p.add_argument_group("data")
    g.add_argument("--prompts", default=None, help='JSONL, one {"prompt": ...} or {"messages": [...]} a line')
    g.add_argument("--num-prompts", type=int, default=1600, help="built-in corpus: how many prompts")
    g.add_argument("--max-tokens", type=int, default=192, help="longest answer generated per prompt")
    g.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts are skipped")
    g.add_argument("--temperature", type=float, default=0.0, help="answer sampling temperature (0 = greedy)")
    g.add_argument("--held-out", type=float, default=0.1, help="fraction of prompts kept for evaluation")
    g.add_argument("--max-num-seqs", type=int, default=16, help="requests the engine runs at once")
    g.add_argument("--dataset", default=None, help="dataset cache (default: OUT/MODEL-train-data.npz)")
    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=int, default=6)
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--batch-size", type=int, default=8, help="sequence chunks per step")
    g.add_argument("--seq-len", type=int, default=512, help="rows per chunk (attention spans one chunk)")
    g.add_argument("--draft-vocab-size", type=int, default=8192)
    g.add_argument("--intermediate-size", type=int, default=None, help="eagle/mtp FFN width (default: the target's)")
    g.add_argument("--unroll", type=int, default=2, help="eagle: steps trained on the head's own features")
    g.add_argument("--ce-weight", type=float, default=0.5, help="eagle: cross-entropy weight beside SmoothL1")
    g.add_argument("--soft", type=float, default=0.5,
                   help="cross-entropy target: this weight on the target's distribution, the rest on its token")
    g.add_argument("--noise", type=float, default=0.05, help="uniform input-feature noise, relative to the feature RMS")
    g.add_argument("--eval-drafts", type=int, default=5, help="drafts per start in the acceptance simulation")
    g.add_argument("--precision", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="training matmuls (auto: bfloat16 where a timed product shows it faster than float32)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--threads", type=int, default=0, help="compute threads (0 = all cores)")
    return p


def check_args(args) -> None:
    """Clean ValueErrors naming the bad flag."""
    args.num_modules = args.num_modules or DEFAULT_MODULES[args.kind]
    positive = ("num_modules", "num_prompts", "max_tokens", "max_prompt_tokens", "max_num_seqs", "epochs",
                "batch_size", "seq_len", "draft_vocab_size", "unroll", "eval_drafts")
    for name in positive:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.kind == "eagle" and args.num_modules != 1:
        raise ValueError("--num-modules: an eagle head has exactly one module")
    if args.intermediate_size is not None and args.intermediate_size < 1:
        raise ValueError("--intermediate-size must be >= 1")
    if not 0.0 < args.held_out < 1.0:
        raise ValueError(f"--held-out must be in (0, 1), got {args.held_out}")
    if not 0.0 <= args.temperature <= 2.0:
        raise ValueError(f"--temperature must be in [0, 2], got {args.temperature}")
    if args.lr <= 0 or args.ce_weight < 0 or args.noise < 0:
        raise ValueError("--lr must be > 0; --ce-weight and --noise must be >= 0")
    if not 0.0 <= args.soft <= 1.0:
        raise ValueError(f"--soft must be in [0, 1], got {args.soft}")


def target_name(model_arg: str) -> str:
    return Path(model_arg).stem.lower() if model_arg.endswith(".gguf") else model_arg


def data_settings(args, model_path: Path, conversations: list) -> dict:
    """What the cached dataset depends on (a cache made with other settings is rebuilt)."""
    digest = hashlib.sha256(json.dumps(conversations, sort_keys=True).encode()).hexdigest()[:16]
    return {"model": str(model_path), "model_bytes": model_path.stat().st_size, "prompts_sha": digest,
            "num_prompts": len(conversations), "max_tokens": args.max_tokens, "max_prompt_tokens": args.max_prompt_tokens,
            "temperature": args.temperature, "held_out": args.held_out, "seed": args.seed,
            "max_num_seqs": args.max_num_seqs, "threads": args.threads}


def prepare(args):
    """Check the flags, resolve the model and read the prompts (user errors: ValueError naming the flag)."""
    from engine.model.gguf_loader import GGUFModel
    from engine.model.model_files import resolve_model
    from proposers.training import corpus

    check_args(args)
    model_path = resolve_model(args.model)
    if args.prompts:
        conversations = corpus.load_prompts(args.prompts)
    else:
        conversations = corpus.builtin_prompts(args.num_prompts, args.seed)
    return model_path, GGUFModel(model_path), conversations


def run(args, model_path: Path, model, conversations: list) -> dict:
    import torch

    from proposers.training import data, export, train

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    name, out = args.name or f"{target_name(args.model)}-{args.kind}", Path(args.out)
    dataset_path = Path(args.dataset) if args.dataset else out / f"{target_name(args.model)}-train-data.npz"
    start = time.perf_counter()
    ds = data.load_or_build(dataset_path, model_path, conversations, data_settings(args, model_path, conversations))
    data_s = time.perf_counter() - start
    draft_vocab = train.choose_draft_vocab(ds, args.draft_vocab_size, model.config.vocab_size)
    draft_index = train.draft_index_of(draft_vocab, model.config.vocab_size)  # [vocab]
    head = train.build_head(model, args.kind, args.num_modules, args.intermediate_size, draft_vocab, args.seed)
    held_answers = ds.answer_tokens(held_out=True)  # [num_held_out_answer_tokens]
    report = {
        "data": {
            "prompts": ds.num_seqs, "held_out_prompts": len(ds.split(held_out=True)), "tokens": len(ds.token_ids),
            "answer_tokens": len(ds.answer_tokens(held_out=False)) + len(held_answers),
            "max_tokens": ds.meta["max_tokens"], "temperature": ds.meta["temperature"],
            "generate_s": ds.meta.get("generate_s"), "capture_s": ds.meta.get("capture_s"), "load_s": round(data_s, 1),
        },
        "draft_vocab_coverage": round(float(np.mean(draft_index[held_answers] >= 0)) if len(held_answers) else 0.0, 4),
        "config": {k: getattr(args, k) for k in ("lr", "batch_size", "seq_len", "unroll", "ce_weight", "soft", "noise", "seed")},
        **fit_and_evaluate(args, ds, head, draft_vocab, draft_index),
    }
    config = export.head_config(head, target_name(args.model), model.config, draft_vocab, report)
    path = export.export_head(head, config, draft_vocab, out, name)
    report["file"], report["file_bytes"] = str(path), path.stat().st_size
    return report


def fit_and_evaluate(args, ds, head, draft_vocab: np.ndarray, draft_index: np.ndarray) -> dict:
    """Train; held-out loss before and after; simulated acceptance of greedy chain drafting."""
    from proposers.training import evaluate, train

    sample = ds.features[:: max(1, len(ds.features) // 4096)].astype(np.float32)
    feature_rms = float(np.sqrt(np.mean(sample**2)))
    cfg = train.TrainConfig(args.epochs, args.lr, args.batch_size, args.seq_len, args.unroll, args.ce_weight,
                            args.noise * feature_rms, args.soft, args.seed,
                            bf16=args.precision == "bfloat16" or (args.precision == "auto" and train.bf16_is_fast()))
    num_drafts = min(args.eval_drafts, args.num_modules) if args.kind == "medusa" else args.eval_drafts
    held = train.eval_batches(ds, head, cfg, draft_index, num_drafts)
    loss_before, _ = evaluate.mean_loss(head, held, cfg)
    fit = train.train(head, ds, cfg, draft_index)
    loss_after, parts = evaluate.mean_loss(head, held, cfg)
    return {
        **fit,
        "held_out_loss_before": round(loss_before, 4),
        "held_out_loss": round(loss_after, 4),
        "held_out_loss_parts": parts,
        "acceptance": evaluate.acceptance(head, held, num_drafts, draft_vocab),
    }


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    try:
        prepared = prepare(args)
    except ValueError as exc:
        sys.stderr.write(f"speculant train-head: {exc}\n")
        return 2
    report = run(args, *prepared)
    walk, every = report["acceptance"]["served_walk"], report["acceptance"]["all_starts"]
    sys.stdout.write(json.dumps(report, indent=2) + "\n")
    sys.stdout.write(
        f"{args.kind}: {report['steps']} steps in {report['train_s']} s; held-out loss {report['held_out_loss_before']}"
        f" -> {report['held_out_loss']}; served-walk acceptance length {walk['mean_acceptance_length']} over "
        f"{walk['num_steps']} steps (per position {walk['per_position']}); all starts: "
        f"{every['mean_acceptance_length']} over {every['num_starts']}; wrote {report['file']}\n"
    )
    return 0
