"""A reply in a tool format read as the server reads it, for the formats' tests: whole, one character at a time,
and one token at a time through the real detokenizer (SmolLM2's vocabulary with the families' markers as the
tokens they are: Qwen's added, the others special, shown all the same). The three readings must agree, and calls
must come indexed 0, 1, 2..."""
from __future__ import annotations

import functools
import json

import tiny

from zhuzi.detokenizer import IncrementalDetokenizer
from zhuzi.model.loader import default_model_path
from zhuzi.sampling_params import SamplingParams
from zhuzi.server.common.parsers import OutputParser, ParsedText
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


def read(fmt: ToolFormat, text: str, reasoning: bool = False) -> ParsedText:
    """The reply read whole, checked against its readings one character and one token at a time."""
    tags = THOUGHT_TAGS[1]  # Gemma 4's channel: the only thought the test vocabulary holds

    def parser() -> OutputParser:
        return OutputParser(reasoning=reasoning, tools=True, tags=tags, fmt=fmt)

    whole = parser().parse(text)
    assert "".join(token_pieces(text)) == text  # every marker is shown
    for pieces in (list(text), token_pieces(text)):
        reader = parser()
        streamed = merged([reader.feed(piece) for piece in pieces] + [reader.finish()])
        assert (streamed.content, streamed.reasoning_content) == (whole.content, whole.reasoning_content)
        assert [(c.name, c.arguments) for c in streamed.tool_calls] == [(c.name, c.arguments) for c in whole.tool_calls]
    assert [c.index for c in whole.tool_calls] == list(range(len(whole.tool_calls)))
    return whole


def calls(parsed: ParsedText) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls]


def as_text(fmt: ToolFormat, text: str) -> None:
    """A reply that is no well-formed call reads as the text the model wrote."""
    parsed = read(fmt, text)
    assert (parsed.content, parsed.tool_calls) == (text, [])
