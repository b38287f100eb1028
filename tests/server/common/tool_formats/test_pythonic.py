"""LFM2's pythonic calls: a Python list of calls between its markers; unfinished and broken calls."""
import pytest
from replies import FUNCTIONS, as_text, calls, read, read_failing

from zhuzi.server.common.tool_formats.pythonic import Pythonic

FMT = Pythonic(FUNCTIONS)


def test_a_list_of_calls_with_python_and_json_literals() -> None:
    text = ('<|tool_call_start|>[get_weather(city="Paris", days=3, metric=True, where={"lat": 48.9}), '
            "get_weather(city='Rome', metric=false), now()]<|tool_call_end|>Checking the weather.")
    parsed = read(FMT, text)
    assert parsed.content == "Checking the weather."
    assert calls(parsed) == [("get_weather", {"city": "Paris", "days": 3, "metric": True, "where": {"lat": 48.9}}),
                             ("get_weather", {"city": "Rome", "metric": False}), ("now", {})]


@pytest.mark.parametrize("text, failure", [
    ('<|tool_call_start|>[get_weather(city="Par', "open"),  # cut off
    ('<|tool_call_start|>[get_weather(city="Paris"]<|tool_call_end|>', "broken"),  # unbalanced
    ('<|tool_call_start|>[get_weather("Paris")]<|tool_call_end|>', "broken"),  # a positional argument
    ("<|tool_call_start|>[get_weather(city=os.getcwd())]<|tool_call_end|>", "broken"),  # no literal
])
def test_unfinished_and_broken_calls_are_the_models_text(text: str, failure: str | None) -> None:
    assert as_text(FMT, text) == failure


def test_calls_before_the_one_cut_short_are_whole() -> None:
    parsed, failure = read_failing(FMT, '<|tool_call_start|>[get_weather(city="Paris"), now(x=')
    assert (calls(parsed), parsed.content, failure) == ([("get_weather", {"city": "Paris"})], "now(x=", "open")


def test_brackets_quotes_and_backslashes_inside_strings_are_text() -> None:
    text = '<|tool_call_start|>[get_weather(city="P\\")]\\\\", where={"a": \'(\\\'\'})]<|tool_call_end|>'
    assert calls(read(FMT, text)) == [("get_weather", {"city": 'P")]\\', "where": {"a": "('"}})]
