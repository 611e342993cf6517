"""Verification's uniforms are keyed by (seed, output position): Sequence.row_uniforms."""

from __future__ import annotations

import numpy as np

from engine.core.sequence import Sequence
from engine.serving.protocol import SamplingParams


def _seq(seed):
    return Sequence("r", [1, 2, 3], SamplingParams(max_tokens=8, temperature=1.0, seed=seed), capacity=64)


def test_a_positions_uniforms_do_not_depend_on_how_steps_group_the_rows():
    seq = _seq(5)
    verify_of_six = seq.row_uniforms(6)  # [6, 2]: one step verifying 5 drafts
    for j in range(6):  # the same positions, one plain step each
        np.testing.assert_array_equal(seq.row_uniforms(1)[0], verify_of_six[j])
        seq.append(7)
    assert seq.row_uniforms(3)[0].tolist() == _seq(5).row_uniforms(9)[6].tolist()  # position 6 from anywhere
    assert not np.array_equal(_seq(6).row_uniforms(6), verify_of_six)  # another seed, other uniforms
    assert not np.array_equal(_seq(None).row_uniforms(6), _seq(None).row_uniforms(6))  # unseeded: fresh keys


def test_row_uniforms_are_uniform_and_uncorrelated():
    u = _seq(123).row_uniforms(20_000)  # [20000, 2]
    assert u.dtype == np.float64 and u.min() >= 0.0 and u.max() < 1.0
    for lane in (u[:, 0], u[:, 1]):
        counts = np.bincount((lane * 20).astype(int), minlength=20)
        chi2 = float(((counts - 1000.0) ** 2 / 1000.0).sum())
        assert chi2 < 43.8, chi2  # 19 degrees of freedom: exceeded by chance with probability 0.001
    for a, b in ((u[:, 0], u[:, 1]), (u[:-1, 1], u[1:, 1])):  # the two lanes; neighbouring positions
        assert abs(np.corrcoef(a, b)[0, 1]) < 0.03  # 4.2 standard errors at n = 20000
