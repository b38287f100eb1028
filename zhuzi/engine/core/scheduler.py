"""Who runs this step: continuous batching under a token budget, chunked prefill, preemption, and which
speculative drafts ride along; and, once the step's outputs are processed, its bookkeeping (computed
tokens, pages published to the prefix cache, sequences that ended), as vLLM v1's scheduler does. The
policy (policies.py) says in what order sequences are served, how much of the step each tenant may take,
and whom to preempt."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from zhuzi.engine.core.kv.page_manager import FREED, PageManager
from zhuzi.engine.core.policies import FirstComeFirstServed, Policy
from zhuzi.engine.sequence import ScheduledSeq, Sequence, Status, StepOutcome
from zhuzi.outputs import TenantLoad


def scheduled(seq: Sequence, n: int) -> ScheduledSeq:
    """seq's next n tokens as a row of a step, stamped with its kind (drafts that join it make it a verify)."""
    return ScheduledSeq(seq, n, "decode" if _decodes_next(seq) else "prefill")


def _decodes_next(seq: Sequence) -> bool:
    """Its prompt is computed and only its newest token is not: its next row is a decode."""
    return seq.prompt_done and seq.num_tokens - seq.num_computed_tokens == 1


@dataclass
class StepPlan:
    """What one schedule() call has decided so far: the batch, what is left of the token budget, each
    tenant's share and use of it, and who was preempted (they wait for a later step)."""

    budget: int
    cap: int = 0  # the tokens of a prompt a step takes while others decode (0: no cap)
    uncapped: set[str] = field(default_factory=set)  # tenants whose prompts the cap does not hold
    shares: dict[str, int] | None = None
    used: dict[str, int] = field(default_factory=dict)
    batch: list[ScheduledSeq] = field(default_factory=list)
    preempted: set[Sequence] = field(default_factory=set)
    blocked: bool = False  # a waiting sequence found no room: later ones do not jump it
    prompts_wait: bool = False  # the prompts of tenants the cap holds wait this step; their streams decode on

    def room(self, seq: Sequence) -> int:
        """Tokens seq may take this step: the budget left, within its tenant's share."""
        if self.prompts_wait and not seq.prompt_done and seq.tenant.id not in self.uncapped:
            return 0
        if self.shares is None:
            return self.budget
        return min(self.budget, self.shares.get(seq.tenant.id, 0) - self.used.get(seq.tenant.id, 0))

    def cap_of(self, seq: Sequence) -> int:
        return 0 if seq.tenant.id in self.uncapped else self.cap

    def add(self, item: ScheduledSeq) -> None:
        self.batch.append(item)
        self.budget -= item.num_new_tokens
        self.used[item.seq.tenant.id] = self.used.get(item.seq.tenant.id, 0) + item.num_new_tokens
        # A step that carries an uncapped tenant's prompt beside decoding streams carries no other prompt: it
        # costs the streams, and that prompt's first token, as little as it can.
        self.prompts_wait |= bool(self.cap) and item.kind == "prefill" and item.seq.tenant.id in self.uncapped

    def drop(self, seq: Sequence) -> None:
        """seq was preempted: it leaves the batch, if it was in it, and waits."""
        self.preempted.add(seq)
        for item in self.batch:
            if item.seq is seq:
                self.batch.remove(item)
                self.budget += item.num_new_tokens
                self.used[seq.tenant.id] -= item.num_new_tokens
                return


