"""The chat path's render step for a model that speaks gpt-oss's harmony format: a chat request becomes harmony
messages (a system message with the reasoning effort, a developer message with the instructions and the tools as
a TypeScript namespace, the turns, earlier thoughts dropped once an answer followed them), then ids, each text
encoded apart as plain text, as OpenAI's renderer (openai-harmony) encodes it; for the inspector, with who wrote
each token.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from zhuzi.server.common.errors import ApiError
from zhuzi.server.common.request import ChatRequest, Message
from zhuzi.tokenizer import DocToken, Tokenizer

IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."  # the system message gpt-oss was tuned on
KNOWLEDGE_CUTOFF = "2024-06"
DEFAULT_EFFORT = "medium"
# Harmony knows three efforts; OpenAI's other words are the nearest of them.
EFFORTS = {"none": "low", "minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "high",
           "max": "high"}
FUNCTIONS = "functions"  # the namespace of the request's tools: a call goes to functions.NAME


# A text and who wrote it: a role of the request, or "template" for zhuzi's own words (the inspector shows it).
Segment = tuple[str, str]
Piece = int | list[Segment]  # a control token, or one text as it is encoded, cut where its writer changes


@dataclass
class HarmonyMessage:
    """One message of the document: who sent it (a role, or the tool that answers: functions.NAME), where it went
    (its channel, and the recipient of a call) and its text."""

    author: str
    text: list[Segment]
    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None  # a call's arguments: json
    closed: bool = True  # False: the reply goes on from it (a continued message)


def effort(request: ChatRequest) -> str:
    return EFFORTS[request.reasoning_effort or DEFAULT_EFFORT]


def render(tokenizer: Tokenizer, request: ChatRequest, today: str) -> list[int]:
    """The prompt's ids; today (YYYY-MM-DD) is the conversation's date, as the system message says it."""
    return tokenizer.encode_pieces([p if isinstance(p, int) else "".join(t for t, _ in p)
                                    for p in pieces(tokenizer, request, today)])


def document(tokenizer: Tokenizer, request: ChatRequest, today: str) -> list[DocToken]:
    """render's tokens, each with who wrote it."""
    return tokenizer.author_tokens([p if isinstance(p, int) else ("".join(t for t, _ in p),
                                                                  [who for t, who in p for _ in t])
                                    for p in pieces(tokenizer, request, today)])


def pieces(tokenizer: Tokenizer, request: ChatRequest, today: str) -> list[Piece]:
    out: list[Piece] = []
    for message in harmony_messages(request, today):
        out += _message_pieces(tokenizer, message)
    if request.add_generation_prompt:
        out += [tokenizer.special_id("<|start|>"), _ours("assistant")]
    return out


def _message_pieces(tokenizer: Tokenizer, message: HarmonyMessage) -> list[Piece]:
    """A message as OpenAI's renderer writes it: header texts apart, markers as control tokens."""
    out: list[Piece] = [tokenizer.special_id("<|start|>"), _ours(message.author)]
    if message.recipient is not None:
        out.append(_ours(f" to={message.recipient}"))
    if message.channel is not None:
        out += [tokenizer.special_id("<|channel|>"), _ours(message.channel)]
    if message.content_type is not None:
        out.append(_ours(f" {message.content_type}"))
    out += [tokenizer.special_id("<|message|>"), message.text]
    if message.closed:
        call = message.author == "assistant" and message.recipient is not None
        out.append(tokenizer.special_id("<|call|>" if call else "<|end|>"))
    return out


def _ours(text: str) -> list[Segment]:
    return [(text, "template")]


def harmony_messages(request: ChatRequest, today: str) -> list[HarmonyMessage]:
    """The request as harmony messages, in order."""
    tools = request.tools if request.parse_tool_calls else []
    leading = 0
    while leading < len(request.messages) and request.messages[leading].role in ("system", "developer"):
        leading += 1
    instructions: list[Segment] = []
    for message in request.messages[:leading]:
        if text := _text(message):
            instructions += [("\n\n", "template")] * bool(instructions) + [(text, message.role)]
    out = [HarmonyMessage("system", _ours(system_text(effort(request), today, bool(tools))))]
    if instructions or tools:
        out.append(HarmonyMessage("developer", developer_text(instructions, [t.function() for t in tools])))
    names: dict[str, str] = {}  # call id -> the function it called, for the tool messages that answer
    turns = request.messages[leading:]
    for k, message in enumerate(turns):
        last = k == len(turns) - 1
        out += _turn(message, names, continued=last and request.continue_final_message)
    return _drop_answered_thoughts(out)


