"""Who runs this step: continuous batching under a token budget, chunked prefill, preemption, and which
speculative drafts ride along; and, once the step's outputs are processed, its bookkeeping (computed
tokens, blocks published to the prefix cache, sequences that ended), as vLLM v1's scheduler does."""
from __future__ import annotations

from collections import deque

from zhuzi.engine.block_manager import BlockManager
from zhuzi.engine.sequence import ScheduledSeq, Sequence, Status, StepOutcome


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 long_prefill_token_threshold: int = 0, spec_step_tokens: int = 0):
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.spec_step_tokens = spec_step_tokens  # drafts join while a step computes at most this many tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is preempted first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        # While anyone decodes, a long prompt advances in small chunks so the streams keep their pace.
        cap = self.long_prefill_token_threshold if any(s.prompt_done for s in self.running) else 0
        scheduled = self._schedule_running(budget, cap)
        budget -= sum(s.num_new_tokens for s in scheduled)
        scheduled += self._admit_waiting(budget, cap)
        self._attach_drafts(scheduled)
        return scheduled

    def _attach_drafts(self, scheduled: list[ScheduledSeq]) -> None:
        """Drafts are extras: they fill what is left of the step's room, one token per sequence in turn,
        and never push anyone out (when the pool is short, a sequence goes without)."""
        room = min(self.max_num_batched_tokens, self.spec_step_tokens) - sum(s.num_new_tokens for s in scheduled)
        wanting = [s for s in scheduled if s.seq.spec_token_ids and s.seq.is_decoding]
        given = [0] * len(wanting)
        while room > 0 and any(k < len(s.seq.spec_token_ids) for k, s in zip(given, wanting)):
            for i, item in enumerate(wanting):
                if room > 0 and given[i] < len(item.seq.spec_token_ids):
                    given[i] += 1
                    room -= 1
        for item, k in zip(wanting, given):
            if k and self.blocks.allocate_slots(item.seq, 1 + k):
                item.spec_token_ids, item.num_new_tokens = item.seq.spec_token_ids[:k], 1 + k

    @staticmethod
    def _chunk(seq: Sequence, budget: int, cap: int) -> int:
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        return min(n, cap) if cap else n

    def _schedule_running(self, budget: int, cap: int) -> list[ScheduledSeq]:
        """Running sequences first, oldest first: decodes get their token before new prefills."""
        scheduled, i = [], 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq, budget, cap)
            while not self.blocks.allocate_slots(seq, n):
                self._preempt(self.running.pop())
                if seq.status is Status.WAITING:  # it was the newest itself
                    return scheduled
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1
        return scheduled

    def _admit_waiting(self, budget: int, cap: int) -> list[ScheduledSeq]:
        scheduled = []
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if seq.leader is not None and not (seq.leader.prompt_done or seq.leader.finished):
                continue  # let the leader fill the shared prompt blocks first
            if not seq.block_table and seq.params.prompt_logprobs is None:
                seq.num_computed_tokens = self.blocks.reuse_cached_prefix(seq)
                if not seq.ever_scheduled:
                    seq.num_cached_tokens = seq.num_computed_tokens
            n = self._chunk(seq, budget, cap)
            if not self.blocks.allocate_slots(seq, n):
                self.blocks.free_sequence(seq)  # give back the cached prefix it was holding
                break
            self.waiting.remove(seq)
            self.running.append(seq)
            seq.status, seq.ever_scheduled = Status.RUNNING, True
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return scheduled

    def _preempt(self, seq: Sequence) -> None:
        """Free the newest request's blocks and requeue it first in line; it recomputes later."""
        self.blocks.free_sequence(seq)
        seq.status = Status.WAITING
        seq.spec_token_ids, seq.spec_probs = [], None
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def update_from_output(self, batch: list[ScheduledSeq], outcome: StepOutcome) -> None:
        """After a step: each sequence's computed tokens (drafts count once they stand), its full blocks published
        to the prefix cache (not a sampled sequence whose tokens were not emitted: its request failed), then the
        sequences that ended finished and their blocks freed."""
        for item in batch:
            seq, accepted = item.seq, outcome.emitted.get(item.seq.seq_id)
            seq.num_computed_tokens += item.num_new_tokens - len(item.spec_token_ids) + (accepted or 0)
            if not item.samples or accepted is not None:
                self.blocks.register_computed(seq)  # before finishing, so the last blocks reach the prefix cache
        for seq, reason, stop_reason in outcome.finished:
            self.finish(seq, reason, stop_reason)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self.blocks.free_sequence(seq)
        seq.status, seq.finish_reason, seq.stop_reason = Status.FINISHED, reason, stop_reason
