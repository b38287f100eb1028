"""Qwen3-Coder's and Qwen3.5's XML calls, their values typed by the tool's schema; unfinished and broken calls."""
import pytest
from replies import FUNCTIONS, as_text, calls, read

from zhuzi.server.common.tool_formats.qwen3_coder import Qwen3Coder

FMT = Qwen3Coder(FUNCTIONS)


def test_parameters_are_typed_by_the_schema() -> None:
    text = ("I'll look it up.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\nNY\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=where>\n"
            '{"lat": 40.7}\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=now>\n</function>\n'
            "</tool_call>")
    parsed = read(FMT, text)
    assert parsed.content == "I'll look it up."
    assert calls(parsed) == [("get_weather", {"city": "New York\nNY", "days": 3, "metric": True,
                                              "where": {"lat": 40.7}}), ("now", {})]


def test_a_string_that_looks_like_json_stays_a_string() -> None:
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n</function>\n</tool_call>"
    assert calls(read(FMT, text)) == [("get_weather", {"city": "42"})]


@pytest.mark.parametrize("text, failure", [
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n", "open"),  # cut off
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</tool_call>", "broken"),  # no </function>
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "broken"),  # another format
    ("<tool_call>\n<function=get_time>\n</function>\n</tool_call>", "broken"),  # no function of the request
])
def test_unfinished_and_broken_calls_are_the_models_text(text: str, failure: str | None) -> None:
    assert as_text(FMT, text) == failure
