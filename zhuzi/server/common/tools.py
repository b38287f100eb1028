"""Tool calls on the way in, the chat path's step before the engine: what the model is told about tools, and the
grammar its calls must follow, in its tool format (tool_formats/). Templates that ignore tools (SmolLM2) get
zhuzi's generic prompt for it, in Hermes' format; tool_choice required or named makes the reply only calls, and
auto with a strict function or a JSON format holds every call to its function's schema.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from zhuzi.sample.grammar import json_options, json_schema
from zhuzi.sampling_params import InvalidRequest, StructuredOutputsParams
from zhuzi.server.common.request import ChatRequest, Constraint, NamedTool, ToolChoice
from zhuzi.server.common.tool_formats import ToolFormat
from zhuzi.server.common.tool_formats.format import arguments_schema
from zhuzi.server.common.tool_formats.hermes import Hermes
from zhuzi.tokenizer import message_text

TOOL_OPEN, TOOL_CLOSE = Hermes.open, Hermes.close  # the generic prompt's format
# Text between tool calls and after the last one, in the grammar for "auto".
_TEXT = r"/(.|\n)*/"


@dataclass
class ToolGrammar:
    """The grammar a reply with tools must follow: the whole reply (forced), or text and calls (auto)."""

    grammar: str
    forced: bool  # only calls (the parser takes a closing marker inside a call's arguments as their text)


def _marker(text: str, added_tokens: dict[str, int]) -> str:
    """A marker in Lark: an added token (Qwen's <tool_call>, Mistral's [TOOL_CALLS]) must be named as a token
    (by its id), or llguidance would spell its text with ordinary tokens and never allow the single id the model
    writes."""
    return f"<[{added_tokens[text]}]>" if text in added_tokens else json.dumps(text)


def tool_grammar(fmt: ToolFormat, functions: list[dict[str, Any]], tool_choice: ToolChoice | None,
                 parallel_tool_calls: bool, added_tokens: dict[str, int],
                 answer: StructuredOutputsParams | None = None) -> ToolGrammar | None:
    """The reply's grammar (Lark), calls written in fmt, or None when the reply is free.

    functions: the tools' "function" objects; tool_choice: "required", "auto" (None) or a NamedTool; answer:
    the JSON (json or json_object) the reply must be when it calls nothing ("auto" with a JSON format);
    added_tokens: the tokenizer's, text to id.
    """
    forced = tool_choice == "required" or isinstance(tool_choice, NamedTool)
    strict = any(f.get("strict") for f in functions)
    if not (forced or strict or answer is not None):
        return None
    if isinstance(tool_choice, NamedTool):
        functions = [f for f in functions if f["name"] == tool_choice.name]
    single = isinstance(tool_choice, NamedTool) or not parallel_tool_calls

    def marker(text: str) -> str:
        return _marker(text, added_tokens)

    lines = fmt.grammar(functions, single, marker)
    opening = fmt.open if fmt.grammar_open is None else fmt.grammar_open
    lines.append(f"calls: {marker(opening)} calls_rest" if opening else "calls: calls_rest")
    if forced:
        lines.append("start: calls")
    elif answer is not None:
        answer_schema = {**json_schema(answer), "x-guidance": json_options(answer)}
        lines += ["start: calls | answer", f"answer: %json {json.dumps(answer_schema)}"]
    elif not opening:  # auto with strict functions, calls without a marker: a reply of calls, or text
        lines += ["start: calls | text", f"text: TEXT\nTEXT: {_TEXT}"]
    else:  # auto with strict functions: any text, but what starts calls is held to the schemas
        lines += [f"start: {'segment?' if single else 'segment*'} text", f"text: TEXT\nTEXT: {_TEXT}"]
        if opening in added_tokens:  # the marker is one token, which free text never contains
            lines.append(f"segment: TEXT {marker(opening)} calls_rest")
        else:  # a string: free text runs lazily, up to the first marker
            lines += [f"segment_start[lazy]: TEXT {marker(opening)}", "segment: segment_start calls_rest"]
    return ToolGrammar("\n".join(lines), forced)


def chat_constraints(request: ChatRequest, fmt: ToolFormat,
                     added_tokens: dict[str, int]) -> tuple[list[Constraint], bool]:
    """A chat request's constraints to compile, in order, the last being the reply's (the earlier ones
    check a part alone, so that an error names that part), and whether the reply is only tool calls."""
    answer = request.constraint
    forced = request.forces_tool_call
    if answer is not None and forced:
        raise InvalidRequest("tool_choice", f"{answer.source} and tool_choice both constrain the output: "
                             "give one of them")
    if (answer is not None or forced) and request.continue_final_message:
        raise InvalidRequest("continue_final_message", f"{answer.source if answer else 'tool_choice'} cannot "
                             "constrain a continued message (continue_final_message)")
    answers = [answer] if answer else []
    if not request.parse_tool_calls:
        return answers, False
    functions = [tool.function() for tool in request.tools]
    if answer is not None and answer.params.kind not in ("json", "json_object"):
        raise InvalidRequest(answer.source, f"{answer.source} can go with tools only as JSON (a schema or any "
                             "object): set tool_choice to none, or drop the tools")
    grammar = tool_grammar(fmt, functions, request.tool_choice, request.parallel_tool_calls, added_tokens,
                           answer.params if answer else None)
    if grammar is None:
        return answers, False
    arguments = [Constraint(StructuredOutputsParams(json=arguments_schema(f)),
                            f"tools.{i}.parameters", {}) for i, f in enumerate(functions)]
    whole = Constraint(StructuredOutputsParams(grammar=grammar.grammar), "tools", {})
    return answers + arguments + [whole], grammar.forced


def template_renders_tools(template_variables: frozenset[str]) -> bool:
    """Whether a chat template tells the model about tools itself (it reads the `tools` variable)."""
    return "tools" in template_variables


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """The generic format's instructions, for templates that do not render tools: the words
    Hermes-style templates use, so a model sees one format whichever template it has."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You can call functions. Their signatures, as JSON schemas, are inside <tools></tools>:\n"
            f"<tools>\n{listing}\n</tools>\n"
            "To call a function, write a JSON object with its name and arguments inside "
            "<tool_call></tool_call> tags, one call per block:\n"
            f'{TOOL_OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{TOOL_CLOSE}')


def call_as_text(call: dict[str, Any]) -> str:
    """An earlier call (OpenAI's form, arguments as JSON text) written as the model writes one."""
    function = call["function"]
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except ValueError:
        arguments = function.get("arguments")
    return f"{TOOL_OPEN}\n{json.dumps({'name': function['name'], 'arguments': arguments})}\n{TOOL_CLOSE}"


def with_generic_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation for a template without tool support: the tools described at the end of the
    system message (or in one of their own)."""
    out = [{"role": "system", "content": tools_system_prompt(tools)}]
    if messages and messages[0].get("role") == "system":
        instructions = message_text(messages[0].get("content"))
        out = [{**messages[0], "content": f"{instructions}\n\n{out[0]['content']}"}]
        messages = messages[1:]
    return out + messages


def with_calls_as_text(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Earlier calls written into their assistant turns, for a template that does not render `tool_calls`: without
    them the turn would render empty, whether or not this request offers tools."""
    out = []
    for message in messages:
        if message.get("role") == "assistant" and message.get("tool_calls"):
            calls = "\n".join(call_as_text(c) for c in message["tool_calls"])
            content = message.get("content") or ""
            message = {k: v for k, v in message.items() if k != "tool_calls"}
            message["content"] = f"{content}\n{calls}" if content else calls
        out.append(message)
    return out
