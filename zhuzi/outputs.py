"""What the engine hands back: per-request outputs, logprobs and timings."""
from __future__ import annotations

from dataclasses import dataclass, field


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

    @classmethod
    def empty(cls, index: int, with_logprobs: bool) -> CompletionOutput:
        return cls(index, "", [], logprobs=[] if with_logprobs else None)


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


class RequestError(RuntimeError):
    """The engine failed this request while running it; other requests were not affected."""


@dataclass
class EngineStats:
    """A snapshot of the engine for /metrics and logs."""

    num_running: int
    num_waiting: int
    num_blocks: int
    num_free_blocks: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens found cached

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0
