"""What every tool-call format gives the chat path: how its calls are marked in a reply, how one section of calls
reads back as calls (whole, and as they stream: each call's name, then its arguments as JSON that only grows),
and the grammar that forces them (Lark, for llguidance). The parser (parsers.py) finds the sections; a format
reads them.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from zhuzi.sample.grammar import close_objects, json_options

# A marker in Lark: an added token as a token, or a string spelled with ordinary tokens (see tools.py).
Marker = Callable[[str], str]


@dataclass
class Call:
    """A call read back from the model's text."""

    name: str
    arguments: dict[str, Any]


@dataclass
class Partial:
    """A call of a section as far as it is written: its name, its arguments as JSON text so far (always the start
    of what they will be once the call is whole), and where its syntax starts and ends in the section (end: None
    while open)."""

    name: str
    arguments: str
    end: int | None = None
    start: int = 0


class ToolFormat:
    """One family's way of writing tool calls, made for one request's functions (their "function" objects).

    A reply holds sections of calls: each opens with `open` and ends with `close` (None: at the reply's end).
    `bare`: a reply may also open with a call's JSON object alone; `leads`: other (open, close) pairs a reply
    may open with (a fenced call). A section that does not read back as calls is the model's text.
    """

    name: ClassVar[str]  # --tool-call-parser NAME (vLLM's where it has one)
    open: ClassVar[str]
    close: ClassVar[str | None]
    bare: ClassVar[bool] = False
    leads: ClassVar[tuple[tuple[str, str], ...]] = ()
    separator: ClassVar[str] = ""  # what may come between two bare calls
    markers: ClassVar[tuple[str, ...]] = ()  # its markers that vocabularies hold as special tokens (TOOL_MARKERS)
    grammar_open: ClassVar[str | None] = None  # what forced calls open with ("": nothing), when not `open`

    def __init__(self, functions: list[dict[str, Any]], template: str = "") -> None:
        self.functions = {f["name"]: f for f in functions}

    @staticmethod
    def detect(template: str) -> bool:
        """Whether a chat template writes calls in this format."""
        return False

    def parse(self, body: str) -> list[Call] | None:
        """The calls of one section (the text between its markers), or None when it is not well-formed."""
        raise NotImplementedError

    def stream(self, body: str, scans: dict[int, ObjectScan]) -> list[Partial]:
        """The calls of a section written so far (body: its start), the last one possibly unfinished; what they
        hold grows with the body. A section that parses reads here as the same calls, arguments and all. scans:
        the section's, for formats that write JSON (json_calls)."""
        raise NotImplementedError

    def known(self, name: str) -> bool:
        """Whether a call's name is one of the request's functions (any name, when the format was given none)."""
        return not self.functions or name in self.functions

    def parse_bare(self, body: str) -> list[Call] | None:
        """A reply's unmarked JSON object, when it is exactly a call (a name and its arguments)."""
        return None

    def grammar(self, functions: list[dict[str, Any]], single: bool, marker: Marker) -> list[str]:
        """Lark rules that define `calls_rest`: what follows `open` in a reply of calls to these functions (one
        call when single)."""
        raise NotImplementedError

    def schema(self, name: str) -> dict[str, Any]:
        """The JSON schema of a function's arguments (its properties' types decide how some formats read them)."""
        function = self.functions.get(name) or {}
        return function.get("parameters") or {"type": "object"}


def arguments_schema(function: dict[str, Any]) -> dict[str, Any]:
    """The arguments a call to function may pass: its parameters (closed when it is strict)."""
    arguments = function.get("parameters") or {"type": "object"}
    return close_objects(arguments) if function.get("strict") else arguments


def json_rule(schema: dict[str, Any]) -> str:
    """A Lark rule's body: JSON valid under schema."""
    return f"%json {json.dumps({**schema, 'x-guidance': json_options()})}"


def repeated(call: str, separator: str, single: bool) -> str:
    """One call, or one or more with separator between them (Lark)."""
    return call if single else f"{call} ({separator} {call})*"


def json_call(text: str, arguments_key: str = "arguments") -> Call | None:
    """A call written as JSON, {"name": ..., "arguments": {...}} (or "parameters"); None when it is not one."""
    try:
        call = json.loads(text)
    except json.JSONDecodeError:
        return None
    return call_of(call, arguments_key)


def call_of(call: Any, arguments_key: str = "arguments") -> Call | None:
    """A decoded JSON call, or None when it is not exactly a name and its arguments."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get(arguments_key, call.get("arguments", call.get("parameters", {})))
    return Call(call["name"], arguments) if isinstance(arguments, dict) else None


def properties(schema: dict[str, Any]) -> list[tuple[str, dict[str, Any], bool]]:
    """A schema's properties in order: (name, schema, required)."""
    required = set(schema.get("required") or [])
    return [(key, value if isinstance(value, dict) else {}, key in required)
            for key, value in (schema.get("properties") or {}).items()]


def is_text(schema: dict[str, Any]) -> bool:
    """Whether a property's value is a plain string (written raw by formats that type values by schema)."""
    kind = schema.get("type")
    return kind == "string" or (isinstance(kind, list) and kind == ["string"])


