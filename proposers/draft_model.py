"""`draft_model`: a small model drafts; or the target's own first layers (self-speculative).

- `"model": PATH_OR_NAME`: any GGUF that shares the target's vocabulary (checked token by token).
- `"draft_layers": L`: the target's first L layers plus its final norm and LM head (weights shared).

The draft runs the engine's own CPU runner with its own paged KV cache. Per step: one ragged
forward catches every request up on its new tokens (chunked under the token budget) and drafts the
first token, then one batched forward per further draft position. Draft KV written for tokens that
the target accepts stays valid; the rest is overwritten next step. At temperature > 0 drafts are
sampled from the draft's softmax and q goes to `rejection` verification (lossless sampling).
"""

from __future__ import annotations

import dataclasses
from typing import Annotated

import msgspec
import numpy as np

from proposers.base import DraftRequest, Drafts, Proposer, TargetModel
from proposers.draft_sampling import pick_tokens


class DraftModelOptions(msgspec.Struct, forbid_unknown_fields=True):
    model: str | None = None  # draft GGUF: path or known name
    draft_layers: Annotated[int, msgspec.Meta(ge=1)] | None = None  # self-speculative: first L layers
    kv_cache_memory: Annotated[float, msgspec.Meta(gt=0)] = 0.25  # GiB for the draft's KV cache


def _vocab(model) -> list:
    return list(model.metadata.get("tokenizer.ggml.tokens", []))


def check_same_vocabulary(draft, target) -> None:
    mine, theirs = _vocab(draft), _vocab(target)
    if draft.config.vocab_size != target.config.vocab_size or len(mine) != len(theirs):
        raise ValueError(f"speculative_config.model: the draft's vocabulary ({draft.config.vocab_size} tokens) "
                         f"differs from the target's ({target.config.vocab_size})")
    diff = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
    if diff is not None:
        raise ValueError(f"speculative_config.model: the draft's token {diff} is {mine[diff]!r}, "
                         f"the target's is {theirs[diff]!r}: the vocabularies differ")


class DraftSeq:
    def __init__(self, prompt: np.ndarray):
        self.tokens = list(int(t) for t in prompt)
        self.num_valid = 0  # draft KV holds the true tokens[:num_valid]
        self.fed: list[int] = []  # drafts whose KV the last proposal wrote after the true tokens
        self.table: list[int] = []


