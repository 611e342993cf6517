"""Serving never imports torch (training is an optional extra): every serving module and every
built-in proposer, model-based ones included, imports in a fresh interpreter without pulling it in."""

from __future__ import annotations

import subprocess
import sys

SERVING = ["engine.serving.worker", "engine.llm_engine", "gateway.server", "gateway.app", "proposers.draft_model",
           "proposers.heads.eagle", "proposers.heads.mtp", "proposers.heads.medusa", "proposers.registry"]


def test_serving_modules_do_not_import_torch():
    code = ("import importlib, sys\n"
            f"for name in {SERVING!r}: importlib.import_module(name)\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
