"""Llama 3.1 to 3.3's calls: a reply that is a call's JSON, or <|python_tag|> and calls separated by ";";
unfinished and broken calls."""
import pytest
from replies import FUNCTIONS, as_text, calls, read, read_failing

from zhuzi.server.common.tool_formats.llama3 import Llama3Json

FMT = Llama3Json(FUNCTIONS)
PARIS = ("get_weather", {"city": "Paris"})


@pytest.mark.parametrize("text, expected", [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', [PARIS]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', [PARIS]),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "now", "parameters": {}}',
     [PARIS, ("now", {})]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "now", "parameters": {}}',
     [PARIS, ("now", {})]),
])
def test_bare_and_tagged_calls(text: str, expected: list) -> None:
    parsed = read(FMT, text)
    assert calls(parsed) == expected and parsed.content == ""


@pytest.mark.parametrize("text, failure", [
    ('{"name": "get_weather", "parameters": {"city": "Par', "open"),  # cut off
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}', "open"),  # cut off after the tag
    ('<|python_tag|>brave_search.call(query="weather")', "open"),  # a built-in tool's call
    ('{"city": "Paris"}', None),  # JSON that is no call
])
def test_unfinished_and_broken_calls_are_the_models_text(text: str, failure: str | None) -> None:
    assert as_text(FMT, text) == failure


def test_calls_before_the_one_cut_short_are_whole() -> None:
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "now", "parameters": {"'
    parsed, failure = read_failing(FMT, text)
    assert (calls(parsed), parsed.content, failure) == ([PARIS], '{"name": "now", "parameters": {"', "open")
