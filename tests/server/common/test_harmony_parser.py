"""The harmony reply parser: channels to reasoning, content and tool calls, the same however the text is chunked."""
from __future__ import annotations

import json

import pytest

from zhuzi.server.common.harmony_parser import HarmonyParser
from zhuzi.server.common.parsers import ParsedText

THOUGHT = "<|channel|>analysis<|message|>The user asks for 2 + 2. <Easy>.<|end|>"
ANSWER = "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4, <|not a marker|>"
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"city": "Paris"}')


def streamed(parser: HarmonyParser, text: str, size: int) -> ParsedText:
    out = ParsedText()
    for at in range(0, len(text), size):
        out.extend(parser.feed(text[at:at + size]))
    out.extend(parser.finish())
    return out


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_a_thought_and_an_answer_however_chunked(size: int) -> None:
    parser = HarmonyParser(tools=False)
    out = streamed(parser, THOUGHT + ANSWER, size)
    assert out.reasoning_content == "The user asks for 2 + 2. <Easy>."
    assert out.content == "2 + 2 = 4, <|not a marker|>"
    assert not out.tool_calls and parser.thought


def test_reasoning_streams_before_its_message_ends() -> None:
    parser = HarmonyParser(tools=False)
    first = parser.feed("<|channel|>analysis<|message|>Thinking about it<|e")
    assert first.reasoning_content == "Thinking about it"  # what may be a marker waits
    assert parser.feed("nd|>").reasoning_content == ""


@pytest.mark.parametrize("size", [1, 5, 1000])
@pytest.mark.parametrize("stop", ["", "<|call|>"])  # <|call|> is a stop token: the text ends before it
def test_a_message_to_a_function_is_a_tool_call(size: int, stop: str) -> None:
    parser = HarmonyParser(tools=True)
    out = streamed(parser, THOUGHT + CALL + stop, size)
    assert out.reasoning_content == "The user asks for 2 + 2. <Easy>." and out.content == ""
    [call] = out.tool_calls
    assert (call.index, call.name, json.loads(call.arguments)) == (0, "get_weather", {"city": "Paris"})
    assert call.id.startswith("call_")


def test_the_recipient_may_come_before_the_channel_and_a_preamble_is_content() -> None:
    text = ("<|channel|>commentary<|message|>Checking two cities.<|end|>"
            '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Rome"}<|call|>')
    out = HarmonyParser(tools=True).parse(text)
    assert out.content == "Checking two cities."
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("get_weather", '{"city": "Rome"}')]


@pytest.mark.parametrize("size", [1, 3])
def test_a_calls_arguments_stream_as_they_come(size: int) -> None:
    parser = HarmonyParser(tools=True)
    deltas = [parser.feed(CALL[at:at + size]) for at in range(0, len(CALL), size)] + [parser.finish()]
    first, *rest = [call for delta in deltas for call in delta.tool_calls]
    assert (first.index, first.name) == (0, "get_weather") and all(c.id is None and c.name is None for c in rest)
    assert len(rest) > 1 and "".join(c.arguments for c in [first, *rest]) == '{"city": "Paris"}'


def test_without_tools_or_when_cut_off_or_broken_a_call_is_text() -> None:
    assert HarmonyParser(tools=False).parse(CALL).content == '{"city": "Paris"}'
    parser = HarmonyParser(tools=True)
    cut = parser.parse(CALL.removesuffix('ris"}'))
    assert (cut.content, cut.tool_calls, cut.dropped, parser.failure) == ('{"city": "Pa', [], [0], "open")
    parser = HarmonyParser(tools=True)
    broken = parser.parse(CALL.replace('"Paris"', "Paris") + "<|call|>")
    assert (broken.content, broken.tool_calls, parser.failure) == ('{"city": Paris}', [], "broken")


def test_calls_past_max_calls_are_dropped() -> None:
    text = CALL + "<|end|>" + CALL.replace("Paris", "Rome") + "<|call|>"
    assert len(HarmonyParser(tools=True).parse(text).tool_calls) == 2
    [call] = HarmonyParser(tools=True, max_calls=1).parse(text).tool_calls
    assert "Paris" in call.arguments


def test_a_continued_answer_and_text_outside_the_format() -> None:
    assert HarmonyParser(tools=False, channel="final").parse(" three.").content == " three."
    assert HarmonyParser(tools=False).parse("no markers at all").content == "no markers at all"
    cut = HarmonyParser(tools=False).parse(THOUGHT + "<|start|>assistant<|chan")
    assert cut.content == "" and cut.reasoning_content  # a header cut short shows nothing