def listed(required: list[str], optional: list[str], comma: str) -> str:
    """Lark: the required rules in order, then any of the optional ones in order, comma between them."""
    def tail(rest: list[str]) -> str:
        return "".join(f" ({comma} {o})?" for o in rest)

    if required:
        return f" {comma} ".join(required) + tail(optional)
    if not optional:
        return ""
    return "(" + " | ".join(f"{o}{tail(optional[k + 1:])}" for k, o in enumerate(optional)) + ")?"


def text_rule(schema: dict[str, Any]) -> str:
    """Lark for a string written raw (no quotes, no escapes), as its schema allows: one of its enum, or text of
    its length."""
    if isinstance(schema.get("enum"), list):
        return "(" + " | ".join(json.dumps(str(value)) for value in schema["enum"]) + ")"
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    return f"/(.|\\n){{{low},{high}}}/" if high is not None else f"/(.|\\n){{{low},}}/"


def json_name(text: str) -> str:
    """A name written inside a JSON string's quotes (escapes and all)."""
    try:
        return json.loads(f'"{text}"')
    except ValueError:
        return text


def json_header(before: str, arguments: str = "arguments") -> re.Pattern[str]:
    """A JSON call's start up to its arguments' object, {"name": "...", "arguments": (the key a regex), after
    before (a regex: what may come first, such as the end of the call before)."""
    return re.compile(before + r'(?P<call>\{)\s*"name"\s*:\s*"(?P<name>(?:[^"\\]|\\.)*)"\s*,\s*"(?:' + arguments
                      + r')"\s*:\s*(?=\{)')


def json_calls(body: str, header: re.Pattern[str], scans: dict[int, ObjectScan],
               name: Callable[[str], str] = json_name) -> list[Partial]:
    """Calls whose arguments are a JSON object, streamed as the model writes it: each call opens with header (its
    group "name" the name, as name() reads it; its group "call", where there is one, the call's own start, after
    the end of the call before), the arguments follow; a next call's header matches where they end. scans: the
    arguments' scans by where they start, kept between calls as the body grows (each character is scanned once)."""
    calls: list[Partial] = []
    at = 0
    while opening := header.match(body, at):
        end = scans.setdefault(opening.end(), ObjectScan(opening.end())).scan(body)
        start = opening.start("call") if "call" in header.groupindex else opening.start()
        calls.append(Partial(name(opening["name"]), body[opening.end():end or len(body)], end, start))
        if end is None:
            break
        at = end
    return calls


def keyed_arguments(pairs: list[tuple[str, Any]], closed: bool) -> str:
    """Arguments built from their values as each one is whole: a JSON object open until the call closes."""
    items = ", ".join(f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
                      for key, value in pairs)
    return "{" + items + ("}" if closed else "")


# What a scan stops at: a string's quote (in any of the notations), a bracket, a comma.
_JSON_STRUCTURE = re.compile(r'["{}\[\]]')
_STRUCTURE = re.compile(r'<\|"\|>|["\'{}\[\](),]')


def _string_end(text: str, at: int, quote: str) -> int | None:
    """Where a string that opened with quote just before `at` ends (after its closing quote); None while open.
    A one-character quote escaped by a backslash does not close it."""
    while (end := text.find(quote, at)) >= 0 and len(quote) == 1 and _escaped(text, end):
        at = end + 1
    return None if end < 0 else end + len(quote)


def value_end(text: str, at: int, quotes: tuple[str, ...] = ('"',)) -> int | None:
    """Where a value that starts at `at` ends: the index of the comma or closing bracket after it at its own
    depth; None while it is not written yet. quotes: what opens and closes a string in the notation."""
    depth = 0
    while token := _STRUCTURE.search(text, at):
        at = token.end()
        if token[0] in quotes:
            if (end := _string_end(text, at, token[0])) is None:
                return None
            at = end
        elif token[0] in "{[(":
            depth += 1
        elif token[0] in ",)]}" and depth == 0:
            return token.start()
        elif token[0] in ")]}":
            depth -= 1
    return None


def _escaped(text: str, at: int) -> bool:
    """Whether the character at `at` is escaped: an odd number of backslashes before it."""
    start = at
    while start > 0 and text[start - 1] == "\\":
        start -= 1
    return (at - start) % 2 == 1


@dataclass
class ObjectScan:
    """The scan of a JSON object that opens at `at` for its end, resumed as its text grows."""

    at: int  # the next character to scan
    depth: int = 0
    in_string: bool = False
    end: int | None = None  # after its closing brace, once scanned

    def scan(self, text: str) -> int | None:
        while self.end is None:
            if self.in_string:  # to its closing quote: one not escaped by an odd number of backslashes
                quote = text.find('"', self.at)
                self.at = len(text) if quote < 0 else quote + 1
                if quote < 0:
                    return None
                self.in_string = _escaped(text, quote)
            elif token := _JSON_STRUCTURE.search(text, self.at):
                self.at = token.end()
                if token[0] == '"':
                    self.in_string = True
                else:
                    self.depth += 1 if token[0] in "{[" else -1
                    self.end = self.at if self.depth == 0 else None
            else:
                self.at = len(text)
                return None
        return self.end
