"""A reply as content parts (a thought, text, a tool call), the shape of Anthropic's messages (its content
blocks) and the Responses API's output items: Parts lays out the parser's pieces and says which part each
opened, grew or closed, so a streamed answer and a whole one agree by construction.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Literal

from zhuzi.server.common.parsers import ParsedText

PartKind = Literal["thinking", "text", "tool_use"]
_ITEM_PREFIXES = {"thinking": "rs", "text": "msg", "tool_use": "fc"}  # OpenAI's ids for these items


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class Part:
    kind: PartKind
    text: str = ""  # the thought or the text, or a call's arguments (JSON text)
    call_id: str | None = None  # a tool call's
    name: str | None = None  # the function a tool call calls
    id: str = ""  # the Responses API's item id
    call_index: int | None = None  # a tool call's index in the reply
    dropped: bool = False  # a tool call that turned out to be the model's text: whole answers leave it out

    def __post_init__(self) -> None:
        self.id = self.id or new_item_id(_ITEM_PREFIXES[self.kind])


@dataclass
class PartEvent:
    """What happened to the part at index: it started, grew by text, or stopped."""

    kind: Literal["start", "delta", "stop"]
    index: int
    part: Part
    text: str = ""


class Parts:
    def __init__(self) -> None:
        self.parts: list[Part] = []
        self.open = False

    def feed(self, piece: ParsedText) -> list[PartEvent]:
        """The events one parsed piece causes: its reasoning, then its content, then its tool calls (a call it
        drops, its start already out, is marked so first)."""
        for part in self.parts:
            part.dropped = part.dropped or part.call_index in piece.dropped
        events: list[PartEvent] = []
        if piece.reasoning_content:
            events += self._write("thinking", piece.reasoning_content)
        if piece.content:
            events += self._write("text", piece.content)
        for call in piece.tool_calls:
            if call.id is not None:  # a new call (its arguments stream in later pieces)
                events += self._start(Part("tool_use", call_id=call.id, name=call.name, call_index=call.index))
            if call.arguments:
                events += self._grow(call.arguments)
        return events

    def kept(self) -> list[tuple[int, Part]]:
        """The parts a whole answer holds, with their indexes: all but the dropped calls."""
        return [(index, part) for index, part in enumerate(self.parts) if not part.dropped]

    def close(self) -> list[PartEvent]:
        """The reply has ended: its last part stops."""
        if not self.open:
            return []
        self.open = False
        return [PartEvent("stop", len(self.parts) - 1, self.parts[-1])]

    def _write(self, kind: PartKind, text: str) -> list[PartEvent]:
        if self.open and self.parts[-1].kind == kind:
            return self._grow(text)
        return self._start(Part(kind)) + self._grow(text)

    def _start(self, part: Part) -> list[PartEvent]:
        events = self.close()
        self.parts.append(part)
        self.open = True
        return events + [PartEvent("start", len(self.parts) - 1, part)]

    def _grow(self, text: str) -> list[PartEvent]:
        part = self.parts[-1]
        part.text += text
        return [PartEvent("delta", len(self.parts) - 1, part, text)]
