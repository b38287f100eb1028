"""What the engine hands back: per-request outputs, logprobs and timings, inspections and snapshots.

All plain data (dataclasses, lists, CPU tensors), so it can cross a process boundary."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from zhuzi.config import KVPlan
from zhuzi.model.model_config import ModelConfig


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the chosen token plus the top-N).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class RequestMetrics:
    """Timings of one request (time.monotonic() seconds)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    decode_step_times: list[float] = field(default_factory=list)  # seconds per decode step
    num_cached_tokens: int = 0

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def prefill_time(self) -> float | None:
        if self.first_token_time is None or self.first_scheduled_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def decode_time(self) -> float | None:
        if self.finished_time is None or self.first_token_time is None:
            return None
        return self.finished_time - self.first_token_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One sample of a request. Cumulative from LLM.generate; a delta from the async engine."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    # With speculative decoding, one entry per token of token_ids (None without a proposer):
    draft_accepted: list[bool] | None = None  # the token was a draft the model accepted
    drafts_rejected: list[list[int] | None] | None = None  # the model's own token of a step that checked
    # drafts: the drafts that step rejected ([]: it accepted all); None for the other tokens

    @classmethod
    def empty(cls, index: int, with_logprobs: bool, with_drafts: bool = False) -> CompletionOutput:
        return cls(index, "", [], logprobs=[] if with_logprobs else None,
                   draft_accepted=[] if with_drafts else None, drafts_rejected=[] if with_drafts else None)


@dataclass
class LensLayer:
    """The logit lens at one layer: the top tokens of its residual stream read out through the LM head."""

    token_ids: list[int]
    logprobs: list[float]


@dataclass
class Inspection:
    """What an inspection read at the last position of its token ids, or, for an embedding, over all of them."""

    logits: torch.Tensor | None = None  # [vocab] float32: the raw next-token logits (None for an embedding)
    lens: list[LensLayer] | None = None  # one per layer, when the probe asked for the logit lens
    embedding: torch.Tensor | None = None  # [hidden] float32, L2-normalized: the pooled final hidden state


@dataclass
class PromptProgress:
    """How far the prefill of a request's prompt has come, after a step that advanced it."""

    processed: int  # prompt tokens whose K/V are computed, those found in the prefix cache included
    total: int
    cached: int  # found in the prefix cache


@dataclass
class PinInfo:
    """A pinned prefix (POST /v1/cache/pins): what it holds and until when (Unix times)."""

    name: str
    num_tokens: int  # pinned: the tokens of its full pages
    num_pages: int
    bytes: int  # of KV cache its pages take
    created_at: float
    expires_at: float | None  # None: until deleted
    cached_tokens: int  # found cached (pool or tiers) when it was pinned


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # set (and finished) when the engine failed this request
    inspection: Inspection | None = None  # on the final output of a probe
    prompt_progress: PromptProgress | None = None  # after a step that advanced the prompt's prefill
    pin: PinInfo | None = None  # on the final output of a pin's probe
    error_param: str | None = None  # with error: the request's field at fault, where its own input caused it


class RequestError(RuntimeError):
    """The engine failed this request while running it; other requests were not affected. param: the request's
    field at fault where its own input caused the failure (a 4xx, OpenAI's error `param`), else None."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class SpecDecodingStats:
    """Speculative decoding so far, with vLLM's meanings: a draft is one sequence's proposal checked in one
    step (counted before any stop cuts the accepted run short)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # position i: drafts with > i accepted

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        per_pos += [0] * (num_draft_tokens - len(per_pos))
        for i in range(num_accepted_tokens):
            per_pos[i] += 1

    @classmethod
    def total(cls, parts: list[SpecDecodingStats | None]) -> SpecDecodingStats | None:
        """Several engines' counts added up; None when none of them speculates."""
        parts = [p for p in parts if p is not None]
        if not parts:
            return None
        out = cls()
        for p in parts:
            out.num_drafts += p.num_drafts
            out.num_draft_tokens += p.num_draft_tokens
            out.num_accepted_tokens += p.num_accepted_tokens
            per_pos = out.num_accepted_tokens_per_pos
            per_pos += [0] * (len(p.num_accepted_tokens_per_pos) - len(per_pos))
            for i, n in enumerate(p.num_accepted_tokens_per_pos):
                per_pos[i] += n
        return out

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a drafted step emits on average, the target's own token included (vLLM's convention)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


@dataclass
class TenantLoad:
    """One tenant's sequences in the engine (its id is a masked API key, never the key)."""

    tenant: str
    running: int
    waiting: int

    @classmethod
    def total(cls, loads: list[TenantLoad]) -> list[TenantLoad]:
        """Several engines' loads added up per tenant."""
        totals: dict[str, TenantLoad] = {}
        for load in loads:
            total = totals.setdefault(load.tenant, cls(load.tenant, 0, 0))
            total.running += load.running
            total.waiting += load.waiting
        return sorted(totals.values(), key=lambda load: load.tenant)


