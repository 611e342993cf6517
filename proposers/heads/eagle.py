"""`eagle`: an EAGLE-style head that autoregresses on the target's features (head_file.py)."""

from __future__ import annotations

from proposers.heads.feature_head import FeatureHeadProposer


class EagleProposer(FeatureHeadProposer):
    head_kind = "eagle"
