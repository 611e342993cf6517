"""The proposer plugin contract: what the engine hands a proposer and what it gets back.

A proposer drafts tokens for the target model to verify. The engine makes ONE batched
`propose()` call per step, and keeps every proposer informed of each request's tokens through
`start_request` / `extend_request` / `stop_request`, so stateful proposers (suffix trees,
caches) never have to diff token arrays themselves.

Plugins subclass `Proposer`, declare their options as a `msgspec.Struct` with
`forbid_unknown_fields=True`, and register a `speculant.proposers` entry point. The engine
checks `api_version` at load time.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import msgspec
import numpy as np

API_VERSION = 1


class ProposerConfig(Protocol):
    """What a proposer reads of `--speculative-config` (the engine's SpeculativeConfig has these).

    The contract names no engine type, so a plugin depends on this module alone.
    """

    method: str  # the entry-point name
    num_speculative_tokens: int  # K
    options: Mapping[str, Any]  # method-specific options, canonical names (see `parse_options`)


@dataclass(slots=True)
class DraftRequest:
    """One running request as the proposer sees it at this step."""

    request_id: str
    token_ids: np.ndarray  # [num_tokens] int32: prompt + accepted output so far (a view: do not keep it)
    num_prompt_tokens: int
    max_draft_tokens: int  # this step's cap, 0..K (per-request cap and load budget already applied)
    temperature: float
    rng: np.random.Generator | None = None  # the request's own generator (seeded requests), for sampled drafts
    # A proposer with several draft sources (`Proposer.draft_sources`): this step's cap per source,
    # each <= max_draft_tokens; None = max_draft_tokens for every source.
    caps: Mapping[str, int] | None = None

    def cap(self, source: str) -> int:
        """Draft tokens `source` may give this request this step."""
        return self.max_draft_tokens if self.caps is None else min(self.caps.get(source, 0), self.max_draft_tokens)


@dataclass(slots=True)
class TargetModel:
    """What a model-based proposer may use of the target: its weights, runner and cache shape."""

    model: Any  # the opened GGUF (engine's GGUFModel: `config`, `tensor(name)`, tokenizer metadata)
    runner: Any  # the engine's runner (packed weights; `hidden_states()` after a forward)
    cache: Any  # the engine's CacheConfig (block_size, num_blocks, max_model_len, max_num_seqs, ...)
    numerics: str = "exact"  # the target's weight products ("int8" or "exact"); a proposer's own use the same


@dataclass(slots=True)
class Drafts:
    """Ragged drafts for a batch, in the order of the `DraftRequest` list."""

    token_ids: list[np.ndarray]  # request i: [num_drafts_i] int32, 0 <= num_drafts_i <= max_draft_tokens_i
    # per request [num_drafts_i, vocab] float32 draft distribution q, or None = one-hot (model-free)
    probs: list[np.ndarray | None] | None = None
    # per request the source that drafted (`Proposer.draft_sources`); None = the proposer's first
    sources: list[str | None] | None = None
    # seconds spent per source; None = the whole call was the first source's
    seconds: dict[str, float] | None = None

    @classmethod
    def empty(cls, num_requests: int) -> Drafts:
        return cls(token_ids=[np.empty(0, dtype=np.int32) for _ in range(num_requests)])


class NoOptions(msgspec.Struct, forbid_unknown_fields=True):
    """Options of a proposer that takes none: every key is unknown."""


_AT_FIELD = re.compile(r"- at `\$\.([A-Za-z0-9_]+)")


class Proposer:
    """Base class of every proposer; subclasses override `propose` and the hooks they need."""

    api_version: ClassVar[int] = API_VERSION
    # Method-specific options; unknown keys are rejected generically from this declaration.
    Options: ClassVar[type[msgspec.Struct]] = NoOptions
    # Other projects' names for our options, e.g. vLLM's prompt_lookup_max -> max_ngram_size.
    option_aliases: ClassVar[Mapping[str, str]] = {}
    # K when the user's config does not say.
    default_num_speculative_tokens: ClassVar[int] = 5
    # True: the engine hands over the target's final-normed hidden states (`observe_hidden`).
    uses_hidden_states: ClassVar[bool] = False

    def __init__(self, config: ProposerConfig, vocab_size: int):
        self.config = config
        self.vocab_size = vocab_size
        self.options = self.parse_options(config.options)

    @property
    def draft_sources(self) -> tuple[str, ...]:
        """The ways this proposer drafts. The engine keeps acceptance per request and source and
        draft cost per source, and caps each source separately (`DraftRequest.caps`); a proposer
        that drafts in one way has one source, its method's name."""
        return (self.config.method,)

    @classmethod
    def parse_options(cls, options: Mapping[str, Any]) -> msgspec.Struct:
        """Validate user options into `cls.Options`; a bad key or value is a ValueError naming it."""
        canonical = cls._resolve_aliases(options)
        known = cls.Options.__struct_fields__
        for key in canonical:
            if key not in known:
                names = ", ".join(sorted([*known, *cls.option_aliases])) or "none"
                raise ValueError(
                    f"speculative_config.{key}: not an option of {cls.__name__}; its options are: {names}"
                )
        try:
            return msgspec.convert(canonical, cls.Options)
        except msgspec.ValidationError as exc:
            match = _AT_FIELD.search(str(exc))
            field = f".{match.group(1)}" if match else ""
            raise ValueError(f"speculative_config{field}: {exc}") from None

    @classmethod
    def _resolve_aliases(cls, options: Mapping[str, Any]) -> dict[str, Any]:
        canonical: dict[str, Any] = {}
        for key, value in options.items():
            target = cls.option_aliases.get(key, key)
            if target in canonical:
                raise ValueError(f"speculative_config.{key}: given twice (as {target} and an alias of it)")
            canonical[target] = value
        return canonical

    @classmethod
    def options_dict(cls, options: Mapping[str, Any]) -> dict[str, Any]:
        """Validated options as a plain dict with canonical names and defaults filled in."""
        return msgspec.structs.asdict(cls.parse_options(options))

    def check_target(self, model: Any) -> None:
        """Called with the opened target GGUF (engine's GGUFModel) before its weights are packed: raise
        ValueError naming the bad option (a head for another model, a draft with another vocabulary)
        here, so a bad config fails in a second instead of after the target's load."""

    def bind_target(self, target: TargetModel) -> None:
        """Called once before serving, after `check_target`; model-based proposers load their weights here."""

    def observe_hidden(self, request_id: str, start_position: int, hidden: np.ndarray) -> None:
        """Target features of positions start_position.. ([n, hidden] float32, a view valid only
        during the call); they supersede anything the proposer holds for those positions.
        Called after each forward, before `extend_request`, when `uses_hidden_states`."""

    def start_request(self, request_id: str, prompt_token_ids: np.ndarray) -> None:
        """A request entered the running set; `prompt_token_ids` is [num_prompt_tokens] int32."""

    def extend_request(self, request_id: str, accepted_token_ids: Sequence[int]) -> None:
        """Tokens appended to the request's output this step (accepted drafts + recovered/bonus)."""

    def stop_request(self, request_id: str) -> None:
        """The request finished or was aborted; drop its state."""

    def propose(self, requests: list[DraftRequest]) -> Drafts:
        """Draft tokens for every request of the step, in one call."""
        raise NotImplementedError
