"""What every learned-head proposer shares: options, the head file, the target's embedding and
draft LM head, per-request token/feature state, and picking a draft token from draft logits."""

from __future__ import annotations

import json
import time
from pathlib import Path

import msgspec
import numpy as np

from engine.kernels.linear import pack_gguf_tensor
from engine.kernels.weights import EmbeddingTable
from proposers.base import DraftRequest, Drafts, Proposer, TargetModel
from proposers.draft_sampling import pick_tokens  # noqa: F401  (re-exported for the head proposers)
from proposers.heads.head_file import HeadFile, load_head
from proposers.heads.layer import WEIGHT_FORMATS, draft_rows, matmul

SHIPPED = Path(__file__).parent / "data"


class HeadOptions(msgspec.Struct, forbid_unknown_fields=True):
    model: str | None = None  # head .safetensors path; None = the head shipped for the target model
    weights: str = "q8_0"  # how head matrices (and the draft LM head's rows) are held at run time: q8_0, q4_0 or f32
    # a head row attends to at most this many rows, its own included (0: all); None: as many as a window of the
    # head's training held (its file's training.config.seq_len), the most it ever saw
    attention_window: int | None = None


def find_shipped_head(kind: str, target_name: str, vocab_size: int, hidden_size: int, num_layers: int) -> Path | None:
    """A shipped head of this kind for a target of this shape (same name preferred). A head only
    changes speed, never output, so a same-shaped sibling model may use it."""
    shape = {"vocab_size": vocab_size, "hidden_size": hidden_size, "num_layers": num_layers}
    found = []
    for cfg_path in sorted(SHIPPED.glob("*.json")):
        cfg = json.loads(cfg_path.read_text())
        target = cfg.get("target", {})
        if cfg.get("kind") == kind and all(target.get(k) == v for k, v in shape.items()):
            found.append((target.get("name") != target_name, cfg_path.with_suffix(".safetensors")))
    return min(found)[1] if found else None


class RequestState:
    """A request's tokens and the target features seen so far (positions feat_lo..n_feat-1)."""

    def __init__(self, prompt: np.ndarray, hidden_size: int):
        self.tokens = np.zeros(max(64, 2 * len(prompt)), np.int32)
        self.tokens[: len(prompt)] = prompt
        self.num_tokens = len(prompt)
        self.feats = np.zeros((len(self.tokens), hidden_size), np.float32)  # [capacity, H]
        self.feat_lo = -1  # first position with a feature (> 0 after a prefix-cache hit); -1 = none yet
        self.n_feat = 0

    def _grow(self, size: int) -> None:
        if size > len(self.tokens):
            new = max(size, 2 * len(self.tokens))
            self.tokens = np.resize(self.tokens, new)
            feats = np.zeros((new, self.feats.shape[1]), np.float32)
            feats[: len(self.feats)] = self.feats
            self.feats = feats

    def extend(self, token_ids) -> None:
        n = len(token_ids)
        self._grow(self.num_tokens + n)
        self.tokens[self.num_tokens : self.num_tokens + n] = token_ids
        self.num_tokens += n

    def observe(self, start: int, hidden: np.ndarray) -> None:
        self._grow(start + len(hidden))
        self.feats[start : start + len(hidden)] = hidden
        if self.feat_lo < 0 or start < self.feat_lo:
            self.feat_lo = start
        self.n_feat = max(self.n_feat, start + len(hidden))


