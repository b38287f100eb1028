"""Gemma 4's format: <|tool_call>call:NAME{key:value,...}<tool_call|> per call, its arguments in Gemma's own
notation: keys bare, strings between <|"|> markers, numbers, booleans, lists and objects as in JSON."""
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
    listed,
    properties,
    text_rule,
    value_end,
)

QUOTE = '<|"|>'
COMMA = '","'  # in Lark
_CALL = re.compile(r"\s*call:([^{\s]+)(\{.*\})\s*", re.DOTALL)
_KEY = re.compile(r"\s*([A-Za-z_][\w.-]*)\s*:")
_OPENING = re.compile(r"\s*call:([^{\s]+)\{")
_CLOSING = re.compile(r"\s*\}")


class Gemma4(ToolFormat):
    name = "gemma4"
    open, close = "<|tool_call>", "<tool_call|>"
    markers = (open, close, QUOTE)

    @staticmethod
    def detect(template: str) -> bool:
        return "<|tool_call>call:" in template

    def parse(self, body: str) -> list[Call] | None:
        call = _CALL.fullmatch(body)
        try:
            arguments = _as_json(call[2]) if call else None
        except ValueError:
            return None
        return [Call(call[1], arguments)] if isinstance(arguments, dict) else None

    def stream(self, body: str, scans: dict[int, ObjectScan]) -> list[Partial]:
        """The call's JSON, a key more as each value is whole."""
        if (opening := _OPENING.match(body)) is None:
            return []
        pairs: list[tuple[str, Any]] = []
        at = opening.end()
        while (closing := _CLOSING.match(body, at)) is None:
            key = _KEY.match(body, at)
            end = value_end(body, key.end(), (QUOTE, '"')) if key else None
            try:
                value = _as_json(body[key.end():end]) if key and end is not None else None
            except ValueError:
                end = None
            if key is None or end is None:
                return [Partial(opening[1], keyed_arguments(pairs, False))]
            pairs.append((key[1], value))
            at = end + 1 if body[end] == "," else end
        return [Partial(opening[1], keyed_arguments(pairs, True), closing.end())]

    def grammar(self, functions: list[dict[str, Any]], single: bool, marker: Marker) -> list[str]:
        close, quote = marker(self.close), marker(QUOTE)
        lines = [f"call: {' | '.join(f'c{i}' for i in range(len(functions)))}",
                 f"calls_rest: call {close}" + ("" if single else f" ({marker(self.open)} call {close})*")]
        for i, function in enumerate(functions):
            required, optional = [], []
            for j, (key, schema, needed) in enumerate(properties(arguments_schema(function))):
                head = json.dumps(key + ":")
                if not is_text(schema):
                    lines.append(f"c{i}k{j}: {head} {json_rule(schema)}")
                elif quote != json.dumps(QUOTE):  # one token, which the text between two of them never holds
                    lines += [f"c{i}k{j}: {head} {quote} c{i}t{j} {quote}", f"c{i}t{j}: {text_rule(schema)}"]
                else:  # a string: text up to the first closing marker
                    lines.append(f"c{i}k{j}[lazy]: {head} {quote} {text_rule(schema)} {quote}")
                (required if needed else optional).append(f"c{i}k{j}")
            opening = json.dumps(f"call:{function['name']}{{")
            lines.append(f'c{i}: {opening} {listed(required, optional, COMMA)} "}}"')
        return lines


def _as_json(text: str) -> Any:
    """Gemma's notation read as JSON (its strings, and JSON's own, taken as they are)."""
    out, at, last = [], 0, ""
    while at < len(text):
        if text.startswith(QUOTE, at):
            end = text.find(QUOTE, at + len(QUOTE))
            if end < 0:
                raise ValueError("an unclosed string")
            piece, at = json.dumps(text[at + len(QUOTE):end], ensure_ascii=False), end + len(QUOTE)
        elif text[at] == '"':
            _, end = json.JSONDecoder().raw_decode(text, at)
            piece, at = text[at:end], end
        elif last in ("{", ",") and (key := _KEY.match(text, at)):
            piece, at = json.dumps(key[1]) + ":", key.end()
        else:
            piece, at = text[at], at + 1
        out.append(piece)
        last = piece.strip()[-1:] or last
    return json.loads("".join(out))
