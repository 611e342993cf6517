"""YaRN as a GGUF states it: the per-frequency divisors, the cos/sin magnitude, and the keys they come from.

The engine's logits on a YaRN file are checked against transformers by the qwen3 fixture
(tests/test_architectures.py); here the parts, against values worked out by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.model.gguf_loader import GGUFModel
from engine.model.rope_scaling import Yarn, read_yarn

FIXTURES = Path(__file__).parent / "fixtures" / "arch"


def test_yarn_divisors_keep_fast_pairs_and_interpolate_slow_ones():
    """rope_dim 32, base 10000, original context 256: the pair turning 32 times over 256 positions is
    32 ln(256 / 64 pi) / (2 ln 10000) = 0.42 -> floor 0; the one turning once, 32 ln(256 / 2 pi) / (2 ln 10000)
    = 6.44 -> ceil 7. So pair i keeps 1 - i / 7 of its frequency up to 7, and is divided by the factor from there."""
    divisors = Yarn(factor=4.0, original_context=256).divisors(32, 10000.0)
    keep = np.clip(1.0 - np.arange(16) / 7.0, 0.0, 1.0)
    np.testing.assert_allclose(divisors, 1.0 / (keep + (1.0 - keep) / 4.0), rtol=1e-15)
    assert divisors[0] == 1.0 and np.all(divisors[7:] == 4.0)


def test_yarn_magnitude():
    """0.1 ln(factor) + 1; the file's own yarn_attn_factor replaces it; a log multiplier m divides it by
    0.1 m ln(factor) + 1 (m = 1: no scaling at all); nothing kept (ext_factor 0): none."""
    assert Yarn(4.0, 256).magnitude == pytest.approx(1 + 0.1 * np.log(4.0))
    assert Yarn(4.0, 256, attn_factor=0.9).magnitude == 0.9
    assert Yarn(4.0, 256, log_multiplier=1.0).magnitude == pytest.approx(1.0)
    assert Yarn(4.0, 256, log_multiplier=0.5).magnitude == pytest.approx((1 + 0.1 * np.log(4)) / (1 + 0.05 * np.log(4)))
    assert Yarn(4.0, 256, ext_factor=0.0).magnitude == 1.0
    assert Yarn(0.5, 256).magnitude == 1.0  # no extension, no scaling


def test_read_yarn_takes_every_key_and_names_a_missing_factor():
    meta = {"qwen3.rope.scaling.factor": 8.0, "qwen3.rope.scaling.original_context_length": 32768,
            "qwen3.rope.scaling.yarn_beta_fast": 16.0, "qwen3.rope.scaling.yarn_beta_slow": 2.0,
            "qwen3.rope.scaling.yarn_ext_factor": 0.5, "qwen3.rope.scaling.yarn_attn_factor": 1.2,
            "qwen3.rope.scaling.yarn_log_multiplier": 0.7}
    assert read_yarn(meta, "qwen3", 4096) == Yarn(8.0, 32768, 16.0, 2.0, 0.5, 1.2, 0.7)
    assert read_yarn({"llama.rope.scaling.factor": 2.0}, "llama", 4096) == Yarn(2.0, 4096)  # the file's context
    with pytest.raises(ValueError, match="qwen3.rope.scaling.factor"):
        read_yarn({}, "qwen3", 4096)
    # ext_factor 0.5: every pair keeps at most half of its frequency
    assert np.all(Yarn(8.0, 32768, ext_factor=0.5).divisors(64, 1e6) >= 1.0 / (0.5 + 0.5 / 8.0) - 1e-12)


def test_a_yarn_file_gives_its_divisors_and_magnitude_to_the_rope_tables():
    """The qwen3 fixture is Qwen's long-context recipe on a small scale (factor 4, original context 256)."""
    model = GGUFModel(FIXTURES / "qwen3.gguf")
    cfg = model.config
    assert cfg.yarn == Yarn(4.0, 256)
    assert cfg.rope_attn_factor == pytest.approx(1 + 0.1 * np.log(4.0))
    np.testing.assert_array_equal(model.rope_freq_factors(1024), Yarn(4.0, 256).divisors(32, 10000.0))
    assert cfg.rope_scale == 1.0
