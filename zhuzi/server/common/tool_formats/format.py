"""What every tool-call format gives the chat path: how its calls are marked in a reply, how one section of calls
reads back as calls, and the grammar that forces them (Lark, for llguidance). The parser (parsers.py) finds the
sections; a format reads them.
"""
from __future__ import annotations

import json
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
    streams_arguments: ClassVar[bool] = False  # a forced call's arguments stream as they come (OpenAI's pieces)
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
