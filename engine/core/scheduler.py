"""Continuous batching: waiting -> running -> finished, under a per-step token budget.

Each step every running request gets either its next prefill chunk or one decode
slot plus room for up to K draft tokens. Waiting requests are admitted while KV
blocks, sequence slots and token budget allow; a running request that cannot grow
preempts the most recently admitted one (recompute: its cache is dropped and it
re-enters the waiting queue at the front with its output kept).

Policies, as vLLM's `--scheduling-policy`: `fcfs` orders both queues by arrival. `priority` orders
them by (request priority, arrival), lower first: a request is admitted before every waiting
request of a higher value, gets its step's budget before running ones of a higher value, and the
victim of a preemption is the running request with the highest value (the latest among equals).
A running request is never preempted to admit a waiting one: priority decides who goes next.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from engine.core.block_manager import BlockManager
from engine.core.request_input import scores_prompt
from engine.core.sequence import Sequence, Status


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens of the sequence itself fed this step (prefill chunk, or 1 for a decode)
    max_draft_tokens: int  # room reserved for drafts (decodes only)

    @property
    def is_decode(self) -> bool:
        return self.num_new_tokens == 1 and self.seq.num_computed_tokens == self.seq.num_tokens - 1


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)


POLICIES = ("fcfs", "priority")


def _rank(seq: Sequence) -> tuple[int, int]:
    """The priority policy's order: lower priority values first, then arrival."""
    return seq.params.priority, seq.arrival


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 policy: str = "fcfs"):
        if policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in the order they get the step's budget; the last is the next victim
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self._place(self.waiting, seq)

    def _place(self, queue, seq: Sequence, front: bool = False) -> None:
        """Into a queue in the policy's order: by _rank, or (fcfs) at its end, or its front for a preempted request."""
        if self.policy == "priority":  # a preempted request: ahead of every later arrival of its priority
            bisect.insort(queue, seq, key=_rank)
        elif front:
            queue.appendleft(seq)
        else:
            queue.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Release a request's blocks, whatever state it is in."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        self.blocks.free_blocks(seq.block_table)

    def schedule(self, draft_room) -> SchedulerOutput:
        """draft_room(seq) -> the most draft tokens this request may take this step."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        for seq in list(self.running):  # running first, oldest first
            if seq.status is not Status.RUNNING or budget <= 0:
                continue
            item = self._plan(seq, budget, draft_room)
            while not self.blocks.allocate(seq.block_table, seq.num_computed_tokens + item.num_new_tokens + item.max_draft_tokens):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                out.scheduled.append(item)
                budget -= item.num_new_tokens + item.max_draft_tokens
        self._admit(out, budget, draft_room)
        return out

    def _plan(self, seq: Sequence, budget: int, draft_room) -> ScheduledSeq:
        remaining = seq.num_tokens - seq.num_computed_tokens
        if remaining > 1:  # prefill chunk
            return ScheduledSeq(seq, min(remaining, budget), 0)
        room = min(draft_room(seq), budget - 1, self.max_model_len - seq.num_tokens)
        return ScheduledSeq(seq, 1, max(room, 0))

    def _admit(self, out: SchedulerOutput, budget: int, draft_room) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table:
                reusable = 0 if scores_prompt(seq.params) else seq.num_tokens - 1  # scored: compute every position
                cached, last_hash = self.blocks.match_prefix(seq.token_ids, reusable)
                seq.block_table = cached
                seq.num_computed_tokens = seq.num_hashed_blocks = len(cached)
                seq.num_computed_tokens *= self.blocks.block_size
                seq.last_block_hash = last_hash
            item = self._plan(seq, budget, draft_room)
            if not self.blocks.allocate(seq.block_table, seq.num_computed_tokens + item.num_new_tokens + item.max_draft_tokens):
                break  # wait for blocks to free up (cached prefix blocks stay referenced meanwhile)
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self._place(self.running, seq)
            out.scheduled.append(item)
            budget -= item.num_new_tokens + item.max_draft_tokens

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.blocks.free_blocks(seq.block_table)
        seq.status = Status.WAITING
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0
        seq.last_block_hash = 0
        self._place(self.waiting, seq, front=True)
        self.num_preemptions += 1
        out.preempted.append(seq)
