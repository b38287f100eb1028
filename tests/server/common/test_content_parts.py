"""A reply as content parts (Anthropic's messages and the Responses API's items): the events a stream is
written from add up to the parts of the whole reply, however the text was cut."""
from __future__ import annotations

from zhuzi.server.common.content_parts import Parts
from zhuzi.server.common.parsers import OutputParser

REPLY = ('<think>\nThe user wants the weather.\n</think>\n\nLet me look.\n<tool_call>\n{"name": "get_weather", '
         '"arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
         '</tool_call>')


def replay(pieces: list[str], forced: bool = False) -> tuple[Parts, list[tuple[str, int, str]]]:
    parser, parts, events = OutputParser(reasoning=True, tools=True, forced=forced), Parts(), []
    for piece in pieces:
        events += parts.feed(parser.feed(piece))
    events += parts.feed(parser.finish()) + parts.close()
    return parts, [(e.kind, e.index, e.text) for e in events]


def test_a_reply_is_a_thought_then_text_then_calls_each_started_grown_and_stopped() -> None:
    parts, events = replay([REPLY])
    assert [(p.kind, p.text) for p in parts.parts] == [
        ("thinking", "The user wants the weather."), ("text", "Let me look."),
        ("tool_use", '{"city": "Paris"}'), ("tool_use", "{}")]
    assert [p.name for p in parts.parts[2:]] == ["get_weather", "get_time"]
    assert len({p.id for p in parts.parts}) == 4 and parts.parts[0].id.startswith("rs_")
    starts = [index for kind, index, _ in events if kind == "start"]
    stops = [index for kind, index, _ in events if kind == "stop"]
    assert starts == stops == [0, 1, 2, 3]  # each part closes before the next opens
    assert events[-1] == ("stop", 3, "")


def test_streamed_a_character_at_a_time_the_events_add_up_to_the_same_parts() -> None:
    whole, _ = replay([REPLY])
    streamed, events = replay(list(REPLY))
    assert [(p.kind, p.text, p.name) for p in streamed.parts] == [(p.kind, p.text, p.name) for p in whole.parts]
    for index, part in enumerate(streamed.parts):
        assert "".join(text for kind, i, text in events if kind == "delta" and i == index) == part.text


def test_a_forced_call_streams_its_arguments_into_one_part() -> None:
    parts, events = replay(list('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
                           forced=True)
    (call,) = parts.parts
    assert (call.kind, call.name, call.text) == ("tool_use", "get_weather", '{"city": "Paris"}')
    assert len([e for e in events if e[0] == "delta"]) > 5
