"""The chat request inside the server: what every API's body becomes (OpenAI's chat, the Responses API,
Anthropic's Messages, Ollama's chat and generate) before the chat path renders, constrains and runs it.
Its messages and tools are in the chat template's words; names turns its fields' names into the API's. Its history
is checked as it is built: a call the template cannot render, or a tool result that answers no call, is a 400
naming the API's own field (each message and call carries where the request held it).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from zhuzi.sampling_params import InvalidRequest, StructuredOutputError, StructuredOutputsParams
from zhuzi.server.common.errors import ApiError

Role = Literal["system", "developer", "user", "assistant", "tool"]


@dataclass
class ToolCall:
    """An earlier call in the conversation, its arguments as JSON text."""

    name: str
    arguments: str
    id: str | None = None
    source: str | None = None  # the API's path to it (its name and arguments are fields there); None: stored

    def template(self) -> dict[str, Any]:
        return {**({"id": self.id} if self.id is not None else {}), "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Message:
    role: Role
    content: str | list[str] | None = None  # a text, or the texts of its parts
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning: str | None = None  # an assistant's thought, sent back
    source: str | None = None  # a tool message: the API's field that names the call it answers; None: stored

    def template(self) -> dict[str, Any]:
        """The message as chat templates read it."""
        content = self.content if not isinstance(self.content, list) else [
            {"type": "text", "text": text} for text in self.content]
        out = {"role": self.role, "content": content, "name": self.name,
               "tool_calls": None if self.tool_calls is None else [call.template() for call in self.tool_calls],
               "tool_call_id": self.tool_call_id, "reasoning_content": self.reasoning}
        return {key: value for key, value in out.items() if value is not None}


@dataclass
class Tool:
    """A function the model may call; strict holds its calls to parameters even where calling is optional."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def function(self) -> dict[str, Any]:
        out = {"name": self.name, "description": self.description, "parameters": self.parameters,
               "strict": self.strict}
        return {key: value for key, value in out.items() if value is not None}

    def template(self) -> dict[str, Any]:
        return {"type": "function", "function": self.function()}


@dataclass(frozen=True)
class NamedTool:
    """A tool choice that forces one call to this function."""

    name: str

    def template(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name}}


ToolChoice = Literal["none", "auto", "required"] | NamedTool


@dataclass
class Constraint:
    """A structured-output constraint as the request gave it: the engine's parameters, plus the
    request's own names for their fields, so that an error names what the client sent."""

    params: StructuredOutputsParams
    source: str  # the request field it came from
    names: dict[str, str]  # StructuredOutputsParams field -> request field

    @classmethod
    def build(cls, source: str, names: dict[str, str], **fields: Any) -> Constraint:
        try:
            return cls(StructuredOutputsParams(**fields), source, names)
        except InvalidRequest as exc:
            raise _renamed(exc, source, names) from exc

    def rename(self, exc: InvalidRequest) -> InvalidRequest:
        """The engine's complaint about a StructuredOutputsParams field, under the request's name for it."""
        return _renamed(exc, self.source, self.names)


def _renamed(exc: InvalidRequest, source: str, names: dict[str, str]) -> InvalidRequest:
    if not isinstance(exc, StructuredOutputError):
        return exc if source == "structured_outputs" else InvalidRequest(source, str(exc))
    param = names.get(exc.field, source)
    return InvalidRequest(param, f"{param}: {exc.reason}")


@dataclass
class ChatRequest:
    """A chat to render and run. Errors about it name its fields as below (sampling's by SamplingParams' names,
    a tool's schema tools.N.parameters); names maps a pattern of such a name to the API's (re.sub)."""

    messages: list[Message]
    model: str | None = None
    tools: list[Tool] = field(default_factory=list)
    tool_choice: ToolChoice | None = None  # None: not given (auto, unless there are no tools)
    parallel_tool_calls: bool = True  # false: at most one call a reply
    constraint: Constraint | None = None  # the reply's format (when it calls no tool)
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams' fields the request sets
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None  # a harmony model's (gpt-oss): low, medium or high (OpenAI's other words too)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the reply continues the last (assistant) message
    stream: bool = False
    user: str | None = None  # the end user, logged for tracing abuse
    names: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # The one check of a tool choice, whichever API's words it came in.
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ApiError(400, "tool_choice needs tools", param="tool_choice").renamed(self.names)
        names = {tool.name for tool in self.tools}
        if isinstance(self.tool_choice, NamedTool) and self.tool_choice.name not in names:
            raise ApiError(400, f"tool_choice names {self.tool_choice.name!r}, which is not among the tools "
                           f"{sorted(names)}", param="tool_choice").renamed(self.names)
        check_history(self.messages)

    @property
    def parse_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forces_tool_call(self) -> bool:
        return bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice, NamedTool))

    def template_messages(self) -> list[dict[str, Any]]:
        return [message.template() for message in self.messages]

    def template_args(self) -> dict[str, Any]:
        """Keyword arguments for Tokenizer.render_chat / encode_chat."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.tool_choice is not None:
            choice = self.tool_choice
            kwargs.setdefault("tool_choice", choice.template() if isinstance(choice, NamedTool) else choice)
        return {
            "tools": [tool.template() for tool in self.tools] or None,
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "chat_template_kwargs": kwargs or None,
        }


def check_history(messages: list[Message]) -> None:
    """The conversation as templates read it, or a 400 naming the request's field: every call names its function
    and has a JSON object as arguments, every tool message answers an earlier call by its id (and takes the
    call's function as its name, which some templates print). Stored turns (no source) were checked when sent."""
    calls: dict[str, ToolCall] = {}
    seen_call = False
    for message in messages:
        for call in message.tool_calls or []:
            _check_call(call)
            seen_call = True
            if call.id is not None:
                calls[call.id] = call
        if message.role != "tool":
            continue
        answered = calls.get(message.tool_call_id) if message.tool_call_id is not None else None
        if answered is None:
            if message.source is None:
                continue
            why = ("a tool result must answer a call, and no assistant message before it calls a tool"
                   if not seen_call else f"{message.tool_call_id!r} is the id of no earlier tool call"
                   if message.tool_call_id is not None else f"no earlier tool call is of {message.name!r}")
            raise ApiError(400, f"{message.source}: {why}", param=message.source)
        message.name = message.name or answered.name


def _check_call(call: ToolCall) -> None:
    if call.source is None:
        return
    if not call.name:
        raise ApiError(400, f"{call.source}.name: a tool call needs the name of its function",
                       param=f"{call.source}.name")
    # Empty arguments are a call without any: models write "" for a function without parameters and clients
    # send it back so (vLLM's chat_utils reads it as {} too); the template is given {}.
    if not call.arguments.strip():
        call.arguments = "{}"
        return
    param = f"{call.source}.arguments"
    try:
        arguments = json.loads(call.arguments)
    except ValueError as exc:
        raise ApiError(400, f"{param}: a tool call's arguments must be JSON text, not {call.arguments[:80]!r} "
                       f"({exc})", param=param) from exc
    if not isinstance(arguments, dict):
        raise ApiError(400, f"{param}: a tool call's arguments must be a JSON object, not {call.arguments[:80]}",
                       param=param)
