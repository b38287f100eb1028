"""Sampling parameters, with vLLM's names and meanings; their checks and defaults live here."""
from __future__ import annotations

from dataclasses import dataclass, field

# Smaller positive temperatures are raised to this, as vLLM does: logits / 1e-40 overflow to NaN.
MIN_TEMPERATURE = 0.01


class InvalidRequest(ValueError):
    """A request the engine refuses; param names the offending field (OpenAI's error `param`)."""

    def __init__(self, param: str | None, message: str, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    max_tokens: int | None = 16  # None: up to the context window
    logprobs: int | None = None  # top-N alternatives per generated token
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()} or None
        self._validate()

    def _validate(self) -> None:
        checks = [
            ("n", self.n >= 1, "must be at least 1"),
            ("temperature", self.temperature >= 0, "must be non-negative"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be -1 (off), 0 (off) or positive"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("repetition_penalty", self.repetition_penalty > 0, "must be greater than 0"),
            ("min_tokens", self.min_tokens >= 0, "must be non-negative"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be at least 1"),
            ("min_tokens", self.max_tokens is None or self.min_tokens <= self.max_tokens,
             "must not exceed max_tokens"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be in [0, 20]"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
             "must be in [0, 20]"),
            ("logit_bias", all(-100 <= v <= 100 for v in (self.logit_bias or {}).values()),
             "values must be in [-100, 100]"),
            ("stop", all(isinstance(s, str) and s for s in self.stop_strings),
             "must be non-empty strings"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise InvalidRequest(name, f"{name} {why}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
