"""The step after detokenizing: a model's text split into reasoning (its thought tags: <think>, or Gemma 4's
thought channel), content and tool calls (the sections its tool format marks, tool_formats/) by one incremental
state machine, so a streamed and a whole reply agree however the text was chunked. Text that may still become a
marker is held back; a call streams as OpenAI's do (its id and name once the name is whole, then its arguments as
they come), and a section that does not read back as calls is the model's text: a call whose start went out is
then dropped, and the parser says how the call failed (cut off, or broken).
"""
from __future__ import annotations

import itertools
import json
import uuid
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Literal

from zhuzi.server.common.tool_formats import ToolFormat
from zhuzi.server.common.tool_formats.format import Call, ObjectScan, Partial
from zhuzi.server.common.tool_formats.hermes import Hermes
from zhuzi.tokenizer import THOUGHT_TAGS, ThoughtTags

# How a call failed: the reply ended inside it ("open"), or it closed but does not read back as calls ("broken").
CallFailure = Literal["open", "broken"]


@dataclass
class ToolCall:
    """A call, or one piece of a call as it streams: the first piece carries the call's id and name,
    the later ones more of its arguments."""

    index: int  # which call of the reply
    id: str | None
    name: str | None
    arguments: str  # a JSON object as text, as OpenAI sends it (or the next piece of it)


@dataclass
class ParsedText:
    """What one piece of model text turned out to be (a delta, or a whole reply)."""

    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)  # calls whose start went out that are the model's text after all

    def extend(self, other: ParsedText) -> None:
        self.content += other.content
        self.reasoning_content += other.reasoning_content
        for call in other.tool_calls:
            self.add_call(call)
        self.drop(other.dropped)

    def drop(self, indexes: list[int]) -> None:
        """Calls that turned out to be the model's text: no reply keeps them (a delta, pieces of them it holds)."""
        self.tool_calls = [call for call in self.tool_calls if call.index not in indexes]
        self.dropped += indexes

    def add_call(self, call: ToolCall) -> None:
        if self.tool_calls and self.tool_calls[-1].index == call.index:  # a later piece of the same call
            self.tool_calls[-1].arguments += call.arguments
        else:
            self.tool_calls.append(replace(call))  # a copy: a piece already sent stays as it was


class Mode(Enum):
    CONTENT = "content"
    REASONING = "reasoning"
    TOOL_CALL = "tool_call"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def opened_thought(prompt: str, tags: ThoughtTags = THOUGHT_TAGS[0]) -> str:
    """The thought's opening ("<think>") when the template already opened the model's thought (DeepSeek-R1
    style templates end the prompt with it), else "": the parser's prefill for a fresh reply."""
    return tags.opening if prompt.rstrip().endswith(tags.opening) else ""