class HeadProposer(Proposer):
    """Base of eagle / mtp / medusa: loads the head in `bind_target`, tracks requests."""

    Options = HeadOptions
    uses_hidden_states = True
    head_kind = ""  # set by subclasses
    default_num_speculative_tokens = 3

    def __init__(self, config, vocab_size: int):
        super().__init__(config, vocab_size)
        if self.options.weights not in WEIGHT_FORMATS:
            raise ValueError(f"speculative_config.weights: must be one of {', '.join(WEIGHT_FORMATS)}")
        if self.options.attention_window is not None and self.options.attention_window < 0:
            raise ValueError(f"speculative_config.attention_window: must be 0 (all rows) or more, "
                             f"got {self.options.attention_window}")
        self.requests: dict[str, RequestState] = {}
        self.rng = np.random.default_rng(0)
        self.head: HeadFile | None = None

    def check_target(self, model) -> None:
        """Find and open the head for this target (its file, kind and shape are checked here)."""
        cfg = model.config
        path = self.options.model or find_shipped_head(self.head_kind, cfg.name, cfg.vocab_size, cfg.hidden_size,
                                                       cfg.num_layers)
        if path is None:
            raise ValueError(
                f"speculative_config.model: no {self.head_kind} head ships for {cfg.name!r}; "
                f"train one with `speculant train-head --kind {self.head_kind}` and pass its path"
            )
        head = load_head(path, cfg.hidden_size, cfg.vocab_size)
        if head.kind != self.head_kind:
            raise ValueError(f"speculative_config.model: {path} is a {head.kind} head, not {self.head_kind}")
        self.head = head

    def bind_target(self, target: TargetModel) -> None:
        if self.head is None:
            self.check_target(target.model)
        cfg = target.model.config
        self.draft_vocab = self.head.tensors["draft_vocab"]  # [V_d]
        self.embed = target.model.tensor("token_embd.weight")
        self.embed_table = getattr(target.runner, "embed_table", None) or EmbeddingTable(self.embed)
        head_tensor = self.embed if cfg.tied_embeddings else target.model.tensor("output.weight")
        self.numerics = target.numerics  # the head's products use the target's kernels
        self.lm_head = pack_gguf_tensor(draft_rows(head_tensor, self.draft_vocab, self.options.weights), self.numerics)
        self.hidden_size = cfg.hidden_size
        self.load_modules(self.head)

    def load_modules(self, head: HeadFile) -> None:
        raise NotImplementedError

    def embed_tokens(self, token_ids: np.ndarray) -> np.ndarray:
        out = np.empty((len(token_ids), self.hidden_size), np.float32)  # [n, H]
        self.embed_table.rows(token_ids, out)
        return out

    def draft_logits(self, z: np.ndarray) -> np.ndarray:
        return matmul(z, self.lm_head)  # [R, V_d]

    def start_request(self, request_id, prompt_token_ids) -> None:
        self.requests[request_id] = RequestState(prompt_token_ids, self.hidden_size)

    def extend_request(self, request_id, accepted_token_ids) -> None:
        self.requests[request_id].extend(accepted_token_ids)

    def observe_hidden(self, request_id, start_position, hidden) -> None:
        self.requests[request_id].observe(start_position, hidden)

    def stop_request(self, request_id) -> None:
        self.requests.pop(request_id, None)

    def ready(self, asks: list[DraftRequest]) -> list[int]:
        """Indices of the asks whose last token has a feature one position before it (a one-token
        prompt asks for drafts in its very first step, before any feature exists)."""
        return [i for i, a in enumerate(asks)
                if (s := self.requests.get(a.request_id)) is not None and 0 < s.n_feat == s.num_tokens - 1]

    def propose(self, requests: list[DraftRequest]) -> Drafts:
        """Drafts, and the seconds charged to the head: the call's time x `charged_fraction`."""
        start = time.perf_counter()
        drafts = Drafts.empty(len(requests))
        drafts.probs = [None] * len(requests)
        self.charged_fraction = 1.0  # the share of this call's time that drafting cost (see feature_head)
        live = self.ready(requests)
        if live:
            for i, (tokens, probs) in zip(live, self.draft([requests[i] for i in live])):
                drafts.token_ids[i], drafts.probs[i] = tokens, probs
        drafts.seconds = {self.draft_sources[0]: (time.perf_counter() - start) * self.charged_fraction}
        return drafts

    def draft(self, asks: list[DraftRequest]) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """Per ask: draft tokens [n] int32 and their q rows [n, vocab] (None when drafted greedily)."""
        raise NotImplementedError
