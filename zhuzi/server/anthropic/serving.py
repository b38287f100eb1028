"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens), between the routes and the chat path: a
Messages request becomes the server's chat request (a tool_result with is_error reaches the model as its text
after "Error: "), and MessagesFormat writes the reply's parts as a Message's content blocks or Anthropic's stream of
events. A thought carries no signature: one sent back is read as it is.
"""
from __future__ import annotations

import json
from typing import Any

import pydantic
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from zhuzi.outputs import CompletionOutput, PromptProgress
from zhuzi.server.anthropic import protocol as a
from zhuzi.server.common.chat import ChatPath
from zhuzi.server.common.content_parts import PartEvent, new_item_id
from zhuzi.server.common.errors import ApiError
from zhuzi.server.common.formats import Choice, ResponseState, sse_event
from zhuzi.server.common.parsers import ParsedText
from zhuzi.server.common.request import ChatRequest, Constraint, Message, NamedTool, Tool, ToolCall, ToolChoice
from zhuzi.server.common.serving import json_response

# Anthropic's error types by status; 529 is its "overloaded" (a full queue, or a server that cannot serve now).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               529: "overloaded_error"}


# The chat request's fields under their Messages names, for the errors the chat path finds (see ApiError.renamed).
NAMES = {r"^stop\b": "stop_sequences", r"^tools\.(\d+)\.parameters": r"tools.\1.input_schema",
         r"^messages\b.*": "messages", r"^(chat_template_kwargs|thinking_token_budget)\b.*": "thinking"}


def anthropic_status(status: int, code: str | int | None = None) -> int:
    """An HTTP status as Anthropic answers it."""
    if status == 415:
        return 400
    if status == 503 or (status == 429 and code == "queue_full"):
        return 529
    return status


def error_body(status: int, message: str) -> a.AnthropicError:
    return a.AnthropicError(error=a.ErrorDetail(type=ERROR_TYPES.get(status, "api_error"), message=message))


def error_response(error: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    """Anthropic's error object, with its status for the error's."""
    status = anthropic_status(error.status, error.code)
    return JSONResponse(error_body(status, error.message).model_dump(), status_code=status, headers=headers)


def event(payload: pydantic.BaseModel) -> str:
    """One server-sent event, named by its type (Anthropic's SDK reads the name)."""
    return sse_event(payload.type, payload)  # type: ignore[attr-defined]


# ---------------------------------------------------------------- the request, as a chat request

def _texts(blocks: list[a.TextBlock]) -> list[str]:
    return [block.text for block in blocks]


def _tool_result(block: a.ToolResultBlock, source: str) -> Message:
    content = block.content if isinstance(block.content, str) else "\n".join(b.text for b in block.content
                                                                             if isinstance(b, a.TextBlock))
    return Message("tool", f"Error: {content}" if block.is_error else content, tool_call_id=block.tool_use_id,
                   source=f"{source}.tool_use_id")


def _message(message: a.MessageParam, source: str) -> list[Message]:
    """One Anthropic message (at source, messages.N) as chat messages: a user's tool results become tool
    messages (first, as Anthropic orders them), an assistant's tool_use blocks its tool calls and its thoughts
    its reasoning."""
    if isinstance(message.content, str):
        return [Message(message.role, message.content)]
    texts = [b for b in message.content if isinstance(b, a.TextBlock)]
    blocks = list(enumerate(message.content))
    if message.role == "user":
        results = [_tool_result(b, f"{source}.content.{k}") for k, b in blocks if isinstance(b, a.ToolResultBlock)]
        return results + ([Message("user", _texts(texts))] if texts or not results else [])
    calls = [ToolCall(b.name, json.dumps(b.input), b.id, f"{source}.content.{k}") for k, b in blocks
             if isinstance(b, a.ToolUseBlock)]
    thoughts = "\n".join(b.thinking for b in message.content if isinstance(b, a.ThinkingBlock))
    return [Message("assistant", _texts(texts) if texts or not calls else None, tool_calls=calls or None,
                    reasoning=thoughts or None)]


def _tool_choice(choice: a.ToolChoice) -> ToolChoice:
    """Anthropic's tool_choice in the chat request's words: any is required, tool names a function."""
    if isinstance(choice, a.ToolChoiceTool):
        return NamedTool(choice.name)
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]  # type: ignore[return-value]