def partial_tag_len(text: str, tags: list[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of one of the tags."""
    for length in range(min(len(text), max((len(t) for t in tags), default=0) - 1), 0, -1):
        if any(tag.startswith(text[-length:]) for tag in tags):
            return length
    return 0


class OutputParser:
    """Incremental parser for one completion's text.

    reasoning: recognise a leading <think>...</think> block (thinking models; tags: a model's own).
    tools: recognise tool-call sections (only when the request offered tools), as fmt writes them (Hermes'
    by default).
    prefill: text the prompt already holds of this reply (a template's trailing
    "<think>", or the assistant message a client asks to continue): it sets
    the starting state without being emitted again.
    forced: a grammar writes the calls (never after a prefill): a closing marker inside a call's open arguments
    is their text.
    max_calls: calls after this many are dropped (parallel_tool_calls=false).
    failure: how the reply's last failed call failed (None: none did).
    """

    def __init__(self, reasoning: bool, tools: bool, prefill: str = "", forced: bool = False,
                 max_calls: int | None = None, tags: ThoughtTags = THOUGHT_TAGS[0],
                 fmt: ToolFormat | None = None) -> None:
        self.fmt = fmt or Hermes([])
        self.tools, self.max_calls, self.tags = tools, max_calls, tags
        self.forced = forced
        self.calls = 0  # calls read so far (the open section's are numbered from here)
        self.sent: list[str] = []  # per call of the open section whose start went out: its arguments so far
        self.failure: CallFailure | None = None
        self.mode = Mode.CONTENT
        self.thought = False  # whether the reply opened a thought (or the prompt opened it)
        self.think_may_open = reasoning  # a thought opens only before any content
        self.bare_may_open = tools  # so does an unmarked call (a bare JSON object, a fenced one)
        self.bare: ObjectScan | None = None  # an open unmarked call's: it ends where its JSON object closes
        self.scans: dict[int, ObjectScan] = {}  # the open section's JSON scans (ToolFormat.stream)
        self.section = (self.fmt.open, self.fmt.close)  # the open section's markers
        self.strip_leading = False  # drop whitespace right after a closing tag
        self.buffer = ""  # text not yet classified
        self.tool_text = ""  # the body of the open section so far
        self.tool_lead = ""  # what came before its opening marker and is given back if it is no call
        self.hidden = 0  # characters of an open call that the prefill wrote: the client has them
        if prefill:
            self.feed(prefill)
            if self.mode is Mode.TOOL_CALL:
                self.hidden = len(self.tool_lead + self.section[0] + self.tool_text + self.buffer)
                self.sent = []  # the client has the call's text, not the call: it streams from its start
            else:
                self.buffer = ""  # the client already has the prefill: never emit it

    def feed(self, text: str) -> ParsedText:
        self.buffer += text
        out = ParsedText()
        while self._step(out):
            pass
        return out

    def finish(self) -> ParsedText:
        """Flush at the end of the reply: a thought cut off stays reasoning; an unclosed section whose calls are
        complete is still calls (models often stop right after them, and some formats' calls run to the end)."""
        out = ParsedText()
        rest = self.buffer.lstrip() if self.strip_leading else self.buffer
        self.buffer = ""
        if self.mode is Mode.REASONING:
            out.reasoning_content += rest
        elif self.mode is Mode.TOOL_CALL:
            self.tool_text += rest
            self._close_tool_call(self.tool_text, out, closed=False)
        else:
            out.content += rest
        return out

    def parse(self, text: str) -> ParsedText:
        """A whole reply at once."""
        out = self.feed(text)
        out.extend(self.finish())
        return out

    # ------------------------------------------------------------ internals

    def _step(self, out: ParsedText) -> bool:
        """Consume what can be decided now; True when the mode changed (so step again)."""
        if self.strip_leading:
            self.buffer = self.buffer.lstrip()
            if not self.buffer:
                return False
            self.strip_leading = False
        if self.mode is Mode.CONTENT:
            return self._step_content(out)
        if self.mode is Mode.REASONING:
            return self._step_reasoning(out)
        return self._step_tool_call(out)

    def _step_content(self, out: ParsedText) -> bool:
        if self.think_may_open:
            stripped, opening = self.buffer.lstrip(), self.tags.opening
            if stripped.startswith(opening):
                self._switch(Mode.REASONING, stripped[len(opening):])
                self.think_may_open, self.strip_leading, self.thought = False, True, True
                return True
            if opening.startswith(stripped):
                return False  # only whitespace or the start of "<think>" so far
            self.think_may_open = False
        if self.bare_may_open and (opened := self._open_bare()) is not None:
            return opened
        open_ = self.fmt.open
        if self.tools and (at := self.buffer.find(open_)) >= 0:
            before = self.buffer[:at]
            out.content += before.rstrip()
            self.section = (open_, self.fmt.close)
            self._switch(Mode.TOOL_CALL, self.buffer[at + len(open_):])
            self.tool_lead = before[len(before.rstrip()):]
            return True
        tags = [open_] if self.tools else []
        out.content += self._take_decided(tags, hold_whitespace=self.tools)
        return False

    def _open_bare(self) -> bool | None:
        """At the reply's start, or after an unmarked call: True when an unmarked call opened (a bare JSON object,
        or one of the format's leads), False while the text may still open one, None when it does not."""
        stripped = self.buffer.lstrip()
        if self.calls and self.fmt.separator and stripped.startswith(self.fmt.separator):
            stripped = stripped[len(self.fmt.separator):].lstrip()
        openings = (["{"] if self.fmt.bare else []) + [opening for opening, _ in self.fmt.leads]
        if not stripped or any(len(stripped) < len(o) and o.startswith(stripped) for o in openings):
            return False
        self.bare_may_open = False
        lead = self.buffer[:len(self.buffer) - len(stripped)]
        if self.fmt.bare and stripped.startswith("{"):
            self.bare = ObjectScan(0)
            self._switch(Mode.TOOL_CALL, stripped)
            self.tool_lead = lead
            return True
        for opening, closing in self.fmt.leads:
            if stripped.startswith(opening):
                self.section = (opening, closing)
                self._switch(Mode.TOOL_CALL, stripped[len(opening):])
                self.tool_lead = lead
                return True
        return None

    def _step_reasoning(self, out: ParsedText) -> bool:
        close = self.tags.close
        if (at := self.buffer.find(close)) >= 0:
            out.reasoning_content += self.buffer[:at].rstrip()
            self._switch(Mode.CONTENT, self.buffer[at + len(close):])
            self.strip_leading = True
            return True
        out.reasoning_content += self._take_decided([close], hold_whitespace=True)
        return False

    def _step_tool_call(self, out: ParsedText) -> bool:
        if self.bare is not None:  # an unmarked call ends where its JSON object closes
            self.tool_text, self.buffer = self.tool_text + self.buffer, ""
            if (end := self.bare.scan(self.tool_text)) is None:
                self._stream(out)
                return False
            body, rest = self.tool_text[:end], self.tool_text[end:]
            self._switch(Mode.CONTENT, rest)
            self._close_tool_call(body, out, closed=True)
            return True
        close = self.section[1]
        if close is None:  # the section runs to the reply's end
            self.tool_text, self.buffer = self.tool_text + self.buffer, ""
            self._stream(out)
            return False
        if self.forced:  # a closing marker inside a call's open arguments is their text (the grammar wrote it)
            text = self.tool_text + self.buffer
            partials = self._partials(text)
            if partials and partials[-1].end is None:
                self.tool_text, self.buffer = text, ""
                self._stream(out, partials)
                return False
            at = partials[-1].end if partials else len(self.tool_text)
            self.tool_text, self.buffer = text[:at], text[at:]
        if (at := self.buffer.find(close)) >= 0:
            body, rest = self.tool_text + self.buffer[:at], self.buffer[at + len(close):]
            self._switch(Mode.CONTENT, rest)
            self._close_tool_call(body, out, closed=True)
            return True
        self.tool_text += self._take_decided([close], hold_whitespace=False)
        self._stream(out)
        return False

    def _stream(self, out: ParsedText, partials: list[Partial] | None = None) -> None:
        """The open section's news: each call's id and name once its name is whole, then its arguments as they
        grow (not a call past max_calls, nor one to a function the request does not have)."""
        for j, partial in enumerate(self._partials(self.tool_text) if partials is None else partials):
            index = self.calls + j
            if not self.fmt.known(partial.name) or (self.max_calls is not None and index >= self.max_calls):
                return
            if j == len(self.sent):
                out.add_call(ToolCall(index, new_call_id(), partial.name, ""))
                self.sent.append("")
            if piece := partial.arguments[len(self.sent[j]):]:
                out.add_call(ToolCall(index, None, None, piece))
                self.sent[j] = partial.arguments

    def _take_decided(self, tags: list[str], hold_whitespace: bool) -> str:
        """Remove and return the buffer's head that can no longer start one of the tags."""
        end = len(self.buffer) - partial_tag_len(self.buffer, tags)
        decided = self.buffer[:end]
        if hold_whitespace:
            decided = decided.rstrip()
        self.buffer = self.buffer[len(decided):]
        return decided

    def _switch(self, mode: Mode, rest: str) -> None:
        self.mode, self.buffer, self.tool_text, self.scans = mode, rest, "", {}

    def _partials(self, body: str) -> list[Partial]:
        """The open section's calls so far (body: the section's text, up to some point)."""
        return self.fmt.stream(body, self.scans)

    def _close_tool_call(self, body: str, out: ParsedText, closed: bool) -> None:
        """A section has ended (closed: by its marker, else with the reply): its calls, or the model's text."""
        self.mode, hidden, self.hidden = Mode.CONTENT, self.hidden, 0
        bare, self.bare = self.bare is not None, None
        calls = self.fmt.parse_bare(body) if bare else self.fmt.parse(body)
        arguments = self._arguments(body, calls)
        if calls is None or arguments is None:
            self._fail(body, out, closed, bare, hidden)
            return
        self._stream(out, [Partial(call.name, text, 0) for call, text in zip(calls, arguments)])
        self.sent, self.calls = [], self.calls + len(calls)
        self.strip_leading, self.bare_may_open = True, bare

    def _fail(self, body: str, out: ParsedText, closed: bool, bare: bool, hidden: int) -> None:
        """A section that does not read back as calls: the calls in it that a later one followed are whole (a
        section of several, cut short in its last), the text from the first other one on is the model's, and a
        call whose start went out is dropped."""
        partials = self._partials(body)
        kept = list(itertools.takewhile(lambda p: self.fmt.known(p.name) and isinstance(_json(p.arguments), dict),
                                        partials[:-1]))
        if self.forced or (self.section[0] == self.fmt.open and not bare) or any(
                self.fmt.known(p.name) for p in partials):
            self.failure = "broken" if closed else "open"  # it was a call (not JSON, nor a fence, of text)
        self._stream(out, kept)
        out.drop(list(range(self.calls + len(kept), self.calls + len(self.sent))))
        self.calls += max(len(kept), len(self.sent))  # the dropped calls' indexes went out
        self.sent = []
        opening, closing = ("", None) if bare else self.section
        text = self.tool_lead + opening + body + ((closing or "") if closed else "")
        start = len(self.tool_lead + opening) + partials[len(kept)].start if kept else 0
        out.content += text[max(hidden, start):]

    def _arguments(self, body: str, calls: list[Call] | None) -> list[str] | None:
        """The calls' arguments as JSON text: as they streamed (the model's own text, for JSON formats), or, for
        calls written in an order the stream cannot follow (none of which went out), as JSON of their values.
        None when the calls are not all whole, or call a function the request does not have."""
        if calls is None or not all(self.fmt.known(call.name) for call in calls):
            return None
        partials = self._partials(body)
        if [p.name for p in partials] == [c.name for c in calls] and all(
                _json(p.arguments) == c.arguments for p, c in zip(partials, calls)):
            return [p.arguments for p in partials]
        return None if self.sent else [json.dumps(call.arguments, ensure_ascii=False) for call in calls]


def _json(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None