class DraftModelProposer(Proposer):
    Options = DraftModelOptions
    default_num_speculative_tokens = 4

    def __init__(self, config, vocab_size: int):
        super().__init__(config, vocab_size)
        if (self.options.model is None) == (self.options.draft_layers is None):
            raise ValueError("speculative_config.model: give either a draft GGUF (`model`) or `draft_layers`")
        self.seqs: dict[str, DraftSeq] = {}
        self.rng = np.random.default_rng(0)
        self.draft = None  # the draft GGUF (the target itself with draft_layers), opened by check_target

    def check_target(self, model) -> None:
        """Open the draft GGUF and check its vocabulary, or check draft_layers against the target's layers."""
        from engine.model.gguf_loader import GGUFModel
        from engine.model.model_files import resolve_model

        if self.options.draft_layers is not None:
            if self.options.draft_layers > model.config.num_layers:
                raise ValueError(f"speculative_config.draft_layers: {self.options.draft_layers} exceeds the "
                                 f"target's {model.config.num_layers} layers")
            self.draft = model
        else:
            self.draft = GGUFModel(resolve_model(self.options.model))
            check_same_vocabulary(self.draft, model)

    def bind_target(self, target: TargetModel) -> None:
        from engine.core.block_manager import BlockManager
        from engine.model.cpu_runner import CacheConfig, CpuRunner, ForwardBatch

        if self.draft is None:
            self.check_target(target.model)
        draft, layers = self.draft, self.options.draft_layers
        tc = target.cache
        cfg = draft.config if layers is None else dataclasses.replace(draft.config, num_layers=layers)
        numerics = target.numerics  # the draft's products use the target's kernels
        per_block = CpuRunner.kv_bytes_per_block(cfg, tc.block_size, numerics)
        num_blocks = max(int(self.options.kv_cache_memory * 2**30) // per_block, 2)
        cache = CacheConfig(tc.block_size, num_blocks, tc.max_model_len, tc.max_num_seqs, tc.max_num_batched_tokens)
        shared = target.runner if layers is not None and isinstance(target.runner, CpuRunner) else None
        self.runner = CpuRunner(draft, cache, num_layers=layers, weights_from=shared, numerics=numerics)
        self.blocks = BlockManager(num_blocks, tc.block_size)
        self.batch = ForwardBatch(cache)
        self.identity_vocab = np.arange(self.vocab_size, dtype=np.int32)

    def start_request(self, request_id, prompt_token_ids) -> None:
        self.seqs[request_id] = DraftSeq(prompt_token_ids)

    def extend_request(self, request_id, accepted_token_ids) -> None:
        s = self.seqs[request_id]
        matched = 0
        while matched < min(len(s.fed), len(accepted_token_ids)) and s.fed[matched] == accepted_token_ids[matched]:
            matched += 1
        s.num_valid = len(s.tokens) + matched if s.num_valid == len(s.tokens) else s.num_valid
        s.tokens.extend(int(t) for t in accepted_token_ids)
        s.fed = []

    def stop_request(self, request_id) -> None:
        s = self.seqs.pop(request_id, None)
        if s is not None:
            self.blocks.free_blocks(s.table)

    def propose(self, requests: list[DraftRequest]) -> Drafts:
        drafts = Drafts.empty(len(requests))
        drafts.probs = [None] * len(requests)
        live = [i for i, r in enumerate(requests) if self._room(r)]
        if not live:
            return drafts
        asks = [requests[i] for i in live]
        seqs = [self.seqs[a.request_id] for a in asks]
        tokens, probs = self._first(asks, seqs)
        out = [[t] for t in tokens]
        qs = [[q] for q in probs]
        for j in range(1, max(a.max_draft_tokens for a in asks)):
            chain = [r for r, a in enumerate(asks) if a.max_draft_tokens > j]
            logits = self._forward([(seqs[r], [out[r][-1]], len(seqs[r].tokens) + j - 1) for r in chain])
            picked, q = pick_tokens(logits, self.identity_vocab, [asks[r] for r in chain], self.vocab_size, self.rng)
            for r, t, qr in zip(chain, picked, q):
                seqs[r].fed.append(out[r][-1])
                out[r].append(int(t))
                qs[r].append(qr)
        for i, toks, q in zip(live, out, qs):
            drafts.token_ids[i] = np.asarray(toks, np.int32)
            drafts.probs[i] = None if q[0] is None else np.stack(q)
        return drafts

    def _room(self, ask: DraftRequest) -> bool:
        s = self.seqs.get(ask.request_id)
        if s is None or ask.max_draft_tokens <= 0 or len(s.tokens) + ask.max_draft_tokens > self.runner.cache.max_model_len:
            return False
        return self.blocks.allocate(s.table, len(s.tokens) + ask.max_draft_tokens)

    def _first(self, asks, seqs):
        """Catch each request up on its true tokens (chunked under the budget); draft one token each."""
        rows: list[np.ndarray | None] = [None] * len(asks)
        budget = self.runner.cache.max_num_batched_tokens
        while any(s.num_valid < len(s.tokens) for s in seqs):
            parts, owners, left = [], [], budget
            for r, s in enumerate(seqs):
                n = min(len(s.tokens) - s.num_valid, left)
                if n > 0:
                    parts.append((s, s.tokens[s.num_valid : s.num_valid + n], s.num_valid))
                    owners.append(r)
                    left -= n
            done = [start + len(run) == len(s.tokens) for s, run, start in parts]
            logits = iter(self._forward(parts, done))
            for r, (s, run, start), fin in zip(owners, parts, done):
                s.num_valid = start + len(run)
                if fin:
                    rows[r] = next(logits)
        return pick_tokens(np.stack(rows), self.identity_vocab, asks, self.vocab_size, self.rng)

    def _forward(self, parts, wants: list[bool] | None = None) -> np.ndarray:
        """parts: (seq, tokens, first position) -> logits [num wanted, vocab] after each wanted part."""
        fb = self.batch
        fb.clear()
        for i, (s, run, start) in enumerate(parts):
            fb.add(np.asarray(run, np.int32), start, s.table, 1 if wants is None or wants[i] else 0)
        return self.runner.forward(fb).copy()
