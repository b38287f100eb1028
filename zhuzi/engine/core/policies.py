"""The scheduler's policies (--scheduling-policy): in what order sequences are served, how many of a step's
tokens each tenant may take, and whom to preempt when the KV pool or the batch is full. Policies are
model-free: they read a sequence's tenant, priority, status and page count, never the KV pool.
docs/scheduling.md describes each.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from weakref import WeakKeyDictionary

from zhuzi.engine.sequence import ScheduledSeq, Sequence, Status
from zhuzi.sampling_params import InvalidRequest, SamplingParams

POLICIES = ("fcfs", "priority", "fair")
RETURN_STEPS = 2  # fair: steps the others' prompts wait for a tenant whose work just ran out


def urgency(seq: Sequence) -> tuple[int, int]:
    """Most urgent first: lower priority values, then the earlier arrival."""
    return seq.params.priority, seq.seq_id


class FirstComeFirstServed:
    """fcfs: the running sequences in the order they were admitted, then the queue; when the pool runs short
    the newest running sequence makes room; a waiting sequence never preempts."""

    name = "fcfs"
    orders_by_priority = False

    def check(self, params: SamplingParams) -> None:
        """A priority this policy would ignore is refused, not accepted and ignored."""
        if params.priority and not self.orders_by_priority:
            raise InvalidRequest("priority", f"priority {params.priority} needs the scheduling policy priority or "
                                             f"fair; this engine schedules {self.name}")

    def order(self, running: list[Sequence], waiting: Iterable[Sequence]) -> list[Sequence]:
        """Every sequence with work, in the order this step serves them."""
        return [*running, *waiting]

    def shares(self, demands: dict[str, int], budget: int) -> dict[str, int] | None:
        """The most tokens each tenant may take this step (None: no limit), from what each wants."""
        return None

    def uncapped(self) -> set[str]:
        """Tenants whose prompts go in whole while others decode, within their share (read after order())."""
        return set()

    def expecting(self) -> bool:
        """Whether a tenant is expected back at once, so that the others' prompts wait while their streams
        decode on (read after order())."""
        return False

    def victim(self, running: list[Sequence], seq: Sequence, held: Callable[[Sequence], int],
               need: int) -> Sequence | None:
        """Whom to preempt so that seq gets what it lacks, KV pages or a batch slot (held: how many a
        sequence holds; need: how many seq will hold). A running seq may be its own victim (it yields);
        None: a waiting seq waits."""
        return running[-1] if seq.status is Status.RUNNING else None

    def served(self, batch: list[ScheduledSeq]) -> None:
        """What this step scheduled, for policies that keep accounts."""


class Priority(FirstComeFirstServed):
    """vLLM's `priority` (lower is more urgent), ties first come; a waiting sequence that finds no KV pages or
    no batch slot preempts running ones of lower priority (the least urgent, newest first) until it fits."""

    name = "priority"
    orders_by_priority = True

    def order(self, running: list[Sequence], waiting: Iterable[Sequence]) -> list[Sequence]:
        return sorted([*running, *waiting], key=urgency)

    def victim(self, running: list[Sequence], seq: Sequence, held: Callable[[Sequence], int],
               need: int) -> Sequence | None:
        least = max(running, key=urgency, default=None)
        if seq.status is Status.RUNNING or (least is not None and least.params.priority > seq.params.priority):
            return least
        return None  # ties never preempt a waiting sequence's way in: first come


class FairShare(FirstComeFirstServed):
    """fair: tenants with work get equal (or weighted) shares of the engine's tokens, whatever their number of
    requests. Virtual-time fair queuing: a tenant's counter is the tokens it was served per weight, the lowest
    served first; one back from idle starts at the lowest busy counter (Sheng et al., OSDI 2024: the virtual
    token counter). A step gives each the slowest tenant's pace plus what it is behind the most-served one;
    the least-served tenant's prompt goes in whole, and for RETURN_STEPS steps after a tenant's work runs
    out the others' prompts wait (anticipatory scheduling, Iyer and Druschel, SOSP 2001). A tenant holding
    less preempts the heaviest one's least urgent sequence; within a tenant, `priority` orders."""

    name = "fair"
    orders_by_priority = True

    def __init__(self) -> None:
        self.counters: dict[str, float] = {}  # tenant -> tokens served / weight
        self.weights: dict[str, float] = {}
        self.active: set[str] = set()  # tenants that had work at the last step
        self.returned: set[str] = set()  # tenants that have work again this step, after none
        self.left: dict[str, int] = {}  # tenant -> the step its work ran out, for RETURN_STEPS steps
        self.steps = 0
        self.last_served: WeakKeyDictionary[Sequence, int] = WeakKeyDictionary()

    def order(self, running: list[Sequence], waiting: Iterable[Sequence]) -> list[Sequence]:
        waiting = list(waiting)
        groups: dict[str, tuple[list[Sequence], list[Sequence]]] = {}
        for seq in running + waiting:
            self.weights[seq.tenant.id] = seq.tenant.weight
            groups.setdefault(seq.tenant.id, ([], []))[seq.status is not Status.RUNNING].append(seq)
        self._lift(set(groups))
        order = []
        # Level counters: a tenant back from idle first, so its prompt finds the step's room.
        for tenant in sorted(groups, key=lambda t: (self.counters[t], t not in self.returned, t)):
            mine, queued = groups[tenant]
            # Round robin among the tenant's running sequences when its share is short, then its queue.
            order += sorted(mine, key=lambda s: (self.last_served.get(s, -1), s.seq_id))
            order += sorted(queued, key=urgency)
        return order

    def _lift(self, tenants: set[str]) -> None:
        """A tenant with new work starts no lower than the lowest counter among those already busy."""
        busy = [self.counters[t] for t in tenants & self.active]
        floor = min(busy, default=0.0)
        self.returned = tenants - self.active
        for tenant in self.returned:
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)
        self.left.update(dict.fromkeys(self.active - tenants, self.steps))
        self.left = {t: step for t, step in self.left.items() if t not in tenants and self.steps - step < RETURN_STEPS}
        self.active = tenants

    def shares(self, demands: dict[str, int], budget: int) -> dict[str, int] | None:
        busy = [t for t, d in demands.items() if d > 0]
        if len(busy) < 2:
            return None  # alone: the whole engine
        pace = min(demands[t] / self.weights[t] for t in busy)
        lead = max(self.counters[t] for t in busy)
        return {t: budget if t in self.returned else int(self.weights[t] * (pace + lead - self.counters[t]))
                for t in busy}

    def uncapped(self) -> set[str]:
        """Of the tenants with work (order() just found them), the least served; where all are level (one
        just came back from idle, lifted to the others), those that came back."""
        if len(self.active) < 2:
            return set()
        low = min(self.counters[t] for t in self.active)
        least = {t for t in self.active if self.counters[t] == low}
        return least if least != self.active else self.returned

    def expecting(self) -> bool:
        """A tenant whose work ran out in the last RETURN_STEPS steps: a chat's next turn (an agent's next
        call) follows its answer at once, and should not queue behind a step full of the others' prompts."""
        return bool(self.left)

    def victim(self, running: list[Sequence], seq: Sequence, held: Callable[[Sequence], int],
               need: int) -> Sequence | None:
        holdings: dict[str, float] = {}
        for s in running:
            holdings[s.tenant.id] = holdings.get(s.tenant.id, 0.0) + held(s) / s.tenant.weight
        if seq.status is Status.RUNNING:
            heaviest = max(holdings, key=lambda t: (holdings[t], self.counters.get(t, 0.0)))
            return max((s for s in running if s.tenant.id == heaviest), key=urgency)
        mine = holdings.get(seq.tenant.id, 0.0) + need / seq.tenant.weight
        for tenant in sorted(holdings, key=lambda t: -holdings[t]):
            least = max((s for s in running if s.tenant.id == tenant), key=urgency)
            if tenant != seq.tenant.id and mine <= holdings[tenant] - held(least) / least.tenant.weight:
                return least
        return None

    def served(self, batch: list[ScheduledSeq]) -> None:
        self.steps += 1
        for item in batch:
            tenant = item.seq.tenant
            self.counters[tenant.id] = self.counters.get(tenant.id, 0.0) + item.num_new_tokens / tenant.weight
            self.last_served[item.seq] = self.steps


Policy = FirstComeFirstServed  # what every policy answers


def make_policy(name: str | None) -> Policy:
    """The policy named by --scheduling-policy (None: fcfs)."""
    kinds = {cls.name: cls for cls in (FirstComeFirstServed, Priority, FairShare)}
    if (name or "fcfs") not in kinds:
        raise ValueError(f"unknown scheduling policy {name!r}; choose one of {', '.join(POLICIES)}")
    return kinds[name or "fcfs"]()
