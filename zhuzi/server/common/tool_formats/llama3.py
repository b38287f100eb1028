"""Llama 3.1 to 3.3's format for custom tools: a reply that is a call's JSON, {"name": ..., "parameters": {...}},
alone or after <|python_tag|>; calls in one reply are separated by ";". The calls run to the reply's end."""
from __future__ import annotations

import json
from typing import Any

from zhuzi.server.common.tool_formats.format import (
    Call,
    Marker,
    ObjectScan,
    Partial,
    ToolFormat,
    call_of,
    json_calls,
    json_header,
    json_rule,
    repeated,
)
from zhuzi.server.common.tool_formats.hermes import call_schema

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = '"; "'  # in Lark
# A call's start up to its arguments' object (after the end of the call before it and ";").
_HEADER = json_header(r"(?:\s*\}\s*;)?\s*", "parameters|arguments")


class Llama3Json(ToolFormat):
    name = "llama3_json"
    open, close = PYTHON_TAG, None
    bare = True
    separator = ";"
    markers = (PYTHON_TAG,)
    grammar_open = ""  # forced calls are written bare, as the template teaches

    @staticmethod
    def detect(template: str) -> bool:
        return PYTHON_TAG in template

    def parse(self, body: str) -> list[Call] | None:
        decoder, calls, at = json.JSONDecoder(), [], 0
        while True:
            while at < len(body) and body[at].isspace():
                at += 1
            try:
                value, at = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return None
            if (call := call_of(value, "parameters")) is None:
                return None
            calls.append(call)
            rest = body[at:].lstrip()
            if not rest:
                return calls
            if not rest.startswith(self.separator):
                return None
            at = len(body) - len(rest) + len(self.separator)

    def stream(self, body: str, scans: dict[int, ObjectScan]) -> list[Partial]:
        return json_calls(body, _HEADER, scans)

    def parse_bare(self, body: str) -> list[Call] | None:
        try:
            keys = set(json.loads(body))
        except (json.JSONDecodeError, TypeError):
            return None
        return self.parse(body) if keys in ({"name", "parameters"}, {"name", "arguments"}) else None

    def grammar(self, functions: list[dict[str, Any]], single: bool, marker: Marker) -> list[str]:
        return [f"call: {json_rule(call_schema(functions, 'parameters'))}",
                f"calls_rest: {repeated('call', SEPARATOR, single)}"]
