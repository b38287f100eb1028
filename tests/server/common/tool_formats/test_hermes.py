"""Hermes' format as Qwen2.5 and Qwen2.5-Coder write it: tagged, fenced, bare; unfinished and broken calls."""
import json

import pytest
from replies import FUNCTIONS, as_text, calls, read

from zhuzi.server.common.tool_formats import Hermes

FMT = Hermes(FUNCTIONS)
PARIS = ("get_weather", {"city": "Paris"})


def test_tagged_calls_after_text_come_in_order() -> None:
    text = ('Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
    parsed = read(FMT, text)
    assert calls(parsed) == [PARIS, ("now", {})] and parsed.content == "Let me check both."


@pytest.mark.parametrize("text", [
    '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',  # Qwen2.5-Coder-1.5B
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',  # Qwen2.5-Coder-0.5B
    '<tool_call>\n```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```\n</tool_call>',
])
def test_fenced_and_bare_calls_are_calls(text: str) -> None:
    parsed = read(FMT, text)
    assert calls(parsed) == [PARIS] and parsed.content == ""


@pytest.mark.parametrize("text, failure", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>', "broken"),  # broken JSON
    ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', "open"),  # cut off
    ('```json\n{"name": "get_weather", "arguments": {"city": "Paris"}\n```', "broken"),  # a fenced call's broken JSON
    ('```json\n{"city": "Paris"}\n```', None),  # fenced JSON that is no call
    ('```python\nprint(1)\n```', None),
    ('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "broken"),  # no function of the request
])
def test_unfinished_and_broken_calls_are_the_models_text(text: str, failure: str | None) -> None:
    assert as_text(FMT, text) == failure


def test_brackets_quotes_and_backslashes_inside_strings_are_text() -> None:
    arguments = {"city": 'P"}]{\\', "where": {"note": "\\\\\"x"}}
    text = f'<tool_call>\n{json.dumps({"name": "get_weather", "arguments": arguments})}\n</tool_call>'
    assert calls(read(FMT, text)) == [("get_weather", arguments)]