def _turn(message: Message, names: dict[str, str], continued: bool) -> list[HarmonyMessage]:
    """One message of the request: an assistant's is its thought, its text (an answer, or the preamble to its
    calls) and its calls; a tool's answers a call by the call's id."""
    body = _text(message)
    text = [(body, message.role)]
    if message.role in ("system", "developer"):
        return [HarmonyMessage("developer", developer_text(text, []))]
    if message.role == "user":
        return [HarmonyMessage("user", text)]
    if message.role == "tool":
        name = names.get(message.tool_call_id or "", message.name)
        if name is None:
            raise ApiError(400, "a tool message needs the tool_call_id of an earlier call (or the function's "
                           "name)", param="messages")
        return [HarmonyMessage(f"{FUNCTIONS}.{name}", text, "commentary", "assistant")]
    out = [HarmonyMessage("assistant", [(message.reasoning, "assistant")], "analysis")] if message.reasoning else []
    calls = message.tool_calls or []
    if body or continued:
        channel = "commentary" if calls else "final"
        out.append(HarmonyMessage("assistant", text, channel, closed=not continued))
    for call in calls:
        if call.id is not None:
            names[call.id] = call.name
        out.append(HarmonyMessage("assistant", [(call.arguments, "assistant")], "commentary",
                                  f"{FUNCTIONS}.{call.name}", "json"))
    return out


def _drop_answered_thoughts(messages: list[HarmonyMessage]) -> list[HarmonyMessage]:
    """The format's rule for a conversation: a thought is dropped once an answer (a final message) follows it;
    the thought of a turn still calling tools stays. (openai-harmony's renderer keeps a thought between two
    answers; its format's text, and gpt-oss's own template, drop it.)"""
    finals = [k for k, m in enumerate(messages) if m.channel == "final" and m.closed]
    if not finals:
        return messages
    return [m for k, m in enumerate(messages) if not (m.channel == "analysis" and k < finals[-1])]


def _text(message: Message) -> str:
    content = message.content
    return "\n".join(content) if isinstance(content, list) else content or ""


def system_text(reasoning: str, today: str, functions: bool) -> str:
    channels = "# Valid channels: analysis, commentary, final. Channel must be included for every message."
    if functions:
        channels += f"\nCalls to these tools must go to the commentary channel: '{FUNCTIONS}'."
    return "\n\n".join([f"{IDENTITY}\nKnowledge cutoff: {KNOWLEDGE_CUTOFF}\nCurrent date: {today}",
                        f"Reasoning: {reasoning}", channels])


def developer_text(instructions: list[Segment], functions: list[dict[str, Any]]) -> list[Segment]:
    """The instructions (the system messages' texts, by their writers), then the tools."""
    text = [("# Instructions\n\n", "template"), *instructions] if instructions else []
    if functions:
        text.append(("\n\n" * bool(text) + "# Tools\n\n" + tools_namespace(functions), "template"))
    return text


def tools_namespace(functions: list[dict[str, Any]]) -> str:
    """The request's functions as the TypeScript namespace gpt-oss reads."""
    lines = [f"## {FUNCTIONS}\n", f"namespace {FUNCTIONS} {{\n"]
    for function in functions:
        lines += [f"// {line}" for line in (function.get("description") or "").splitlines()]
        parameters = function.get("parameters")
        signature = f"_: {typescript(parameters, '')}" if parameters is not None else ""
        lines.append(f"type {function['name']} = ({signature}) => any;\n")
    lines.append(f"}} // namespace {FUNCTIONS}")
    return "\n".join(lines)


# ---------------------------------------------------------------- JSON schema -> TypeScript, as openai-harmony

