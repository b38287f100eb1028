"""A reply as content blocks (a thought, text, a tool call), the shape of Anthropic's messages and the Responses
API's output items: Blocks lays out the parser's pieces and says which block each opened, grew or closed, so a
streamed answer and a whole one agree by construction.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Literal

from zhuzi.server.common.parsers import ParsedText

BlockKind = Literal["thinking", "text", "tool_use"]
_ITEM_PREFIXES = {"thinking": "rs", "text": "msg", "tool_use": "fc"}  # OpenAI's ids for these items


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class Block:
    kind: BlockKind
    text: str = ""  # the thought or the text, or a call's arguments (JSON text)
    call_id: str | None = None  # a tool call's
    name: str | None = None  # the function a tool call calls
    id: str = ""  # the Responses API's item id

    def __post_init__(self) -> None:
        self.id = self.id or new_item_id(_ITEM_PREFIXES[self.kind])


@dataclass
class BlockEvent:
    """What happened to the block at index: it started, grew by text, or stopped."""

    kind: Literal["start", "delta", "stop"]
    index: int
    block: Block
    text: str = ""


class Blocks:
    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self.open = False

    def feed(self, piece: ParsedText) -> list[BlockEvent]:
        """The events one parsed piece causes: its reasoning, then its content, then its tool calls."""
        events: list[BlockEvent] = []
        if piece.reasoning_content:
            events += self._write("thinking", piece.reasoning_content)
        if piece.content:
            events += self._write("text", piece.content)
        for call in piece.tool_calls:
            if call.id is not None:  # a new call (a forced one streams its arguments in later pieces)
                events += self._start(Block("tool_use", call_id=call.id, name=call.name))
            if call.arguments:
                events += self._grow(call.arguments)
        return events

    def close(self) -> list[BlockEvent]:
        """The reply has ended: its last block stops."""
        if not self.open:
            return []
        self.open = False
        return [BlockEvent("stop", len(self.blocks) - 1, self.blocks[-1])]

    def _write(self, kind: BlockKind, text: str) -> list[BlockEvent]:
        if self.open and self.blocks[-1].kind == kind:
            return self._grow(text)
        return self._start(Block(kind)) + self._grow(text)

    def _start(self, block: Block) -> list[BlockEvent]:
        events = self.close()
        self.blocks.append(block)
        self.open = True
        return events + [BlockEvent("start", len(self.blocks) - 1, block)]

    def _grow(self, text: str) -> list[BlockEvent]:
        block = self.blocks[-1]
        block.text += text
        return [BlockEvent("delta", len(self.blocks) - 1, block, text)]
