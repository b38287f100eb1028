"""A reply in a tool format read as the server reads it, for the formats' tests: whole, one character at a time,
in random pieces, and one token at a time through the real detokenizer (SmolLM2's vocabulary with the families'
markers as the tokens they are: Qwen's added, the others special, shown all the same). The readings must agree:
each call streams as OpenAI's do (its id and name, then its arguments in pieces that join into the whole reply's),
no call syntax reaches the content of a reply whose calls read, calls come indexed 0, 1, 2..., and a call that
fails says how."""
from __future__ import annotations

import functools
import json
import random

import tiny

from zhuzi.detokenizer import IncrementalDetokenizer
from zhuzi.model.loader import default_model_path
from zhuzi.sampling_params import SamplingParams
from zhuzi.server.common.parsers import CallFailure, OutputParser, ParsedText
from zhuzi.server.common.tool_formats import ToolFormat
from zhuzi.tokenizer import THOUGHT_TAGS, TOOL_MARKERS, Tokenizer

WEATHER = {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "where": {"type": "object"}},
    "required": ["city"]}}
TIME = {"name": "now", "parameters": {"type": "object", "properties": {}}}
FUNCTIONS = [WEATHER, TIME]


@functools.cache
def tokenizer() -> Tokenizer:
    hf = Tokenizer.load(default_model_path()).hf
    hf.add_tokens(["<tool_call>", "</tool_call>"])
    hf.add_special_tokens({"additional_special_tokens": sorted(TOOL_MARKERS) + tiny.GEMMA4_SPECIAL})
    return Tokenizer(hf)


def token_pieces(text: str) -> list[str]:
    """The text as a server streams it: one piece per generated token."""
    tok = tokenizer()
    detokenizer = IncrementalDetokenizer(tok, SamplingParams())
    return [detokenizer.step(i)[0] for i in tok.encode(text, parse_special=True)] + [detokenizer.flush()]


def merged(deltas: list[ParsedText]) -> ParsedText:
    total = ParsedText()
    for delta in deltas:
        total.extend(delta)
    return total


def random_pieces(text: str) -> list[str]:
    """The text cut at random (seeded by the text) into pieces of 1 to 8 characters."""
    rng, pieces, at = random.Random(text), [], 0
    while at < len(text):
        step = rng.randint(1, 8)
        pieces.append(text[at:at + step])
        at += step
    return pieces


def read(fmt: ToolFormat, text: str, reasoning: bool = False) -> ParsedText:
    """The reply read whole, checked against its readings one character at a time, in random pieces and one token
    at a time."""
    whole, _ = read_failing(fmt, text, reasoning)
    return whole


def read_failing(fmt: ToolFormat, text: str, reasoning: bool = False) -> tuple[ParsedText, CallFailure | None]:
    """read(), and how the reply's failed call failed (the same in every reading)."""
    tags = THOUGHT_TAGS[1]  # Gemma 4's channel: the only thought the test vocabulary holds

    def parser() -> OutputParser:
        return OutputParser(reasoning=reasoning, tools=True, tags=tags, fmt=fmt)

    reader = parser()
    whole = reader.parse(text)
    assert "".join(token_pieces(text)) == text  # every marker is shown
    for pieces in (list(text), random_pieces(text), token_pieces(text)):
        streaming = parser()
        deltas = [streaming.feed(piece) for piece in pieces] + [streaming.finish()]
        streamed = merged(deltas)
        assert (streamed.content, streamed.reasoning_content) == (whole.content, whole.reasoning_content)
        assert [(c.name, c.arguments) for c in streamed.tool_calls] == [(c.name, c.arguments) for c in whole.tool_calls]
        assert streaming.failure == reader.failure
        for call in whole.tool_calls:  # its id and name first, then its arguments in pieces
            first, *rest = [c for delta in deltas for c in delta.tool_calls if c.index == call.index]
            assert (first.id, first.name) != (None, None) and all((c.id, c.name) == (None, None) for c in rest)
            assert "".join(c.arguments for c in [first, *rest]) == call.arguments
            if len(pieces) == len(text):  # one character at a time, the arguments come in pieces
                assert len([c for c in [first, *rest] if c.arguments]) > 1
        if whole.tool_calls and reader.failure is None:
            assert fmt.open not in "".join(delta.content for delta in deltas)
    assert [c.index for c in whole.tool_calls] == list(range(len(whole.tool_calls)))
    return whole, reader.failure


def calls(parsed: ParsedText) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls]


def as_text(fmt: ToolFormat, text: str) -> CallFailure | None:
    """A reply that is no well-formed call reads as the text the model wrote; how its call failed (None: it was no
    call, as JSON or a fence that holds none)."""
    parsed, failure = read_failing(fmt, text)
    assert (parsed.content, parsed.tool_calls) == (text, [])
    return failure
