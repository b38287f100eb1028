"""Mistral's calls: the JSON list of its v3 to v7 tokenizers, the name[ARGS]{...} of v11 on (with Mistral Small
3.2's [CALL_ID]); unfinished and broken calls."""
import pytest
from replies import FUNCTIONS, as_text, calls, read, read_failing

from zhuzi.server.common.tool_formats.mistral import Mistral

FMT = Mistral(FUNCTIONS)
TWO = [("get_weather", {"city": "Paris"}), ("now", {})]


@pytest.mark.parametrize("text", [
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now", "arguments": {}}]',
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]now[ARGS]{}',
    '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}[TOOL_CALLS]now[CALL_ID]f5g6h7i8j[ARGS]{}',
])
def test_calls_in_each_tokenizer_version(text: str) -> None:
    parsed = read(FMT, text)
    assert calls(parsed) == TWO and parsed.content == ""


def test_text_before_the_calls_is_content() -> None:
    parsed = read(FMT, 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}')
    assert (parsed.content, calls(parsed)) == ("Checking.", TWO[:1])


@pytest.mark.parametrize("text, failure", [
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Par', "open"),  # cut off
    ('[TOOL_CALLS]get_weather[ARGS]{"city": Paris}', "open"),  # broken JSON
    ('[TOOL_CALLS]get_weather{"city": "Paris"}', "open"),  # no [ARGS]
])
def test_unfinished_and_broken_calls_are_the_models_text(text: str, failure: str | None) -> None:
    assert as_text(FMT, text) == failure


def test_calls_before_the_one_cut_short_are_whole() -> None:
    parsed, failure = read_failing(FMT, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]now[ARGS]{"x')
    assert (calls(parsed), parsed.content, failure) == (TWO[:1], '[TOOL_CALLS]now[ARGS]{"x', "open")
