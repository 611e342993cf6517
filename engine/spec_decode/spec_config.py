"""Speculative-decoding configuration: one frozen dataclass, parsed from `--speculative-config`.

The JSON is flat, as in vLLM and FastDeploy: the generic keys below, plus the chosen method's own
options (e.g. `{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}`); an
explicit `"options": {...}` object is accepted too. The method is looked up in the proposer
registry and its options are validated by the proposer class's own `Options` declaration, so
this module knows no method by name.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from proposers.registry import ProposerRegistry

VERIFY_STRATEGIES = ("greedy", "target_match", "topp", "rejection")
ACCEPT_POLICIES = ("normal", "accept_all", "reject_all")
MAX_NUM_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str  # entry-point name: "naive" | "ngram" | "suffix" | a third-party proposer
    num_speculative_tokens: int  # K, the most drafts per request per step, 0..16
    # None = auto: "greedy" at temperature 0, else "target_match" for one-hot drafts and "rejection" for drafts
    # with q (all lossless; see strategy_for)
    verify_strategy: str | None = None
    accept_policy: str = "normal"  # "accept_all" / "reject_all" are for debugging
    # Load budget: at most this many draft tokens per engine step over the whole batch
    # (FastDeploy's per-step budget, default 128 there too); 0 = unlimited.
    max_draft_tokens_per_step: int = 128
    options: Mapping[str, Any] = field(default_factory=dict)  # method-specific, canonical names
    max_candidate_len: int = 5  # "topp" verify: accept drafts among the target's top this-many
    verify_top_p: float = 1.0  # "topp" verify: ... and within this much of the target's mass
    # True: K per request per step from measured acceptance, verify cost and draft cost;
    # False: always draft the full K (caps and the per-step budget still apply).
    adaptive: bool = True

    def __post_init__(self):
        if not isinstance(self.method, str) or not self.method:
            raise ValueError("speculative_config.method: must be a non-empty proposer name")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 0, MAX_NUM_SPECULATIVE_TOKENS)
        if self.verify_strategy is not None and self.verify_strategy not in VERIFY_STRATEGIES:
            raise ValueError(
                f"speculative_config.verify_strategy: {self.verify_strategy!r} is not one of "
                f"{', '.join(VERIFY_STRATEGIES)} (or null for auto)"
            )
        if self.accept_policy not in ACCEPT_POLICIES:
            raise ValueError(
                f"speculative_config.accept_policy: {self.accept_policy!r} is not one of {', '.join(ACCEPT_POLICIES)}"
            )
        _check_int("max_draft_tokens_per_step", self.max_draft_tokens_per_step, 0, None)
        _check_int("max_candidate_len", self.max_candidate_len, 1, None)
        top_p = self.verify_top_p
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise ValueError(f"speculative_config.verify_top_p: {top_p!r} is not a number in (0, 1]")
        if not isinstance(self.options, Mapping):
            raise ValueError("speculative_config.options: must be an object")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config.adaptive: {self.adaptive!r} is not true or false")
        object.__setattr__(self, "verify_top_p", float(top_p))
        object.__setattr__(self, "options", dict(self.options))  # a private copy

    def strategy_for(self, temperature: float, has_draft_probs: bool = False) -> str:
        """The verify strategy a request gets: greedy at temperature 0; sampled, `target_match` for one-hot drafts
        (model-free, or greedy) and `rejection` for drafts sampled from a proposer's q. For one-hot drafts the two
        accept a draft x with the same probability p(x) and emit the same distribution; target_match emits at
        each position exactly the token plain decoding would sample there, so seeded output stays the same."""
        if self.verify_strategy is not None:
            return self.verify_strategy
        if temperature == 0:
            return "greedy"
        return "rejection" if has_draft_probs else "target_match"


def _check_int(name: str, value: Any, low: int, high: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"speculative_config.{name}: {value!r} is not an integer")
    if value < low or (high is not None and value > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"speculative_config.{name}: {value} is out of range ({bound})")


_GENERIC_KEYS = frozenset(f.name for f in dataclasses.fields(SpeculativeConfig)) - {"method", "options"}


def parse_speculative_config(value: str | Mapping[str, Any] | None,
                             registry: ProposerRegistry | None = None) -> SpeculativeConfig | None:
    """JSON text or a dict -> a validated config; None or "" -> None (no speculation)."""
    if value is None:
        return None
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config: invalid JSON ({exc})") from None
    if not isinstance(value, Mapping):
        raise ValueError("speculative_config: expected a JSON object")
    raw = dict(value)
    method = raw.pop("method", None)
    if not isinstance(method, str) or not method:
        raise ValueError("speculative_config.method: required, the name of a proposer")
    if registry is None:
        from proposers.registry import default_registry

        registry = default_registry()
    try:
        cls = registry.load_proposer_class(method)
    except ValueError as exc:
        raise ValueError(f"speculative_config.method: {exc}") from None
    options = raw.pop("options", {})
    if not isinstance(options, Mapping):
        raise ValueError("speculative_config.options: must be an object")
    generic = {key: raw.pop(key) for key in list(raw) if key in _GENERIC_KEYS}
    for key in raw:
        if key in options:
            raise ValueError(f"speculative_config.{key}: given both at the top level and in options")
    generic.setdefault("num_speculative_tokens", cls.default_num_speculative_tokens)
    return SpeculativeConfig(method=method, options=cls.options_dict({**options, **raw}), **generic)
