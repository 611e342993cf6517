"""The interface both model runners (CPU: engine/model/cpu_runner.py, GPU: engine/gpu/runner.py) give the engine.

The engine and the proposers' binding code talk to a runner through this alone.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

import numpy as np


class ModelRunner(Protocol):
    config: Any  # the model's ModelConfig
    cache: Any  # the CacheConfig it was built for (block size, blocks, token budget)
    numerics: str  # weight products a proposer's own kernels should use: "int8" or "exact"
    provides_hidden_states: ClassVar[bool]  # can keep the final-normed hidden state of every row
    supports_grammars: ClassVar[bool]  # its logits are host arrays a grammar mask can be applied to
    capture_hidden: bool  # keep them during forward() (set by a proposer that drafts from them)

    def forward(self, batch: Any) -> np.ndarray:
        """Append the batch's tokens to their requests' KV caches; logits [num_logits, vocab] float32."""
        ...

    def hidden_states(self, num_rows: int) -> np.ndarray:
        """[num_rows, hidden] final-normed hidden states of the last forward's first rows."""
        ...