def chat_request(body: a.MessagesPrompt) -> ChatRequest:
    """The chat request a Messages request means."""
    forced = isinstance(body.tool_choice, (a.ToolChoiceAny, a.ToolChoiceTool))
    thinks = body.thinking is not None and not isinstance(body.thinking, a.ThinkingDisabled)
    if forced and thinks:  # as Anthropic: a forced call starts at once, so nothing can think first
        raise ApiError(400, "thinking cannot be enabled while tool_choice forces a tool (any or tool)",
                       param="thinking")
    system = [Message("system", body.system if isinstance(body.system, str) else _texts(body.system))
              ] if body.system else []
    messages = system + [chat for n, message in enumerate(body.messages)
                         for chat in _message(message, f"messages.{n}")]
    continued = body.messages[-1].role == "assistant"  # Anthropic's prefill: the reply continues it
    tools = [Tool(t.name, t.description, t.input_schema, t.strict) for t in body.tools or []]
    choice = body.tool_choice
    parallel = not choice.disable_parallel_tool_use if choice is not None and not isinstance(
        choice, a.ToolChoiceNone) else True
    sampling: dict[str, Any] = {}
    if isinstance(body.thinking, a.ThinkingEnabled):
        sampling["thinking_token_budget"] = body.thinking.budget_tokens
    constraint, user, effort = None, None, None
    if isinstance(body, a.MessagesRequest):
        sampling.update(max_tokens=body.max_tokens, stop=body.stop_sequences, temperature=body.temperature,
                        top_p=body.top_p, top_k=body.top_k, priority=body.priority)
        if (schema := body.output_schema) is not None:
            constraint = Constraint.build("output_config.format", {"json": "output_config.format"}, json=schema)
        effort = body.output_config.effort if body.output_config else None
        if effort is not None and thinks and "thinking_token_budget" not in sampling:
            sampling["thinking_token_budget"] = a.EFFORT_BUDGETS[effort]
        user = body.metadata.user_id if body.metadata else None
    return ChatRequest(
        messages, model=body.model, tools=tools, tool_choice=None if choice is None else _tool_choice(choice),
        parallel_tool_calls=parallel, constraint=constraint,
        sampling={name: value for name, value in sampling.items() if value is not None},
        chat_template_kwargs=None if body.thinking is None else {"enable_thinking": thinks}, reasoning_effort=effort,
        add_generation_prompt=not continued, continue_final_message=continued,
        stream=isinstance(body, a.MessagesRequest) and body.stream, user=user, names=NAMES)


# ---------------------------------------------------------------- the answer, as Anthropic's

def stop_reason(choice: Choice | None) -> tuple[a.StopReason | None, str | None]:
    """Anthropic's stop_reason and stop_sequence for how the reply ended."""
    if choice is None or choice.finish_reason is None:
        return None, None
    if choice.finish_reason == "length":
        return "max_tokens", None
    if choice.parsed.tool_calls:
        return "tool_use", None
    if isinstance(choice.stop_reason, str):
        return "stop_sequence", choice.stop_reason
    return "end_turn", None


def _start_part(part_event: PartEvent) -> a.ContentBlockStart:
    part = part_event.part
    content: a.Content = (a.ThinkingContent(thinking="") if part.kind == "thinking" else
                          a.TextContent(text="") if part.kind == "text" else
                          a.ToolUseContent(id=part.call_id or "", name=part.name or "", input={}))
    return a.ContentBlockStart(index=part_event.index, content_block=content)