class Scheduler:
    def __init__(self, page_manager: PageManager, max_num_seqs: int, max_num_batched_tokens: int,
                 long_prefill_token_threshold: int = 0, spec_step_tokens: int = 0, policy: Policy | None = None):
        self.pages = page_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.spec_step_tokens = spec_step_tokens  # drafts join while a step computes at most this many tokens
        self.policy = policy or FirstComeFirstServed()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> list[ScheduledSeq]:
        # While anyone decodes, a long prompt advances in small chunks so the streams keep their pace.
        cap = self.long_prefill_token_threshold if any(s.prompt_done for s in self.running) else 0
        order = self.policy.order(self.running, self.waiting)
        plan = StepPlan(self.max_num_batched_tokens, cap, self.policy.uncapped())
        plan.prompts_wait = bool(cap) and self.policy.expecting()
        # A tenant that cannot be served (no slot, no pages) must not hold the others to their shares for
        # good: a step that the shares leave empty goes on without them.
        for shares in (self.policy.shares(self._demands(order, plan), plan.budget), None):
            plan.shares = shares
            self._walk(order, plan)
            if plan.batch or (shares is None and not plan.prompts_wait):
                break
            plan.prompts_wait = False
        self.policy.served(plan.batch)
        self._attach_drafts(plan.batch)
        return plan.batch

    def _walk(self, order: list[Sequence], plan: StepPlan) -> None:
        for seq in order:
            if plan.budget <= 0:
                break
            if seq in plan.preempted or (room := plan.room(seq)) <= 0:
                continue
            if seq.status is Status.RUNNING:
                self._continue(seq, room, plan)
            elif not plan.blocked:
                self._admit(seq, room, plan)

    def _demands(self, order: list[Sequence], plan: StepPlan) -> dict[str, int]:
        """The tokens each tenant could use this step."""
        demands: dict[str, int] = {}
        for seq in order:
            if seq.status is Status.RUNNING or not self._held_by_leader(seq):
                n = self._chunk(seq, self.max_num_batched_tokens, plan.cap_of(seq))
                demands[seq.tenant.id] = demands.get(seq.tenant.id, 0) + n
        return demands

    def decoding(self) -> list[Sequence]:
        """The running sequences whose next row is a decode (those a proposer drafts for)."""
        return [s for s in self.running if _decodes_next(s)]

    def _attach_drafts(self, batch: list[ScheduledSeq]) -> None:
        """Drafts are extras: they fill what is left of the step's room, one token per sequence in turn,
        and never push anyone out (when the pool is short, a sequence goes without)."""
        room = min(self.max_num_batched_tokens, self.spec_step_tokens) - sum(s.num_new_tokens for s in batch)
        wanting = [s for s in batch if s.seq.spec_token_ids and s.kind == "decode"]
        given = [0] * len(wanting)
        while room > 0 and any(k < len(s.seq.spec_token_ids) for k, s in zip(given, wanting)):
            for i, item in enumerate(wanting):
                if room > 0 and given[i] < len(item.seq.spec_token_ids):
                    given[i] += 1
                    room -= 1
        for item, k in zip(wanting, given):
            if k and self.pages.allocate_slots(item.seq, 1 + k):
                item.spec_token_ids, item.num_new_tokens = item.seq.spec_token_ids[:k], 1 + k
                item.kind = "verify"

    @staticmethod
    def _chunk(seq: Sequence, budget: int, cap: int) -> int:
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        return min(n, cap) if cap else n

    def _continue(self, seq: Sequence, room: int, plan: StepPlan) -> None:
        """A running sequence's next tokens; when the pool runs short, the policy's victims make room (seq
        itself, if it is the one to yield), and nobody new is admitted this step."""
        n = self._chunk(seq, room, plan.cap_of(seq))
        while not self.pages.allocate_slots(seq, n):
            victim = self.policy.victim(self.running, seq, self._pages_held, self._pages_after(seq, n))
            assert victim is not None, "a running sequence always has a victim, at worst itself"
            self._preempt(victim, plan)
            plan.blocked = True
            if victim is seq:
                return
        plan.add(scheduled(seq, n))

    def _admit(self, seq: Sequence, room: int, plan: StepPlan) -> None:
        """A waiting sequence joins the batch if it finds a slot and pages, preempting whom the policy lets
        it; otherwise it and everyone behind it wait."""
        if self._held_by_leader(seq) or seq.awaiting_kv:  # awaiting_kv: its pages come from a prefill replica
            return
        while len(self.running) >= self.max_num_seqs:
            victim = self.policy.victim(self.running, seq, lambda s: 1, 1)
            if victim is None:
                plan.blocked = True
                return
            self._preempt(victim, plan)
        if not seq.page_table and not seq.reads_every_prompt_token:
            self.pages.reuse_cached_prefix(seq)
            if not seq.ever_scheduled:
                seq.num_cached_tokens = seq.num_computed_tokens
        n = self._chunk(seq, room, plan.cap_of(seq))
        while not self.pages.allocate_slots(seq, n):
            victim = self.policy.victim(self.running, seq, self._pages_held, self._pages_after(seq, n))
            if victim is None:
                self.pages.free_sequence(seq)  # give back the cached prefix it was holding
                plan.blocked = True
                return
            self._preempt(victim, plan)
        self.waiting.remove(seq)
        self.running.append(seq)
        seq.status, seq.ever_scheduled = Status.RUNNING, True
        plan.add(scheduled(seq, n))

    @staticmethod
    def _held_by_leader(seq: Sequence) -> bool:
        """A sibling waits while its leader fills the shared prompt pages."""
        return seq.leader is not None and not (seq.leader.prompt_done or seq.leader.finished)

    @staticmethod
    def _pages_held(seq: Sequence) -> int:
        return sum(page_id != FREED for page_id in seq.page_table)

    def _pages_after(self, seq: Sequence, n: int) -> int:
        return self.pages.pages_needed(seq.num_computed_tokens + n)

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Free a running sequence's pages and requeue it first in line; it recomputes later."""
        self.running.remove(seq)
        plan.drop(seq)
        self.pages.free_sequence(seq)
        seq.status = Status.WAITING
        seq.spec_token_ids, seq.spec_probs = [], None
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def update_from_output(self, batch: list[ScheduledSeq], outcome: StepOutcome) -> None:
        """After a step: each sequence's computed tokens (drafts count once they stand), its full pages published
        to the prefix cache (not a sampled sequence whose tokens were not emitted: its request failed), then the
        sequences that ended finished and their pages freed."""
        for item in batch:
            seq, accepted = item.seq, outcome.emitted.get(item.seq.seq_id)
            drafts = len(item.spec_token_ids)
            self.pages.computed(seq, item.num_new_tokens - drafts + (accepted or 0), drafts)
            if not item.samples or accepted is not None:
                self.pages.register_computed(seq)  # before finishing, so the last pages reach the prefix cache
            self.pages.slide(seq)  # after publishing: a page given back stays findable
        for seq, reason, stop_reason in outcome.finished:
            self.finish(seq, reason, stop_reason)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self.pages.free_sequence(seq)
        seq.status, seq.finish_reason, seq.stop_reason = Status.FINISHED, reason, stop_reason

    def tenant_loads(self) -> list[TenantLoad]:
        """Each tenant's running and waiting sequences."""
        return TenantLoad.total([TenantLoad(s.tenant.id, 1, 0) for s in self.running] +
                                [TenantLoad(s.tenant.id, 0, 1) for s in self.waiting])
