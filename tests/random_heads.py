"""Random draft-head files in the shipped format, for tests (small weights, so drafts are plausible tokens)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from proposers.heads.head_file import required_tensors


def write_random_head(path: Path, kind: str, model_config, num_modules: int = 1, draft_vocab_size: int = 512,
                      seed: int = 0, scale: float = 0.02) -> Path:
    from safetensors.numpy import save_file

    c = model_config
    rng = np.random.default_rng(seed)
    cfg = {
        "format": "speculant-head", "version": 1, "kind": kind, "hidden_size": c.hidden_size,
        "num_heads": c.num_heads, "num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size, "rms_eps": c.rms_eps, "rope_theta": c.rope_theta,
        "num_modules": num_modules, "draft_vocab_size": draft_vocab_size,
        "target": {"name": c.name, "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "num_layers": c.num_layers},
    }
    H, I, q, kv = c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"fc": (H, 2 * H), "q": (q, H), "k": (kv, H), "v": (kv, H), "o": (H, q), "gate": (I, H), "up": (I, H),
              "down": (H, I), "w": (H, H)}
    tensors = {"draft_vocab": np.sort(rng.choice(c.vocab_size, draft_vocab_size, replace=False)).astype(np.int32)}
    for name in required_tensors(cfg)[1:]:
        part = name.split(".")[1]
        if name.endswith("bias"):
            tensors[name] = np.zeros(H, np.float16)
        elif part in shapes:
            tensors[name] = (rng.standard_normal(shapes[part]) * scale).astype(np.float16)
        else:  # norms
            tensors[name] = np.ones(H, np.float16)
    path = Path(path).with_suffix(".safetensors")
    save_file(tensors, str(path))
    path.with_suffix(".json").write_text(json.dumps(cfg))
    return path
