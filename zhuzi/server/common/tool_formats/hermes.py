"""Hermes' format (Qwen2.5, Hermes, SmolLM3, and zhuzi's generic prompt): a JSON call in <tool_call> tags, or a
reply that is a call's JSON alone, fenced as ```json or bare (Qwen2.5-Coder writes both)."""
from __future__ import annotations

import json
from typing import Any

from zhuzi.server.common.tool_formats.format import (
    Call,
    Marker,
    ObjectScan,
    Partial,
    ToolFormat,
    arguments_schema,
    json_call,
    json_calls,
    json_header,
    json_rule,
)

# A call's start, up to its arguments' object: {"name": "...", "arguments": (in a fence or not).
_HEADER = json_header(r"\s*(?:```(?:json)?\s*)?")


class Hermes(ToolFormat):
    name = "hermes"
    open, close = "<tool_call>", "</tool_call>"
    bare = True
    leads = (("```json", "```"),)

    @staticmethod
    def detect(template: str) -> bool:
        return "<tool_call>" in template

    def parse(self, body: str) -> list[Call] | None:
        text = body.strip()
        if text.startswith("```"):  # a fence inside the tags
            text = text.removeprefix("```json").removeprefix("```").removesuffix("```")
        call = json_call(text)
        return [call] if call else None

    def stream(self, body: str, scans: dict[int, ObjectScan]) -> list[Partial]:
        return json_calls(body, _HEADER, scans)[:1]

    def parse_bare(self, body: str) -> list[Call] | None:
        try:
            keys = set(json.loads(body))
        except (json.JSONDecodeError, TypeError):
            return None
        return self.parse(body) if keys == {"name", "arguments"} else None

    def grammar(self, functions: list[dict[str, Any]], single: bool, marker: Marker) -> list[str]:
        return [f"body: {json_rule(call_schema(functions))}",
                f'calls_rest: "\\n" body "\\n" {marker(self.close)}'
                + ("" if single else f' ("\\n" {marker(self.open)} "\\n" body "\\n" {marker(self.close)})*')]


def call_schema(functions: list[dict[str, Any]], arguments_key: str = "arguments") -> dict[str, Any]:
    """The JSON of one call to one of the functions: its name, then arguments valid under its parameters."""
    schemas = [{"type": "object",
                "properties": {"name": {"const": f["name"]}, arguments_key: arguments_schema(f)},
                "required": ["name", arguments_key], "additionalProperties": False} for f in functions]
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}

