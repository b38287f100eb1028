"""One sequence's state (its tokens, KV pages, progress through prefill, outcome), what the scheduler
hands the model runner for it each step, and what the step's output processing hands back to the
scheduler: data only, shared by them."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

from zhuzi.sampling_params import SamplingParams

if TYPE_CHECKING:
    from zhuzi.engine.thinking import ThoughtBudget
    from zhuzi.sample.grammar import GrammarMatcher


@dataclass(frozen=True)
class PinSpec:
    """A prefix to keep in the KV pool under a name (kv/pins.py), for ttl seconds (None: until deleted)."""

    name: str
    ttl: float | None = None


@dataclass(frozen=True)
class Probe:
    """An inspection: run some token ids through the step loop and read the model at the last one
    instead of sampling a token there (or, with pin, keep their KV pages)."""

    lens_top: int = 0  # the logit lens: this many top tokens per layer (0: no lens)
    pin: PinSpec | None = None
    embed: bool = False  # an embedding: the final hidden state pooled over every token (the runner's pooling)


@dataclass(frozen=True)
class Tenant:
    """Whom a request is served for, as the fair policy sees it: a stable id (a masked API key, never the key
    itself; "" for a server without keys) and its weight in the shares of a step."""

    id: str = ""
    weight: float = 1.0


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One sample of a request (a request with n > 1 has n sequences sharing a prompt)."""

    seq_id: int
    request_id: str
    index: int  # which of the request's n samples
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    leader: Sequence | None = None  # a sibling that must prefill first so its prompt pages are shared
    grammar: GrammarMatcher | None = None  # structured output: where the output is in its grammar
    probe: Probe | None = None  # an inspection: read out at its last token, never sampled
    thought: ThoughtBudget | None = None  # thinking_token_budget: where the sequence is in its thought
    tenant: Tenant = Tenant()
    token_ids: list[int] = field(init=False)
    # The pages and computed tokens are the page manager's to write (the scheduler and the draft proposer
    # go through it), so the two never disagree.
    page_table: list[int] = field(default_factory=list)
    page_hashes: list[bytes] = field(default_factory=list)  # of the full pages so far
    num_computed_tokens: int = 0  # tokens whose K/V sit in the cache
    # A hybrid model's state slots, the page manager's too: its live state; its state after boundary_tokens
    # tokens (the last page boundary it crossed, state_boundary), for the prefix cache; a cached state to start from;
    # with speculative decoding, where a verify leaves its state after each draft (and at a page boundary among them)
    state_slot: int | None = None
    boundary_slot: int | None = None
    boundary_tokens: int = 0
    restore_slot: int | None = None
    ships_prompt: bool = False  # a prefill replica's job: its prompt's pages and state go to a decode replica
    draft_slots: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # of the prompt, found in the prefix cache at first admission
    num_preemptions: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    ever_scheduled: bool = False
    awaiting_kv: bool = False  # held back until a prefill replica's pages come (kv/transfer.py)
    # Speculative decoding: tokens proposed to follow token_ids, checked by the next step. They never enter
    # token_ids (page hashes assume tokens only grow) until the target accepts them.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_probs: torch.Tensor | None = None  # [k, V]: a draft model's distributions; None for prompt lookup
    # An embedding's running sum of final hidden states: (tokens summed, their sum), so a retried step adds none twice.
    pooled: tuple[int, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def prompt_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    def state_boundary(self, end: int, page_size: int) -> int:
        """The page boundary whose state a hybrid model keeps when a step's tokens end at `end`: the last at or
        before it; for a prompt that ships, the last before its last token (where the decode replica, which
        computes that token, resumes)."""
        if self.ships_prompt and end == self.num_prompt_tokens:
            end -= 1
        return end // page_size * page_size

    @property
    def embeds(self) -> bool:
        return self.probe is not None and self.probe.embed

    @property
    def reads_every_prompt_token(self) -> bool:
        """Its prompt's every position is read (prompt logprobs, an embedding): no prefix is taken from the cache."""
        return self.params.prompt_logprobs is not None or self.embeds

    def max_length(self, max_model_len: int) -> int:
        """The number of tokens (prompt and output) at which it ends with "length"."""
        if self.params.max_tokens is None:
            return max_model_len
        return min(self.num_prompt_tokens + self.params.max_tokens, max_model_len)


# A row's share of a step, stamped by the scheduler when it schedules the row (scheduler.scheduled):
# "prefill" (a chunk of a prompt, or a recomputation), "decode" (one token past a computed prompt) or "verify"
# (the newest token and the drafts that follow it).
Kind = Literal["prefill", "decode", "verify"]


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: the scheduler's output, the model runner's input."""

    seq: Sequence
    num_new_tokens: int  # tokens whose K/V this step computes, drafts included
    kind: Kind
    spec_token_ids: list[int] = field(default_factory=list)  # the drafts this step verifies
    # True when this step reaches the sequence's last token, so its next token is drawn (decided when
    # scheduled: the tokens the step emits come after).
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        seq = self.seq
        self.samples = seq.num_computed_tokens + self.num_new_tokens - len(self.spec_token_ids) == seq.num_tokens


@dataclass
class StepOutcome:
    """What a step's outputs decided, for the scheduler's bookkeeping (Scheduler.update_from_output)."""

    # Per sequence whose sampled tokens were emitted (or whose inspection was read): how many of its drafts stand.
    emitted: dict[int, int] = field(default_factory=dict)
    # The sequences that ended (a stop, their length, an inspection read, a failure): reason, stop reason.
    finished: list[tuple[Sequence, str, int | str | None]] = field(default_factory=list)
