"""Sampling parameters, with vLLM's names and meanings; their checks and defaults live here."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

# Smaller positive temperatures are raised to this, as vLLM does: logits / 1e-40 overflow to NaN.
MIN_TEMPERATURE = 0.01
MAX_N = 128  # OpenAI's limit; also keeps seed + i (sample i of n) within 64 bits
# Counts and top_k end up in int64 tensors or loops: bound them far above any real use, far below overflow.
MAX_COUNT = 2**31 - 1
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1  # int64; torch's generators take any 64-bit seed
MAX_LOGPROBS = 20
# Far below 1 it divides logits into overflow (NaN probabilities); real use stays near 1.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0


class InvalidRequest(ValueError):
    """A request the engine refuses; param names the offending field (OpenAI's error `param`)."""

    def __init__(self, param: str | None, message: str, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class StructuredOutputError(InvalidRequest):
    """A constraint the engine cannot enforce; field names which of StructuredOutputsParams' fields
    (a server renames it to its own, e.g. response_format.json_schema.schema)."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"structured_outputs.{field}", f"structured_outputs.{field}: {reason}")
        self.field, self.reason = field, reason


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """vLLM's structured_outputs: the output must match exactly one of these.

    json: a JSON schema (a dict, or its JSON text; property order is kept); json_object: any JSON
    object; regex: the whole output matches it (Rust regex syntax: no look-around or backreferences;
    \\d is [0-9]); choice: the output is one of the strings; grammar: a Lark grammar
    (llguidance's dialect, which also embeds JSON schemas as `%json {...}` and names special tokens
    as `<|name|>`) or GBNF. In JSON, runs of whitespace are at most a few characters long (a small
    model left unbounded can write newlines until max_tokens), none with disable_any_whitespace, or
    whatever whitespace_pattern matches. disable_additional_properties closes every object schema
    that does not say otherwise (additionalProperties: false), as OpenAI's strict mode does.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        self.json_object = self.json_object or None  # json_object=False asks for nothing
        given = [k for k in _CONSTRAINTS if getattr(self, k) is not None]
        if len(given) != 1:
            raise InvalidRequest("structured_outputs", "structured_outputs needs exactly one of "
                                 f"{', '.join(_CONSTRAINTS)}" + (f"; got {', '.join(given)}" if given else ""))
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as exc:
                raise StructuredOutputError("json", f"not valid JSON: {exc}") from exc
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise StructuredOutputError("json", "a JSON schema must be an object or a boolean")
        for name in ("regex", "grammar", "whitespace_pattern"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise StructuredOutputError(name, "must be a string")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise StructuredOutputError("choice", "must be a non-empty list of non-empty strings")
        if self.disable_any_whitespace and self.whitespace_pattern is not None:
            raise StructuredOutputError("whitespace_pattern", "cannot be combined with disable_any_whitespace")

    @property
    def kind(self) -> str:
        """Which constraint this is: json, regex, choice, grammar or json_object."""
        return next(k for k in _CONSTRAINTS if getattr(self, k) is not None)

    @property
    def key(self) -> str:
        """Everything the compiled grammar depends on (property order included): the cache key."""
        return json.dumps([self.kind, getattr(self, self.kind), self.disable_any_whitespace,
                           self.disable_additional_properties, self.whitespace_pattern])


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
    structured_outputs: StructuredOutputsParams | None = None  # the output follows a grammar
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if _float_in(self.temperature, 0, MIN_TEMPERATURE) and self.temperature > 0:
            self.temperature = MIN_TEMPERATURE
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()} or None
        self._validate()

    def _validate(self) -> None:
        """Every field in its range, so that nothing a request carries can fail a step later (the engine
        adds what only it knows: token ids and top_k against the vocabulary, lengths against the context)."""
        checks = [
            ("n", _int_in(self.n, 1, MAX_N), f"must be an integer in [1, {MAX_N}]"),
            ("temperature", _float_in(self.temperature, 0, math.inf), "must be a non-negative number"),
            ("top_p", _float_in(self.top_p, 0, 1) and self.top_p > 0, "must be in (0, 1]"),
            ("top_k", _int_in(self.top_k, 0, MAX_COUNT), f"must be -1 or 0 (off), or a count up to {MAX_COUNT}"),
            ("min_p", _float_in(self.min_p, 0, 1), "must be in [0, 1]"),
            ("presence_penalty", _float_in(self.presence_penalty, -2, 2), "must be in [-2, 2]"),
            ("frequency_penalty", _float_in(self.frequency_penalty, -2, 2), "must be in [-2, 2]"),
            ("repetition_penalty", _float_in(self.repetition_penalty, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY),
             f"must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY:g}]"),
            ("seed", self.seed is None or _int_in(self.seed, MIN_SEED, MAX_SEED), "must be a 64-bit signed integer"),
            ("min_tokens", _int_in(self.min_tokens, 0, MAX_COUNT), f"must be an integer in [0, {MAX_COUNT}]"),
            ("max_tokens", self.max_tokens is None or _int_in(self.max_tokens, 1, MAX_COUNT),
             f"must be an integer in [1, {MAX_COUNT}]"),
            ("min_tokens", not (_int_in(self.min_tokens, 0, MAX_COUNT) and _int_in(self.max_tokens, 1, MAX_COUNT))
             or self.min_tokens <= self.max_tokens, "must not exceed max_tokens"),
            ("logprobs", self.logprobs is None or _int_in(self.logprobs, 0, MAX_LOGPROBS),
             f"must be an integer in [0, {MAX_LOGPROBS}]"),
            ("prompt_logprobs", self.prompt_logprobs is None or _int_in(self.prompt_logprobs, 0, MAX_LOGPROBS),
             f"must be an integer in [0, {MAX_LOGPROBS}]"),
            ("logit_bias", all(_float_in(v, -100, 100) for v in (self.logit_bias or {}).values()),
             "values must be in [-100, 100]"),
            ("stop", all(isinstance(s, str) and s for s in self.stop_strings), "must be non-empty strings"),
            ("structured_outputs", self.structured_outputs is None
             or isinstance(self.structured_outputs, StructuredOutputsParams), "must be a StructuredOutputsParams"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise InvalidRequest(name, f"{name} {why}, got {_short(getattr(self, name))}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _int_in(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _float_in(value: Any, low: float, high: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and low <= value <= high


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
