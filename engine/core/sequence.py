"""One request's state inside the engine: tokens, cache progress, sampling RNG, stats."""

from __future__ import annotations

import enum
import itertools

import numpy as np

from engine.serving.protocol import SamplingParams
from engine.spec_decode.spec_control import SourceStats

_arrival = itertools.count()
_VERIFY_LANE = 1  # Philox key word that keeps verification's uniforms apart from any other keyed stream


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, capacity: int):
        self.request_id = request_id
        self.params = params
        self.arrival = next(_arrival)
        self.status = Status.WAITING
        self.token_ids = np.zeros(capacity, np.int32)  # [capacity] prompt + output (+ room for drafts)
        self.num_prompt_tokens = len(prompt_ids)
        self.num_tokens = len(prompt_ids)
        self.token_ids[: self.num_tokens] = prompt_ids
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.block_table: list[int] = []
        self.num_hashed_blocks = 0
        self.last_block_hash = 0
        # A fresh generator per request (a proposer's sampled drafts): never depends on what else is batched.
        self.rng = np.random.default_rng(params.seed)
        # Verification's uniforms are keyed by (this key, output position), not drawn from a stream: see row_uniforms.
        self.sample_key = params.seed if params.seed is not None else int(self.rng.integers(2**63))
        self.finish_reason: str | None = None
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_grammar_tokens = 0  # accepted drafts its grammar forced
        self.draft_stats: dict[str, SourceStats] = {}  # draft source -> its acceptance for this request

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_prefilling(self) -> bool:
        """True while tokens other than the last one are still missing from the cache."""
        return self.num_computed_tokens < self.num_tokens - 1

    @property
    def output_ids(self) -> np.ndarray:
        return self.token_ids[self.num_prompt_tokens : self.num_tokens]

    def row_uniforms(self, n: int) -> np.ndarray:
        """[n, 2] float64 in [0, 1): the (accept test, sampling) uniforms of the next n output positions.

        A pure function of the key and the position (Philox, a counter-based generator, with the position as its
        counter), never of how many drafts a step verified or how steps were grouped. So the token sampled at an
        output position is the same whether it came from a plain step or from any row of any verify step, and a
        seeded request's output does not depend on its drafts (with verification that samples the target, as
        target_match does)."""
        first = self.num_output_tokens
        raw = np.random.Philox(counter=[first, 0, 0, 0], key=[self.sample_key, _VERIFY_LANE]).random_raw(4 * n)
        # [n, 4] uint64: counter `first + j` gives row j's block; its first two words, as 53-bit fractions
        return (raw.reshape(n, 4)[:, :2] >> np.uint64(11)).astype(np.float64) * 2.0**-53

    def append(self, token_id: int) -> None:
        self.token_ids[self.num_tokens] = token_id
        self.num_tokens += 1
