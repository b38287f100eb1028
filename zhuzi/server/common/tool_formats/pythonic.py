"""LFM2's format: a Python list of calls between <|tool_call_start|> and <|tool_call_end|>,
[get_weather(city="Paris"), add(a=1, b=2)]; values are Python literals (JSON's true, false and null too)."""
from __future__ import annotations

import ast
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
    json_rule,
    keyed_arguments,
    listed,
    properties,
    repeated,
    value_end,
)

_JSON_NAMES = {"true": True, "false": False, "null": None}
COMMA = '", "'  # in Lark
_LIST = re.compile(r"\s*\[")
_CALL = re.compile(r"\s*,?\s*(?P<call>[A-Za-z_][\w.]*)\(")  # a call's start (after the call before it)
_KEYWORD = re.compile(r"\s*([A-Za-z_]\w*)\s*=")
_CLOSING = re.compile(r"\s*\)")


class Pythonic(ToolFormat):
    name = "pythonic"
    open, close = "<|tool_call_start|>", "<|tool_call_end|>"
    markers = (open, close)

    @staticmethod
    def detect(template: str) -> bool:
        return "<|tool_call_start|>" in template or "<|tool_list_start|>" in template or "List of tools: [" in template

    def parse(self, body: str) -> list[Call] | None:
        try:
            tree = ast.parse(body.strip(), mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return None
            return [_call(node) for node in tree.elts]
        except (SyntaxError, ValueError):
            return None

    def stream(self, body: str, scans: dict[int, ObjectScan]) -> list[Partial]:
        """The list's calls, each one's JSON a key more as each value is whole."""
        calls: list[Partial] = []
        at = opening.end() if (opening := _LIST.match(body)) else len(body) + 1
        while call := _CALL.match(body, at):
            pairs: list[tuple[str, Any]] = []
            at = call.end()
            while (closing := _CLOSING.match(body, at)) is None:
                keyword = _KEYWORD.match(body, at)
                end = value_end(body, keyword.end(), ('"', "'")) if keyword else None
                try:
                    value = _literal(ast.parse(body[keyword.end():end].strip(), mode="eval").body) \
                        if keyword and end is not None else None
                except (SyntaxError, ValueError):
                    end = None
                if keyword is None or end is None:
                    return calls + [Partial(call[1], keyed_arguments(pairs, False), None, call.start("call"))]
                pairs.append((keyword[1], value))
                at = end + 1 if body[end] == "," else end
            calls.append(Partial(call[1], keyed_arguments(pairs, True), closing.end(), call.start("call")))
            at = closing.end()
        return calls

    def grammar(self, functions: list[dict[str, Any]], single: bool, marker: Marker) -> list[str]:
        lines = [f"call: {' | '.join(f'c{i}' for i in range(len(functions)))}",
                 f'calls_rest: "[" {repeated("call", COMMA, single)} "]" {marker(self.close)}']
        for i, function in enumerate(functions):
            required, optional = [], []
            for j, (key, schema, needed) in enumerate(properties(arguments_schema(function))):
                lines.append(f"c{i}k{j}: {json.dumps(key + '=')} {json_rule(schema)}")
                (required if needed else optional).append(f"c{i}k{j}")
            arguments = listed(required, optional, COMMA)
            lines.append(f'c{i}: {json.dumps(function["name"] + "(")} {arguments} ")"')
        return lines


def _call(node: ast.expr) -> Call:
    if not (isinstance(node, ast.Call) and not node.args and (name := _name(node.func))):
        raise ValueError("not a call with keyword arguments")
    return Call(name, {keyword.arg: _literal(keyword.value) for keyword in node.keywords if keyword.arg})


def _name(node: ast.expr) -> str | None:
    """A function's name, dotted ones too (module.function)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (base := _name(node.value)):
        return f"{base}.{node.attr}"
    return None


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values) if k is not None}
    return ast.literal_eval(node)
