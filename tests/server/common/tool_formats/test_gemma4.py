"""Gemma 4's calls in its own notation, after its thought channel; unfinished and broken calls."""
import pytest
from replies import FUNCTIONS, as_text, calls, read

from zhuzi.server.common.tool_formats.gemma4 import Gemma4

FMT = Gemma4(FUNCTIONS)


def test_calls_after_a_thought_in_gemmas_notation() -> None:
    text = ('<|channel>thought\nTwo lookups.<channel|><|tool_call>call:get_weather{city:<|"|>Paris, "FR"<|"|>,'
            'days:3,metric:true,where:{lat:48.9,name:<|"|>Île<|"|>}}<tool_call|><|tool_call>call:now{}<tool_call|>')
    parsed = read(FMT, text, reasoning=True)
    assert (parsed.reasoning_content, parsed.content) == ("Two lookups.", "")
    assert calls(parsed) == [("get_weather", {"city": 'Paris, "FR"', "days": 3, "metric": True,
                                              "where": {"lat": 48.9, "name": "Île"}}), ("now", {})]


@pytest.mark.parametrize("text, failure", [
    ('<|tool_call>call:get_weather{city:<|"|>Par', "open"),  # cut off
    ('<|tool_call>call:get_weather{city:<|"|>Paris}<tool_call|>', "broken"),  # an unclosed string
    ("<|tool_call>get_weather{}<tool_call|>", "broken"),  # no call:
    ("<|tool_call>call:get_time{}<tool_call|>", "broken"),  # no function of the request
])
def test_unfinished_and_broken_calls_are_the_models_text(text: str, failure: str | None) -> None:
    assert as_text(FMT, text) == failure