@dataclass
class KVTierStats:
    """One KV tier below the pool (host memory, disk): its contents and traffic, in pages unless named."""

    pages: int = 0
    bytes: int = 0
    hit_tokens: int = 0  # prompt tokens loaded from it into the pool instead of computed
    stored: int = 0  # pages put into it
    evicted: int = 0  # pages it let go to make room
    refused: int = 0  # files skipped: corrupt, foreign or unreadable
    dropped: int = 0  # saves given up: no room (everything pinned) or the disk writer behind

    @classmethod
    def total(cls, parts: list[KVTierStats]) -> KVTierStats:
        return cls(*(sum(getattr(p, f.name) for p in parts) for f in fields(cls)))


@dataclass
class EngineStats:
    """A snapshot of the engine for /metrics and logs."""

    num_running: int
    num_waiting: int
    num_pages: int
    num_free_pages: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens found cached
    spec_decoding: SpecDecodingStats | None = None  # None: speculative decoding is off
    tenants: list[TenantLoad] = field(default_factory=list)  # those with sequences in the engine
    kv_tiers: dict[str, KVTierStats] = field(default_factory=dict)  # "host", "disk": the ones configured
    num_pins: int = 0
    pinned_pages: int = 0  # pool pages held by pins
    pinned_bytes: int = 0
    kv_transfers_sent: int = 0  # prefill/decode hand-offs: requests whose pages this engine sent
    kv_transfers_received: int = 0  # ... received (a decode replica)
    kv_transfers_failed: int = 0  # ... that never arrived: the decode replica computed the prompt itself
    kv_transfer_pages_sent: int = 0
    kv_transfer_pages_received: int = 0

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_pages / self.num_pages if self.num_pages else 0.0

    @classmethod
    def total(cls, parts: list[EngineStats]) -> EngineStats:
        """Several engines' stats added up (data-parallel replicas)."""
        if not parts:
            return cls(0, 0, 0, 0, 0, 0)
        counts = {f.name: sum(getattr(p, f.name) for p in parts) for f in fields(cls)
                  if f.name not in ("spec_decoding", "tenants", "kv_tiers")}
        tiers = {name: KVTierStats.total([p.kv_tiers[name] for p in parts if name in p.kv_tiers])
                 for name in sorted({name for p in parts for name in p.kv_tiers})}
        return cls(**counts, spec_decoding=SpecDecodingStats.total([p.spec_decoding for p in parts]),
                   tenants=TenantLoad.total([load for p in parts for load in p.tenants]), kv_tiers=tiers)


@dataclass
class StepRow:
    """One sequence's share of a step, as the inspector's batch view draws it."""

    request_id: str
    kind: str  # "prefill": a chunk of a prompt (a probe's too); "decode": one token; "verify": drafts + 1
    tokens: int  # tokens whose K/V the step computed for it
    context: int  # tokens its last one attended to (the K/V it read)
    drafts: int = 0  # verify: the draft tokens it checked
    accepted: int = 0  # verify: of those, the ones the model accepted


@dataclass
class StepRecord:
    """One forward pass of the step loop, as the inspector's engine and batch views draw it."""

    index: int  # steps since the engine started
    end_time: float  # time.monotonic()
    duration: float  # seconds of model execution (forward pass and sampling)
    rows: list[StepRow]

    @property
    def prefill_tokens(self) -> int:
        return sum(row.tokens for row in self.rows if row.kind == "prefill")

    @property
    def decode_tokens(self) -> int:
        """Sequences that decoded one token."""
        return sum(row.kind == "decode" for row in self.rows)

    @property
    def verify_tokens(self) -> int:
        return sum(row.tokens for row in self.rows if row.kind == "verify")

    @property
    def kv_tokens_read(self) -> int:
        """Context tokens the decodes attended to."""
        return sum(row.context for row in self.rows if row.kind == "decode")


@dataclass
class EngineSnapshot:
    """The engine between two steps: its model, KV pool, queues and recent steps."""

    time: float  # time.monotonic() when taken
    model: ModelConfig
    dtype: str  # the precision: "bfloat16", or "float32 (weights and KV bfloat16)"
    cpu_kernels: dict[str, str]  # Decoder.kernel_paths()
    max_model_len: int
    weight_bytes_per_decode_step: int
    stats: EngineStats
    kv_plan: KVPlan
    cached_pages: int  # pages holding a prefix-cache entry, in use or free
    read_bandwidth: float  # bytes/s, measured once on the step loop's thread
    steps: list[StepRecord]  # the most recent, oldest first
    pins: list[PinInfo] = field(default_factory=list)
    pinned_limit_bytes: int = 0  # what pins may hold (EngineConfig.kv_pinned_memory)
