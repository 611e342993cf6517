"""The engine: one model runtime, one scheduler, one proposer; `step()` reads top to bottom.

    schedule -> propose -> verify (one forward + one verification kernel) -> accept -> emit

Vocabulary: a *draft* token comes from the proposer; the target model *verifies*
the request's last token plus its drafts in one forward; drafts that pass are
*accepted*; the first rejected draft is replaced by a *recovered* token sampled
from the target; if every draft passes, one *bonus* token is sampled from the last
row. Output tokens of a step = accepted + (recovered or bonus), so at least one.
"""

from __future__ import annotations

import logging

import numpy as np

from engine.engine_setup import EngineParts, build_engine_parts
from engine.errors import InvalidRequest
from engine.core.output_processor import OutputState, make_output
from engine.core.prompt_echo import PromptEchoes
from engine.core.logits_processing import RequestArrays, process_rows, processing_field
from engine.serving.protocol import Detokenize, Generate, Output, Tokenize, Tokens, WorkerStats
from engine.spec_decode.proposer_pool import ProposerPool
from engine.core.request_input import prompt_scoring_field, prompt_token_ids, tokens_reply, validate_params
from engine.core.scheduler import ScheduledSeq
from engine.core.sequence import Sequence
from engine.spec_decode.spec_log import SpecLogger, SpecTotals
from engine.spec_decode.step_batch import StepBatch
from engine.structured.grammars import GRAMMAR_SOURCE, Grammars

log = logging.getLogger("speculant.engine")
GRAMMAR_MAX_DRAFTS = 16  # most grammar-forced tokens drafted in one step