def typescript(schema: Any, indent: str) -> str:
    """A JSON schema as a TypeScript type, with descriptions, defaults and examples as comments."""
    if not isinstance(schema, dict):
        return "any"
    if isinstance(schema.get("oneOf"), list):
        return "".join(f"\n{indent} | {_variant(v, indent + '   ')}{_comments(v, [])}" for v in schema["oneOf"])
    kind = schema.get("type")
    if isinstance(kind, list):
        names = [{"integer": "number"}.get(t, t) for t in kind if isinstance(t, str)]
        if names:
            return " | ".join(names)
        return "any"
    if kind == "object":
        return _object(schema, indent)
    if kind == "string":
        values = [f'"{v}"' for v in schema.get("enum") or [] if isinstance(v, str)]
        return " | ".join(values) if values else "string"
    if kind == "array":
        return f"{typescript(schema['items'], indent)}[]" if "items" in schema else "Array<any>"
    return {"number": "number", "integer": "number", "boolean": "boolean"}.get(kind, "any") if isinstance(
        kind, str) else "any"


def _object(schema: dict[str, Any], indent: str) -> str:
    out = f"{indent}// {schema['description']}\n" if isinstance(schema.get("description"), str) else ""
    out += "{\n"
    required = {name for name in schema.get("required") or [] if isinstance(name, str)}
    properties = schema.get("properties")
    for key, value in (properties.items() if isinstance(properties, dict) else []):
        value = value if isinstance(value, dict) else {}
        optional = "" if key in required else "?"
        if isinstance(value.get("title"), str):
            out += f"{indent}// {value['title']}\n{indent}//\n"
        one_of = value.get("oneOf")
        if "oneOf" not in value and isinstance(value.get("description"), str):
            out += f"{indent}// {value['description']}\n"
        examples = value.get("examples")
        if isinstance(examples, list) and examples:
            out += f"{indent}// Examples:\n" + "".join(f'{indent}// - "{e}"\n' for e in examples if isinstance(e, str))
        if isinstance(one_of, list):
            out += _one_of_property(key, value, one_of, optional, indent)
            continue
        out += f"{indent}{key}{optional}: {_variant(value, indent + '    ')},"
        if "default" in value and "oneOf" not in value:
            out += f" // {_default(value)}"
        out += "\n"
    return out + f"{indent}}}"


def _one_of_property(key: str, value: dict[str, Any], variants: list[Any], optional: str, indent: str) -> str:
    """A property whose type is one of several: its description once above (not again on its first variant), then
    a line per variant."""
    description = value.get("description") if isinstance(value.get("description"), str) else None
    first = variants[0] if variants and isinstance(variants[0], dict) else {}
    above = description is not None and description != first.get("description")
    out = f"{indent}// {description}\n" if above else ""
    if "default" in value:
        out += f"{indent}// {_default(value)}\n"
    out += f"{indent}{key}{optional}:\n"
    for i, variant in enumerate(variants):
        variant = variant if isinstance(variant, dict) else {}
        skip = [description] if not (i == 0 and above) else None
        out += f"{indent} | {_variant(variant, indent + '   ')}{_comments(variant, skip)}\n"
    return out + f"{indent},\n"


def _variant(schema: dict[str, Any], indent: str) -> str:
    """A type, with "| null" where the schema is nullable."""
    text = typescript(schema, indent)
    return f"{text} | null" if schema.get("nullable") is True and "null" not in text else text


def _comments(variant: dict[str, Any], skip: list[str | None] | None) -> str:
    """A variant's trailing comment: its description (none if skip is None, or if it is in skip), its default."""
    comments = []
    if skip is not None and isinstance(variant.get("description"), str) and variant["description"] not in skip:
        comments.append(variant["description"])
    if "default" in variant:
        comments.append(_default(variant))
    return f" // {' '.join(comments)}" if comments else ""


def _default(schema: dict[str, Any]) -> str:
    """A default as a comment writes it: a string quoted unless the schema is an enum, anything else as JSON."""
    value = schema["default"]
    if isinstance(value, str):
        return f'default: "{value}"' if not schema.get("enum") else f"default: {value}"
    return f"default: {json.dumps(value, separators=(',', ':'), ensure_ascii=False)}"
