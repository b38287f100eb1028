"""A reply as content blocks (Anthropic's messages and the Responses API's items): the events a stream is
written from add up to the blocks of the whole reply, however the text was cut."""
from __future__ import annotations

from zhuzi.server.common.content_blocks import Blocks
from zhuzi.server.common.parsers import OutputParser

REPLY = ('<think>\nThe user wants the weather.\n</think>\n\nLet me look.\n<tool_call>\n{"name": "get_weather", '
         '"arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
         '</tool_call>')


def replay(pieces: list[str], forced: bool = False) -> tuple[Blocks, list[tuple[str, int, str]]]:
    parser, blocks, events = OutputParser(reasoning=True, tools=True, forced=forced), Blocks(), []
    for piece in pieces:
        events += blocks.feed(parser.feed(piece))
    events += blocks.feed(parser.finish()) + blocks.close()
    return blocks, [(e.kind, e.index, e.text) for e in events]


def test_a_reply_is_a_thought_then_text_then_calls_each_started_grown_and_stopped() -> None:
    blocks, events = replay([REPLY])
    assert [(b.kind, b.text) for b in blocks.blocks] == [
        ("thinking", "The user wants the weather."), ("text", "Let me look."),
        ("tool_use", '{"city": "Paris"}'), ("tool_use", "{}")]
    assert [b.name for b in blocks.blocks[2:]] == ["get_weather", "get_time"]
    assert len({b.id for b in blocks.blocks}) == 4 and blocks.blocks[0].id.startswith("rs_")
    starts = [index for kind, index, _ in events if kind == "start"]
    stops = [index for kind, index, _ in events if kind == "stop"]
    assert starts == stops == [0, 1, 2, 3]  # each block closes before the next opens
    assert events[-1] == ("stop", 3, "")


def test_streamed_a_character_at_a_time_the_events_add_up_to_the_same_blocks() -> None:
    whole, _ = replay([REPLY])
    streamed, events = replay(list(REPLY))
    assert [(b.kind, b.text, b.name) for b in streamed.blocks] == [(b.kind, b.text, b.name) for b in whole.blocks]
    for index, block in enumerate(streamed.blocks):
        assert "".join(text for kind, i, text in events if kind == "delta" and i == index) == block.text


def test_a_forced_call_streams_its_arguments_into_one_block() -> None:
    blocks, events = replay(list('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
                            forced=True)
    (call,) = blocks.blocks
    assert (call.kind, call.name, call.text) == ("tool_use", "get_weather", '{"city": "Paris"}')
    assert len([e for e in events if e[0] == "delta"]) > 5
