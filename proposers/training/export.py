"""Write a trained head in the format of `proposers/heads/head_file.py`: float16 safetensors + JSON."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from proposers.training.modules import DraftHead


def head_config(head: DraftHead, target_name: str, model_config, draft_vocab: np.ndarray, report: dict) -> dict:
    s = head.shape
    return {
        "format": "speculant-head",
        "version": 1,
        "kind": s.kind,
        "hidden_size": s.hidden_size,
        "num_heads": s.num_heads,
        "num_kv_heads": s.num_kv_heads,
        "head_dim": s.head_dim,
        "intermediate_size": s.intermediate_size,
        "rms_eps": s.rms_eps,
        "rope_theta": s.rope_theta,
        "num_modules": s.num_modules,
        "draft_vocab_size": len(draft_vocab),
        "target": {
            "name": target_name,
            "vocab_size": model_config.vocab_size,
            "hidden_size": model_config.hidden_size,
            "num_layers": model_config.num_layers,
        },
        "training": report,
    }


def export_head(head: DraftHead, config: dict, draft_vocab: np.ndarray, out_dir: Path, name: str) -> Path:
    """Write OUT/NAME.safetensors and OUT/NAME.json; returns the .safetensors path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().float().numpy().astype(np.float16) for k, v in head.file_tensors().items()}
    tensors["draft_vocab"] = draft_vocab.astype(np.int32)
    path = out_dir / f"{name}.safetensors"
    save_file(tensors, str(path), metadata={"format": "speculant-head"})
    path.chmod(0o644)  # safetensors writes owner-only files
    path.with_suffix(".json").write_text(json.dumps(config, indent=2) + "\n")
    return path
