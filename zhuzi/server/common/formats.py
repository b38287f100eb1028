"""What one request produced, the last step before the wire: a ResponseState gathers its prompts' choices, parsed
(content, reasoning, tool calls) and laid out as content parts; each API's Format writes it as its JSON answer or
its stream's events (a delta's events, a stream's end, a failure once the stream has begun, the whole answer).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import pydantic

from zhuzi.outputs import CompletionOutput, Logprob, PromptProgress, RequestMetrics, RequestOutput
from zhuzi.server.common.content_parts import PartEvent, Parts
from zhuzi.server.common.errors import ApiError
from zhuzi.server.common.harmony_parser import HarmonyParser
from zhuzi.server.common.parsers import OutputParser, ParsedText


def sse(payload: pydantic.BaseModel | dict) -> str:
    data = payload.model_dump_json() if isinstance(payload, pydantic.BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


def sse_event(name: str, payload: pydantic.BaseModel) -> str:
    """A named server-sent event, as Anthropic's and the Responses API's streams send them."""
    return f"event: {name}\n{sse(payload)}"


@dataclass
class Choice:
    """One of the n completions of one prompt, as its deltas accumulate."""

    index: int
    parser: OutputParser | HarmonyParser
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    draft_accepted: list[bool] | None = None  # speculative decoding's marks, one per token (CompletionOutput)
    drafts_rejected: list[list[int] | None] | None = None
    parsed: ParsedText = field(default_factory=ParsedText)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    started: bool = False  # streaming: whether its first event went out
    parts: Parts = field(default_factory=Parts)
    events: list[PartEvent] = field(default_factory=list)  # what the latest delta did to the parts
    token_parts: list[int] = field(default_factory=list)  # per token, the part its text went to (-1: none)

    def absorb(self, delta: CompletionOutput) -> ParsedText:
        """Take one engine delta; return the parsed news it brings."""
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        if delta.draft_accepted is not None:
            self.draft_accepted = (self.draft_accepted or []) + delta.draft_accepted
            self.drafts_rejected = (self.drafts_rejected or []) + delta.drafts_rejected
        piece = self.parser.feed(delta.text)
        if delta.finish_reason is not None:
            piece.extend(self.parser.finish())
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        self.parsed.extend(piece)
        self.events = self.parts.feed(piece) + (self.parts.close() if self.finish_reason else [])
        self._place_tokens(len(delta.token_ids))
        return piece

    def _place_tokens(self, count: int) -> None:
        """The delta's tokens go to the part its text grew; held-back tokens (part of a character) join the
        part that goes on after them, and markup (a tag that opens a part) none."""
        grown = [e.index for e in self.events if e.kind == "delta"]
        part = grown[-1] if grown else -1
        self.token_parts += [-1] * count
        if part < 0:
            return
        held = len(self.token_parts) - count
        while held > 0 and self.token_parts[held - 1] == -1:
            held -= 1
        before = self.token_parts[held - 1] if held else -1
        start = held if before == part else len(self.token_parts) - count
        self.token_parts[start:] = [part] * (len(self.token_parts) - start)

    @property
    def call_failure(self) -> str | None:
        """Why a call of the reply came back as its text, in vLLM's stop_reason field: max_tokens cut it
        ("unfinished_tool_call"), or it is broken or the reply ended inside it otherwise ("invalid_tool_call")."""
        failure = self.parser.failure
        if failure is None or self.finish_reason not in ("stop", "length"):
            return None
        return "unfinished_tool_call" if failure == "open" and self.finish_reason == "length" else "invalid_tool_call"

    def part_tokens(self, index: int) -> tuple[list[int], list[dict[int, Logprob]]]:
        """A part's tokens and their logprobs entries (when the request asked for them)."""
        picked = [i for i, part in enumerate(self.token_parts) if part == index]
        return [self.token_ids[i] for i in picked], [self.logprobs[i] for i in picked if i < len(self.logprobs)]

    def reasoning_tokens(self, think_close: int | None) -> int:
        """The tokens of the reply's thought, its closing tag included (all of them while it is open)."""
        if not self.parser.thought:
            return 0
        if think_close is not None and think_close in self.token_ids:
            return self.token_ids.index(think_close) + 1
        return len(self.token_ids)


@dataclass
class PromptStats:
    token_count: int = 0
    cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    logprobs: list[dict[int, Logprob] | None] | None = None  # prompt logprobs (echo)
    answered: bool = False  # a token of it came
    progress_shown: bool = False  # return_progress: an event of its prefill's progress went out


@dataclass
class ResponseState:
    """Everything one API request produced so far, across its prompts and choices."""

    n: int
    new_parser: Callable[[], OutputParser | HarmonyParser]
    prompts: list[PromptStats]
    think_close: int | None = None  # </think> (harmony's <|end|>): usage counts the thought's tokens up to it
    choices: dict[int, Choice] = field(default_factory=dict)

    def progress(self, prompt_index: int, out: RequestOutput) -> PromptProgress | None:
        """The prompt's prefill progress to show before its first token: only of a prompt that takes more than
        one step, and so its completion (processed = total) too once a part was shown."""
        state, progress = self.prompts[prompt_index], out.prompt_progress
        if progress is None or state.answered or (progress.processed == progress.total and not state.progress_shown):
            return None
        state.progress_shown = True
        return progress

    def update(self, prompt_index: int, out: RequestOutput) -> list[tuple[Choice, CompletionOutput, ParsedText]]:
        state = self.prompts[prompt_index]
        state.answered = state.answered or any(delta.token_ids for delta in out.outputs)
        state.token_count, state.cached_tokens = len(out.prompt_token_ids), out.num_cached_tokens
        state.metrics = out.metrics or state.metrics
        if state.logprobs is None:
            state.logprobs = out.prompt_logprobs
        news = []
        for delta in out.outputs:
            index = prompt_index * self.n + delta.index
            choice = self.choices.setdefault(index, Choice(index, self.new_parser()))
            news.append((choice, delta, choice.absorb(delta)))
        return news

    @property
    def prompt_tokens(self) -> int:
        return sum(s.token_count for s in self.prompts)

    @property
    def cached_tokens(self) -> int:
        return sum(s.cached_tokens for s in self.prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices.values())

    @property
    def reasoning_tokens(self) -> int | None:
        """None for a model that does not think."""
        if self.think_close is None:
            return None
        return sum(c.reasoning_tokens(self.think_close) for c in self.choices.values())

    def sorted_choices(self) -> list[Choice]:
        return [self.choices[i] for i in sorted(self.choices)]


class Format(Protocol):
    request_id: str

    def events(self, gen: ResponseState, choice: Choice, delta: CompletionOutput, piece: ParsedText,
               prompt_index: int) -> list[str]:
        """The SSE events one engine delta makes."""

    def progress(self, progress: PromptProgress) -> list[str]:
        """The events that show a prompt's prefill progress before its first token (none unless asked for)."""

    def end(self, gen: ResponseState) -> list[str]:
        """The events that end a stream that went well."""

    def failure(self, gen: ResponseState, error: ApiError) -> list[str]:
        """The events that end a stream the engine failed (the headers are out: the error goes in-band)."""

    def response(self, gen: ResponseState) -> pydantic.BaseModel:
        """The whole answer."""
