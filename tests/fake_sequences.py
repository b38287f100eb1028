"""Fake sequences for the scheduler and page-manager tests: the engine's bookkeeping without a model."""
from __future__ import annotations

import itertools

from zhuzi.engine.core.kv.page_manager import PageManager
from zhuzi.engine.core.policies import make_policy
from zhuzi.engine.core.scheduler import Scheduler
from zhuzi.engine.sequence import ScheduledSeq, Sequence, StepOutcome, Tenant
from zhuzi.sampling_params import SamplingParams

_ids = itertools.count()


def seq(prompt: list[int] | int, tenant: str = "", weight: float = 1.0, **params) -> Sequence:
    """A sequence whose prompt is the given ids, or that many distinct ids."""
    seq_id = next(_ids)
    tokens = list(range(1000 * seq_id, 1000 * seq_id + prompt)) if isinstance(prompt, int) else prompt
    return Sequence(seq_id, f"r{seq_id}", 0, tokens, SamplingParams(max_tokens=None, **params),
                    tenant=Tenant(tenant, weight))


def run_step(scheduler: Scheduler, token: int = 7) -> list[ScheduledSeq]:
    """One engine step without a model: each sequence that reached its end emits this token (and nothing
    stops it), then the scheduler does the step's bookkeeping."""
    batch = scheduler.schedule()
    outcome = StepOutcome()
    for item in batch:
        if item.samples:
            item.seq.token_ids.append(token)
            outcome.emitted[item.seq.seq_id] = 0
    scheduler.update_from_output(batch, outcome)
    return batch


def scheduler(num_pages: int = 64, page_size: int = 4, max_num_seqs: int = 8, budget: int = 32,
              long_prefill: int = 0, prefix_caching: bool = True, policy: str = "fcfs") -> Scheduler:
    return Scheduler(PageManager(num_pages, page_size, prefix_caching), max_num_seqs, budget, long_prefill,
                     policy=make_policy(policy))
