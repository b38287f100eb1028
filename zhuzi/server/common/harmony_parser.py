"""The step after detokenizing for a model that speaks gpt-oss's harmony format: its reply (markers kept in the
text) split by channel, incrementally, so a streamed and a whole reply agree however the text was chunked. The
analysis channel is reasoning, the final channel (and commentary meant for the user, a preamble) content, and a
message to functions.NAME a tool call, streamed as OpenAI's are (its id and name, then its arguments as they come)
until its message ends (<|call|> stops the reply, so that is usually the reply's end); a call whose arguments are
no JSON object then is the model's text, as parsers.py's are.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import Enum

from zhuzi.server.common.parsers import CallFailure, ParsedText, ToolCall, new_call_id, partial_tag_len

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ["<|end|>", "<|call|>", "<|return|>"]  # what closes a message
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
FUNCTION_PREFIX = "functions."


class Place(Enum):
    HEADER = "header"  # after <|start|> (or at the reply's start): role, channel, recipient, up to <|message|>
    BODY = "body"  # a message's text
    BETWEEN = "between"  # after a message, before the next <|start|>


@dataclass
class Header:
    channel: str
    recipient: str | None = None

    @classmethod
    def parse(cls, text: str) -> Header:
        channel, recipient = _CHANNEL.search(text), _RECIPIENT.search(text)
        return cls(channel[1] if channel else "final", recipient[1] if recipient else None)


class HarmonyParser:
    """Incremental parser for one harmony reply.

    tools: a message to functions.NAME is a call (only when the request offered tools).
    channel: the channel of a message the prompt opened and the reply continues (continue_final_message).
    max_calls: calls after this many are dropped (parallel_tool_calls=false).
    failure: how the reply's last failed call failed (None: none did).
    """

    def __init__(self, tools: bool, channel: str | None = None, max_calls: int | None = None) -> None:
        self.tools, self.max_calls = tools, max_calls
        self.place = Place.HEADER if channel is None else Place.BODY
        self.header = Header(channel or "final")
        self.buffer = ""  # text not yet classified
        self.arguments = ""  # the open call's
        self.sent: str | None = None  # the open call's arguments that went out (None: not even its start)
        self.calls = 0
        self.failure: CallFailure | None = None
        self.thought = False  # whether the reply wrote on the analysis channel

    def feed(self, text: str) -> ParsedText:
        self.buffer += text
        out = ParsedText()
        while self._step(out):
            pass
        return out

    def finish(self) -> ParsedText:
        """Flush at the end of the reply: an open message keeps its channel; an open call whose arguments are
        whole JSON is a call (<|call|> is a stop token: the reply ends right there), else the user sees them; a
        header cut short is dropped, and text that never reached harmony's markers is content."""
        out = ParsedText()
        rest, self.buffer = self.buffer, ""
        if self.place is Place.BODY:
            self._write(rest, out)
            if self._calling:
                self._close_call(out, closed=False)
        elif "<|" not in rest:
            out.content += rest
        return out

    def parse(self, text: str) -> ParsedText:
        """A whole reply at once."""
        out = self.feed(text)
        out.extend(self.finish())
        return out

    # ------------------------------------------------------------ internals

    @property
    def _calling(self) -> bool:
        recipient = self.header.recipient
        return self.tools and recipient is not None and recipient.startswith(FUNCTION_PREFIX)

    def _step(self, out: ParsedText) -> bool:
        """Consume what can be decided now; True when the place changed (so step again)."""
        if self.place is Place.HEADER:
            if (at := self.buffer.find(MESSAGE)) < 0:
                return False
            self.header = Header.parse(self.buffer[:at])
            self.buffer, self.place = self.buffer[at + len(MESSAGE):], Place.BODY
            return True
        if self.place is Place.BODY:
            ends = [(at, end) for end in ENDS if (at := self.buffer.find(end)) >= 0]
            if not ends:
                self._write(self._take_decided(ENDS), out)
                return False
            at, end = min(ends)
            self._write(self.buffer[:at], out)
            if self._calling:
                self._close_call(out, closed=True)
            self.buffer, self.place = self.buffer[at + len(end):], Place.BETWEEN
            return True
        if (at := self.buffer.find(START)) < 0:  # text outside any message: the user sees it as written
            out.content += self._take_decided([START])
            return False
        out.content += self.buffer[:at]
        self.buffer, self.place = self.buffer[at + len(START):], Place.HEADER
        return True

    def _write(self, text: str, out: ParsedText) -> None:
        """A message's text, where its channel sends it."""
        if self._calling:
            self.arguments += text
            self._stream(out)
        elif self.header.channel == "analysis":
            self.thought = True
            out.reasoning_content += text
        else:
            out.content += text

    def _stream(self, out: ParsedText) -> None:
        """The open call's news: its id and name, then its arguments (whitespace that may end them held back)."""
        if self.max_calls is not None and self.calls >= self.max_calls:
            return
        if self.sent is None:
            assert self.header.recipient is not None
            out.add_call(ToolCall(self.calls, new_call_id(), self.header.recipient.removeprefix(FUNCTION_PREFIX), ""))
            self.sent = ""
        if piece := self.arguments.strip()[len(self.sent):]:
            out.add_call(ToolCall(self.calls, None, None, piece))
            self.sent += piece

    def _close_call(self, out: ParsedText, closed: bool) -> None:
        """The call's message ended (closed: by its marker, else with the reply): a call, or the model's text."""
        arguments, self.arguments = self.arguments.strip(), ""
        sent, self.sent = self.sent, None
        if _is_object(arguments or "{}"):
            if sent is not None and not arguments:  # no arguments: an empty object
                out.add_call(ToolCall(self.calls, None, None, "{}"))
            self.calls += 1
            return
        self.failure = "broken" if closed else "open"
        if sent is not None:
            out.drop([self.calls])
            self.calls += 1  # its index went out
        out.content += arguments

    def _take_decided(self, markers: list[str]) -> str:
        """Remove and return the buffer's head that can no longer start one of the markers."""
        end = len(self.buffer) - partial_tag_len(self.buffer, markers)
        decided, self.buffer = self.buffer[:end], self.buffer[end:]
        return decided


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
