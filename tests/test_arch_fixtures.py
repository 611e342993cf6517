"""The NumPy reference forward (tests/arch_reference.py) reproduces the committed transformers logits of each
tiny architecture fixture (tests/fixtures/arch/, made by tests/fixtures/make_arch_fixtures.py).

This pins down the GGUF conventions the engine must follow: if it matches the reference on these files, it
reads llama / qwen2 / qwen3 / gemma3 GGUFs as llama.cpp does and computes what transformers computes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from arch_reference import forward, load_gguf

FIXTURES = Path(__file__).parent / "fixtures" / "arch"
ARCHS = ["llama", "qwen2", "qwen3", "qwen3moe", "qwen2moe", "mixtral", "gemma2", "gemma3", "phi3", "smollm3", "granite",
         "granitemoe"]
TOLERANCE = 1e-3


@pytest.mark.parametrize("arch", ARCHS)
def test_reference_matches_transformers(arch):
    model = load_gguf(FIXTURES / f"{arch}.gguf")
    golden = np.load(FIXTURES / f"{arch}_logits.npz")
    for label in ("long", "short"):
        tokens, expected = golden[f"tokens_{label}"], golden[f"logits_{label}"]
        assert expected.shape == (len(tokens), 300)
        logits = forward(model, tokens)
        diff = float(np.max(np.abs(logits - expected)))
        assert diff <= TOLERANCE, f"{arch}/{label}: max |dlogit| = {diff:.2e}"
        np.testing.assert_array_equal(logits.argmax(-1), expected.argmax(-1))


def test_gemma3_layers_and_window():
    """Layers 0-4 local with an 8-key window and RoPE base 1e4, layer 5 global with base 1e6; the long
    sequence is longer than the window, so the window matters."""
    model = load_gguf(FIXTURES / "gemma3.gguf")
    assert model.local_layers == frozenset(range(5))
    assert (model.sliding_window, model.rope_base, model.rope_base_swa) == (8, 1e6, 1e4)
    assert model.head_dim == 32 != model.n_embd // model.n_head
    assert len(np.load(FIXTURES / "gemma3_logits.npz")["tokens_long"]) > model.sliding_window


@pytest.mark.parametrize("arch", ARCHS)
def test_fixture_is_small(arch):
    assert (FIXTURES / f"{arch}.gguf").stat().st_size < 1 << 20
