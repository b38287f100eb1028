"""Mistral's format: [TOOL_CALLS] then a JSON list of calls (v3 to v7 tokenizers), or, from the v11 tokenizer on
(its templates write [ARGS]), [TOOL_CALLS]name[ARGS]{...} per call (Mistral Small 3.2 puts [CALL_ID]id before
[ARGS]). The calls run to the reply's end."""
from __future__ import annotations

import json
import re
from typing import Any

from zhuzi.server.common.tool_formats.format import (
    Call,
    Marker,
    ObjectScan,
    Partial,
    ToolFormat,
    arguments_schema,
    call_of,
    json_calls,
    json_header,
    json_rule,
)
from zhuzi.server.common.tool_formats.hermes import call_schema

OPEN, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAMED = re.compile(r"\s*([^\[\]\s]+)(?:\[CALL_ID\][^\[]*)?\[ARGS\](.*)", re.DOTALL)
# A call's start up to its arguments: name[ARGS] (after [TOOL_CALLS] from the second call on), or a JSON list's item.
_NAMED_HEADER = re.compile(r"(?:\[TOOL_CALLS\])?\s*(?P<name>[^\[\]\s]+)(?:\[CALL_ID\][^\[]*)?\[ARGS\]\s*(?=\{)")
_ITEM_HEADER = json_header(r"(?:\s*\})?\s*[\[,]\s*")


class Mistral(ToolFormat):
    name = "mistral"
    open, close = OPEN, None
    markers = (OPEN, ARGS, "[CALL_ID]")

    def __init__(self, functions: list[dict[str, Any]], template: str = "") -> None:
        super().__init__(functions, template)
        self.named = ARGS in template  # v11 on: name[ARGS]{...}

    @staticmethod
    def detect(template: str) -> bool:
        return OPEN in template

    def parse(self, body: str) -> list[Call] | None:
        if body.lstrip().startswith("["):  # a JSON list
            try:
                calls = json.loads(body)
            except json.JSONDecodeError:
                return None
            read = [call_of(c) for c in calls] if isinstance(calls, list) else [None]
            return read if read and all(read) else None  # type: ignore[return-value]
        read = []
        for piece in body.split(OPEN):
            named = _NAMED.fullmatch(piece)
            try:
                arguments = json.loads(named[2]) if named else None
            except json.JSONDecodeError:
                return None
            if not isinstance(arguments, dict):
                return None
            read.append(Call(named[1], arguments))
        return read

    def stream(self, body: str, scans: dict[int, ObjectScan]) -> list[Partial]:
        if body.lstrip().startswith("["):
            return json_calls(body, _ITEM_HEADER, scans)
        return json_calls(body, _NAMED_HEADER, scans, str)

    def grammar(self, functions: list[dict[str, Any]], single: bool, marker: Marker) -> list[str]:
        if not self.named:
            item = f"item: {json_rule(call_schema(functions))}"
            return [item, 'calls_rest: "[" item "]"' if single else 'calls_rest: "[" item (", " item)* "]"']
        lines = [f"call: {' | '.join(f'c{i}' for i in range(len(functions)))}",
                 "calls_rest: call" + ("" if single else f" ({marker(OPEN)} call)*")]
        for i, function in enumerate(functions):
            lines += [f"c{i}: {json.dumps(function['name'])} {marker(ARGS)} a{i}",
                      f"a{i}: {json_rule(arguments_schema(function))}"]
        return lines
