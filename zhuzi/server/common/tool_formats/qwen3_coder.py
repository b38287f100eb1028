"""Qwen3-Coder's and Qwen3.5's format: XML in <tool_call> tags, a function and its parameters, each value on lines
of its own, typed by the function's schema (a string is written raw, anything else as JSON).

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>
"""
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
    is_text,
    json_rule,
    keyed_arguments,
    properties,
    text_rule,
)

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>\n?(.*?)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
_OPENING = re.compile(r"\s*<function=([^>\n]+)>\n?")
CLOSING = "</function>"
OPEN_PARAMETER, CLOSE_PARAMETER = "<parameter=", "</parameter>"


class Qwen3Coder(ToolFormat):
    name = "qwen3_coder"
    open, close = "<tool_call>", "</tool_call>"

    @staticmethod
    def detect(template: str) -> bool:
        return "<function=" in template and "<parameter=" in template

    def parse(self, body: str) -> list[Call] | None:
        function = _FUNCTION.fullmatch(body)
        if function is None:
            return None
        name, inner = function[1].strip(), function[2]
        schema = self.schema(name).get("properties") or {}
        arguments = {}
        for parameter in _PARAMETER.finditer(inner):
            key = parameter[1].strip()
            arguments[key] = _value(parameter[2], schema.get(key) or {})
        if _PARAMETER.sub("", inner).strip():  # text outside the parameters: not this format
            return None
        return [Call(name, arguments)]

    def stream(self, body: str, scans: dict[int, ObjectScan]) -> list[Partial]:
        """The call's JSON, a parameter more as each one closes (as vLLM streams this format)."""
        if (opening := _OPENING.match(body)) is None:
            return []
        name, closing = opening[1].strip(), body.find(CLOSING, opening.end())
        inner = body[opening.end():closing if closing >= 0 else len(body)]
        schema = self.schema(name).get("properties") or {}
        pairs = [(key, _value(text, schema.get(key) or {})) for key, text in _parameters(inner)]
        return [Partial(name, keyed_arguments(pairs, closing >= 0), closing + len(CLOSING) if closing >= 0 else None)]

    def grammar(self, functions: list[dict[str, Any]], single: bool, marker: Marker) -> list[str]:
        lines = [f"function: {' | '.join(f'f{i}' for i in range(len(functions)))}",
                 f'calls_rest: "\\n" function "\\n" {marker(self.close)}'
                 + ("" if single else f' ("\\n" {marker(self.open)} "\\n" function "\\n" {marker(self.close)})*')]
        for i, function in enumerate(functions):
            parameters = []
            for j, (key, schema, required) in enumerate(properties(arguments_schema(function))):
                head = json.dumps(f"<parameter={key}>\n")
                if is_text(schema):  # raw text up to the parameter's end
                    lines.append(f'f{i}p{j}[lazy]: {head} {text_rule(schema)} "\\n</parameter>\\n"')
                else:
                    lines += [f"f{i}p{j}: {head} f{i}v{j} " '"\\n</parameter>\\n"', f"f{i}v{j}: {json_rule(schema)}"]
                parameters.append(f"f{i}p{j}" if required else f"f{i}p{j}?")
            opening = json.dumps("<function=" + function["name"] + ">\n")
            lines.append(f'f{i}: {opening} {" ".join(parameters)} "</function>"')
        return lines


def _parameters(inner: str) -> list[tuple[str, str]]:
    """The whole parameters in a function's text so far, as _PARAMETER reads them (found with str.find: an open
    parameter's long value is searched for its end, not matched again, as it grows)."""
    out, at = [], 0
    while (start := inner.find(OPEN_PARAMETER, at)) >= 0 and (end := inner.find(CLOSE_PARAMETER, start)) >= 0:
        head = inner.find(">", start)
        key = inner[start + len(OPEN_PARAMETER):head]
        if head < 0 or head > end or not key or "\n" in key:  # no parameter's start: look further on
            at = start + 1
            continue
        out.append((key.strip(), inner[head + 1:end].removeprefix("\n").removesuffix("\n")))
        at = end + len(CLOSE_PARAMETER)
    return out


def _value(text: str, schema: dict[str, Any]) -> Any:
    """A parameter's value: raw text for a string, else its JSON (raw text when it is none)."""
    if is_text(schema):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