class LLMEngine:
    def __init__(self, parts: EngineParts):
        self.parts = parts
        self.model_name = parts.model_name
        self.max_model_len = parts.cache.max_model_len
        self.tokenizer = parts.tokenizer
        self.runner = parts.runner
        self.scheduler = parts.scheduler
        self.proposers = ProposerPool(parts.proposer, parts.spec, parts.bind)
        self.spec = parts.spec
        self.spec_method = parts.spec.method if parts.spec else None
        self.num_speculative_tokens = parts.spec.num_speculative_tokens if parts.spec else 0
        self.controller = parts.controller
        self.draft_caps: dict[str, dict[str, int]] = {}  # this step: request -> its cap per draft source
        self.draft_source: dict[str, str] = {}  # this step: request -> the source that drafted for it
        self.step_batch = StepBatch(parts.cache, parts.runner.config.vocab_size)
        self.seqs: dict[str, Sequence] = {}
        self.states: dict[str, OutputState] = {}
        self.spec_totals = SpecTotals(self.num_speculative_tokens)
        self.grammars = Grammars(self.tokenizer, parts.runner.config.vocab_size)
        self.forced: dict[str, list[int]] = {}  # this step: request -> the tokens its grammar forces next
        # requests whose rows are processed (penalties, logit_bias, min_p, ...: logits_processing) -> their arrays
        self.row_arrays: dict[str, RequestArrays] = {}
        self.echoes = PromptEchoes(self.tokenizer)  # completions' echo: the prompt on the first output
        self.spec_logger = SpecLogger()

    @classmethod
    def from_args(cls, args) -> "LLMEngine":
        from engine.jit_cache import compile_lock

        with compile_lock():  # building the runner compiles (or loads) its kernels
            return cls(build_engine_parts(args))

    # ------------------------------------------------------------------ requests

    def add_request(self, msg: Generate) -> None:
        if msg.request_id in self.seqs:
            raise InvalidRequest(f"duplicate request id {msg.request_id!r}", "request_id")
        self.proposers.get(msg.params.speculative_method)  # an unknown method is refused before anything starts
        ids = prompt_token_ids(msg, self.tokenizer)
        validate_params(msg.params, len(ids), self.max_model_len, self.tokenizer.vocab_size)
        if msg.params.priority != 0 and self.scheduler.policy != "priority":
            raise InvalidRequest(f"priority {msg.params.priority}: this server schedules first come, first served "
                                 "(start its engine with --scheduling-policy priority)", "priority")
        processing = processing_field(msg.params) or prompt_scoring_field(msg.params)
        if processing and not self.runner.supports_grammars:
            raise InvalidRequest(f"{processing}: penalties, logit_bias, min_p, min_tokens, allowed_token_ids, "
                                 "bad_words and prompt logprobs run on the CPU backend only", processing)
        if msg.params.grammar is not None:
            if not self.runner.supports_grammars:
                raise InvalidRequest("response_format: constrained decoding runs on the CPU backend only",
                                     "response_format")
            self.grammars.start(msg.request_id, msg.params.grammar)
        if processing_field(msg.params):
            self.row_arrays[msg.request_id] = RequestArrays(msg.params, self.tokenizer.stop_token_ids,
                                                            self.runner.config.vocab_size, self.tokenizer.encode)
        seq = Sequence(msg.request_id, ids, msg.params, self.max_model_len + self.num_speculative_tokens + 1)
        self.seqs[seq.request_id] = seq
        self.states[seq.request_id] = OutputState(self.tokenizer, seq, self.max_model_len)
        self.proposers.start(seq.request_id, msg.params.speculative_method, seq.token_ids[: seq.num_tokens])
        self.echoes.start(seq)
        self.scheduler.add(seq)

    def tokens(self, msg: Tokenize | Detokenize) -> Tokens:
        return tokens_reply(msg, self.tokenizer)

    def abort_request(self, request_id: str) -> None:
        seq = self.seqs.get(request_id)
        if seq is not None:
            seq.finish_reason = "abort"
            self._release(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def request_ids(self) -> set[str]:
        return set(self.seqs)

    def _release(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.row_arrays.pop(seq.request_id, None)
        self.seqs.pop(seq.request_id, None)
        self.states.pop(seq.request_id, None)
        self.proposers.stop(seq.request_id)
        self.grammars.stop(seq.request_id)
        self.echoes.stop(seq.request_id)

    # ------------------------------------------------------------------ the step

    def step(self) -> list[Output]:
        sched = self.schedule()
        if not sched:
            return []
        drafts = self.propose(sched)
        batch = self.step_batch.build(sched, drafts)
        logits = self.runner.forward(batch.forward)  # [num_logits, vocab]
        if self.echoes.pending:
            self.echoes.observe(sched, batch.forward, self.runner, self.states)
        self.process_logits(sched, batch, logits)
        self.step_batch.verify(logits, self.spec)
        outputs = self.accept_and_emit(sched, logits)
        if self.proposer is not None:
            self.spec_logger.maybe_log(self.spec_totals)
        return outputs

    def process_logits(self, sched: list[ScheduledSeq], batch: StepBatch, logits: np.ndarray) -> None:
        """Grammar masks, then penalties, logit_bias and min_p, in place: row j of a request's run follows its
        tokens and drafts 0..j-1, so it is what plain decoding would sample that position from."""
        if self.grammars.matchers:
            matchers = self.grammars.matchers
            runs = batch.sampling_runs(sched, lambda s: s.request_id in matchers)
            self.grammars.mask_rows(logits, [(s.request_id, lo, drafts) for s, lo, drafts in runs])
        if self.row_arrays:
            process_rows(logits, batch.sampling_runs(sched, lambda s: s.request_id in self.row_arrays), self.row_arrays)

    def schedule(self) -> list[ScheduledSeq]:
        self.controller.start_step()
        return self.scheduler.schedule(self._draft_room).scheduled

    def _draft_room(self, seq: Sequence) -> int:
        remaining = seq.params.max_tokens - seq.num_output_tokens
        if seq.request_id in self.grammars.matchers:  # the grammar's forced tokens are free drafts
            cap = seq.params.num_speculative_tokens
            limit = min(GRAMMAR_MAX_DRAFTS if cap is None else cap, remaining - 1)
            self.forced[seq.request_id] = self.grammars.forced(seq.request_id, limit)
        proposer = self.proposers.of(seq.request_id)
        if proposer is None:
            return len(self.forced.get(seq.request_id, ()))
        caps = self.controller.room(seq.params.num_speculative_tokens, seq.draft_stats, remaining,
                                    proposer.draft_sources)
        self.draft_caps[seq.request_id] = caps
        return max(max(caps.values(), default=0), len(self.forced.get(seq.request_id, ())))

    def propose(self, sched: list[ScheduledSeq]) -> dict:
        """Drafts of the requests that reserved room (decodes): request -> (token ids, q or None)."""
        self.draft_source = {}
        forced, self.forced = self.forced, {}
        caps, self.draft_caps = self.draft_caps, {}
        asks = [s for s in sched if s.max_draft_tokens > 0 and not forced.get(s.seq.request_id)]
        draft_of = self._proposer_drafts(asks, caps) if self.proposer is not None and asks else {}
        for s in sched:
            rid = s.seq.request_id
            if forced.get(rid) and s.max_draft_tokens > 0:
                draft_of[rid] = (np.asarray(forced[rid][: s.max_draft_tokens], np.int32), None)
                self.draft_source[rid] = GRAMMAR_SOURCE
            elif rid in self.grammars.matchers and rid in draft_of:  # cut at the first draft the grammar forbids
                ids, probs = draft_of[rid]
                n = self.grammars.cut(rid, ids, keep_forbidden=probs is not None and s.seq.params.temperature > 0)
                draft_of[rid] = (ids[:n], None if probs is None else probs[:n])
        return draft_of

    def _proposer_drafts(self, sched: list[ScheduledSeq], caps: dict) -> dict:
        from proposers.base import DraftRequest

        asks = [
            DraftRequest(s.seq.request_id, s.seq.token_ids[: s.seq.num_tokens], s.seq.num_prompt_tokens,
                         s.max_draft_tokens, s.seq.params.temperature, s.seq.rng, caps.get(s.seq.request_id))
            for s in sched
        ]
        drafts = self.proposers.propose(asks)
        self.draft_source = {a.request_id: src for a, src, t in zip(asks, drafts.sources, drafts.token_ids) if len(t)}
        for source, seconds in drafts.seconds.items():
            num_tokens = sum(len(t) for t, src in zip(drafts.token_ids, drafts.sources) if src == source)
            self.controller.note_draft_time(source, seconds, num_tokens)
        probs = drafts.probs or [None] * len(asks)
        return {a.request_id: (ids[: a.max_draft_tokens], None if p is None else p[: a.max_draft_tokens])
                for a, ids, p in zip(asks, drafts.token_ids, probs)}

    def accept_and_emit(self, sched: list[ScheduledSeq], logits: np.ndarray) -> list[Output]:
        outputs = []
        for i, item in enumerate(sched):
            seq = item.seq
            result = self.step_batch.result(i)
            self._observe_hidden(i, item, 0 if result is None else result[2])
            seq.num_computed_tokens += item.num_new_tokens
            if result is None:  # partial prefill chunk: nothing sampled yet
                self._hash_blocks(seq)
                continue
            outputs.append(self._accept(seq, result, logits))
        return outputs

    def _accept(self, seq: Sequence, result, logits: np.ndarray) -> Output:
        token_ids, num_drafts, num_accepted, rows = result
        self._record_spec(seq, num_drafts, num_accepted)
        state = self.states[seq.request_id]
        grammar_done = False
        if seq.request_id in self.grammars.matchers:
            token_ids, grammar_done = self._advance_grammar(seq, token_ids, num_accepted)
        num_taken = state.add_tokens(seq, token_ids)
        if grammar_done and seq.finish_reason is None:
            seq.finish_reason = "stop"
        # The KV of the accepted drafts was written by this forward: they are now computed.
        seq.num_computed_tokens = min(seq.num_computed_tokens + min(num_accepted, num_taken), seq.num_tokens - 1)
        self._hash_blocks(seq)
        taken = token_ids[:num_taken]
        drafted = [j < num_accepted for j in range(num_taken)]
        logprobs = None
        if seq.params.logprobs is not None:
            logprobs = state.logprobs(logits[rows[:num_taken]], taken, seq.params.logprobs)
        self.proposers.extend(seq.request_id, taken)
        forced = drafted if self.draft_source.get(seq.request_id) == GRAMMAR_SOURCE else None
        out = self.echoes.attach(seq, make_output(seq, state, taken, drafted, logprobs, forced))
        if seq.finish_reason is not None:
            self._release(seq)
        return out

    def _advance_grammar(self, seq: Sequence, token_ids: np.ndarray, num_accepted: int) -> tuple[np.ndarray, bool]:
        """The grammar consumes the step's tokens up to where it completes; returns those tokens and whether
        it completed (the request then stops there, exactly where plain constrained decoding stops)."""
        n, done = self.grammars.advance(seq.request_id, token_ids)
        if self.draft_source.get(seq.request_id) == GRAMMAR_SOURCE:
            self.spec_totals.record_grammar(seq, min(num_accepted, n))
        return token_ids[:n], done

    def _observe_hidden(self, i: int, item: ScheduledSeq, num_accepted: int) -> None:
        """Hand a hidden-state proposer the target features of the rows that are now true tokens."""
        if not self.runner_captures_hidden():
            return
        first_row = int(self.step_batch.forward.cu_q[i])
        num_true = item.num_new_tokens + num_accepted  # the appended tokens, then the accepted drafts
        self.proposers.observe_hidden(item.seq.request_id, item.seq.num_computed_tokens,
                                      lambda: self.runner.hidden_states(first_row + num_true)[first_row:])

    def runner_captures_hidden(self) -> bool:
        return self.runner.capture_hidden

    @property
    def proposer(self):
        """The configured proposer (None: no speculation)."""
        return self.proposers.default

    def available_methods(self) -> list[str]:
        """Methods a request may pick: every loadable installed proposer (none without speculation)."""
        if self.proposer is None:
            return []
        from proposers.registry import default_registry

        return sorted(default_registry().names())

    def reset_proposers(self) -> None:
        """Fresh proposers, and the controller forgets what earlier requests' drafts did (no request may run)."""
        self.proposers.reset()
        self.controller.prior.clear()

    def _hash_blocks(self, seq: Sequence) -> None:
        seq.num_hashed_blocks, seq.last_block_hash = self.scheduler.blocks.register_full_blocks(
            seq.token_ids, seq.block_table, seq.num_hashed_blocks, seq.last_block_hash, seq.num_computed_tokens
        )

    def _record_spec(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        source = self.draft_source.get(seq.request_id)
        if source == GRAMMAR_SOURCE:  # forced drafts say nothing about the proposer
            source, num_drafts_seen = None, 0
        else:
            num_drafts_seen = num_drafts
        self.controller.record(seq.draft_stats, source, num_drafts_seen, num_accepted)
        if num_drafts == 0:
            return
        self.spec_totals.record(seq, num_drafts, num_accepted)

    # ------------------------------------------------------------------ stats

    def stats(self) -> WorkerStats:
        blocks = self.scheduler.blocks
        return WorkerStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_usage=blocks.usage,
            num_free_blocks=blocks.num_free,
            num_total_blocks=blocks.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_hits=blocks.num_cache_hits,
            prefix_cache_queries=blocks.num_cache_queries,
            **self.spec_totals.fields(),
        )