def _delta(part_event: PartEvent) -> a.ContentBlockDelta:
    kind, text = part_event.part.kind, part_event.text
    delta = (a.ThinkingDelta(thinking=text) if kind == "thinking" else a.TextDelta(text=text) if kind == "text"
             else a.InputJsonDelta(partial_json=text))
    return a.ContentBlockDelta(index=part_event.index, delta=delta)


def _input(arguments: str) -> dict[str, Any]:
    """A call's input (a call's arguments are whole JSON once it is kept)."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessagesFormat:
    """A Message, whole or as Anthropic's stream: message_start, ping, each content block's start, deltas and
    stop, message_delta (stop_reason, usage), message_stop; a failure is an error event."""

    def __init__(self, request_id: str, model: str) -> None:
        self.request_id, self.model = request_id, model
        self.started = False

    def _usage(self, gen: ResponseState) -> a.MessageUsage:
        thinking = gen.reasoning_tokens
        return a.MessageUsage(input_tokens=gen.prompt_tokens - gen.cached_tokens, output_tokens=gen.completion_tokens,
                       cache_read_input_tokens=gen.cached_tokens,
                       output_tokens_details=None if thinking is None else a.ThinkingTokensDetails(
                           thinking_tokens=thinking))

    def _message(self, gen: ResponseState, content: list[a.Content]) -> a.Message:
        reason, sequence = stop_reason(gen.choices.get(0))
        return a.Message(id=self.request_id, model=self.model, content=content, stop_reason=reason,
                         stop_sequence=sequence, usage=self._usage(gen))

    def _start(self, gen: ResponseState) -> list[str]:
        if self.started:
            return []
        self.started = True
        return [event(a.MessageStart(message=self._message(gen, []))), event(a.Ping())]

    def progress(self, progress: PromptProgress) -> list[str]:
        return []  # the API has no progress events

    def events(self, gen: ResponseState, choice: Choice, delta: CompletionOutput, piece: ParsedText,
               prompt_index: int) -> list[str]:
        out = self._start(gen)
        for part_event in choice.events:
            if part_event.kind == "start":
                out.append(event(_start_part(part_event)))
            elif part_event.kind == "delta":
                out.append(event(_delta(part_event)))
            else:
                if part_event.part.kind == "thinking":
                    out.append(event(a.ContentBlockDelta(index=part_event.index,
                                                         delta=a.SignatureDelta(signature=""))))
                out.append(event(a.ContentBlockStop(index=part_event.index)))
        return out

    def end(self, gen: ResponseState) -> list[str]:
        reason, sequence = stop_reason(gen.choices.get(0))
        return self._start(gen) + [event(a.MessageDelta(delta=a.StopDelta(stop_reason=reason, stop_sequence=sequence),
                                                        usage=self._usage(gen))), event(a.MessageStop())]

    def failure(self, gen: ResponseState, error: ApiError) -> list[str]:
        return [event(error_body(anthropic_status(error.status), error.message))]

    def response(self, gen: ResponseState) -> a.Message:
        choice = gen.choices.get(0)
        content: list[a.Content] = []
        for _, part in choice.parts.kept() if choice else []:
            if part.kind == "thinking":
                content.append(a.ThinkingContent(thinking=part.text))
            elif part.kind == "text":
                content.append(a.TextContent(text=part.text))
            else:
                content.append(a.ToolUseContent(id=part.call_id or "", name=part.name or "",
                                                input=_input(part.text)))
        return self._message(gen, content)


class Messages:
    def __init__(self, chats: ChatPath) -> None:
        self.chats = chats
        self.server = chats.server

    async def create(self, request: Request, key: str, body: a.MessagesRequest) -> Response:
        chat = chat_request(body)
        plan = await self.chats.plan(chat)
        fmt = MessagesFormat(new_item_id("msg"), self.server.model_name)
        return await self.chats.run(request, key, chat, plan, fmt)

    async def count_tokens(self, key: str, body: a.CountTokensRequest) -> Response:
        plan = await self.chats.plan(chat_request(body))
        self.server.gateway.charge_tokens(key, len(plan.chat.ids))
        return json_response(a.TokenCount(input_tokens=len(plan.chat.ids)))
