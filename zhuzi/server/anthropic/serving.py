"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens), between the routes and the chat path.

A Messages request becomes the chat request it means (system, messages and content blocks, tools and
tool_choice, thinking, sampling) and runs the chat path unchanged: the same template, tool format, forced
calls through the same grammars, the same engine. Only the answer's shape is Anthropic's: MessagesFormat
writes the content blocks (thinking, text, tool_use) as a Message, or as the stream of events Anthropic
sends, and errors are Anthropic's error object with its status codes.

A tool_result with is_error reaches the model as its text after "Error: " (templates have no word for
it). A thought has no signature: zhuzi reads a thought sent back as it is.
"""
from __future__ import annotations

import json
from typing import Any

import pydantic
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from zhuzi.outputs import CompletionOutput, PromptProgress
from zhuzi.server.anthropic import protocol as a
from zhuzi.server.common.content_blocks import BlockEvent, new_item_id
from zhuzi.server.common.formats import Choice, ResponseState, sse_event
from zhuzi.server.common.parsers import ParsedText
from zhuzi.server.common.serving import ApiError, json_response
from zhuzi.server.openai import answers as r
from zhuzi.server.openai import protocol as p
from zhuzi.server.openai.serving import Completions, as_chat_request

# Anthropic's error types by status; 529 is its "overloaded" (a full queue, or a server that cannot serve now).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               529: "overloaded_error"}


# The chat request's fields under their Messages names, for the errors the chat path finds (see ApiError.renamed).
CHAT_NAMES = {r"^stop\b": "stop_sequences", r"^response_format\b.*": "output_config.format",
              r"^tools\.(\d+)\.function\.parameters": r"tools.\1.input_schema",
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


def error_response(status: int, message: str, code: str | int | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    status = anthropic_status(status, code)
    return JSONResponse(error_body(status, message).model_dump(), status_code=status, headers=headers)


def event(payload: pydantic.BaseModel) -> str:
    """One server-sent event, named by its type (Anthropic's SDK reads the name)."""
    return sse_event(payload.type, payload)  # type: ignore[attr-defined]


# ---------------------------------------------------------------- the request, as a chat request

def _texts(blocks: list[a.TextBlock]) -> list[dict[str, str]]:
    return [{"type": "text", "text": block.text} for block in blocks]


def _tool_result(block: a.ToolResultBlock) -> dict[str, Any]:
    content = block.content if isinstance(block.content, str) else "\n".join(b.text for b in block.content
                                                                             if isinstance(b, a.TextBlock))
    return {"role": "tool", "tool_call_id": block.tool_use_id,
            "content": f"Error: {content}" if block.is_error else content}


def _message(message: a.MessageParam) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user's tool results become tool messages (first, as
    Anthropic orders them), an assistant's tool_use blocks its tool calls and its thoughts its reasoning."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts = [b for b in message.content if isinstance(b, a.TextBlock)]
    if message.role == "user":
        results = [_tool_result(b) for b in message.content if isinstance(b, a.ToolResultBlock)]
        return results + ([{"role": "user", "content": _texts(texts)}] if texts or not results else [])
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
             for b in message.content if isinstance(b, a.ToolUseBlock)]
    thoughts = "\n".join(b.thinking for b in message.content if isinstance(b, a.ThinkingBlock))
    out: dict[str, Any] = {"role": "assistant", "content": _texts(texts) if texts or not calls else None}
    if calls:
        out["tool_calls"] = calls
    if thoughts:
        out["reasoning_content"] = thoughts
    return [out]


def _tool_choice(choice: a.ToolChoice) -> Any:
    """Chat's tool_choice for Anthropic's: any is required, tool names a function."""
    if isinstance(choice, a.ToolChoiceTool):
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def chat_request(body: a.MessagesPrompt) -> p.ChatCompletionRequest:
    """The chat request a Messages request means."""
    forced = isinstance(body.tool_choice, (a.ToolChoiceAny, a.ToolChoiceTool))
    thinks = body.thinking is not None and not isinstance(body.thinking, a.ThinkingDisabled)
    if forced and thinks:  # as Anthropic: a forced call starts at once, so nothing can think first
        raise ApiError(400, "thinking cannot be enabled while tool_choice forces a tool (any or tool)",
                       param="thinking")
    messages = [{"role": "system", "content": body.system if isinstance(body.system, str) else _texts(body.system)}
                ] if body.system else []
    for message in body.messages:
        messages += _message(message)
    continued = body.messages[-1].role == "assistant"  # Anthropic's prefill: the reply continues it
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "add_generation_prompt": not continued,
                            "continue_final_message": continued}
    if body.tools:
        chat["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.input_schema, "strict": t.strict}}
            for t in body.tools]
    if body.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(body.tool_choice)
        if not isinstance(body.tool_choice, a.ToolChoiceNone):
            chat["parallel_tool_calls"] = not body.tool_choice.disable_parallel_tool_use
    if body.thinking is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": thinks}
    if isinstance(body.thinking, a.ThinkingEnabled):
        chat["thinking_token_budget"] = body.thinking.budget_tokens
    if isinstance(body, a.MessagesRequest):
        chat.update(max_tokens=body.max_tokens, stop=body.stop_sequences, temperature=body.temperature,
                    top_p=body.top_p, top_k=body.top_k, stream=body.stream, priority=body.priority,
                    user=body.metadata.user_id if body.metadata else None)
        if (schema := body.output_schema) is not None:
            chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
        effort = body.output_config.effort if body.output_config else None
        if effort is not None and thinks and "thinking_token_budget" not in chat:
            chat["thinking_token_budget"] = a.EFFORT_BUDGETS[effort]
    return as_chat_request(chat, "messages")


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


def _start_block(block_event: BlockEvent) -> a.ContentBlockStart:
    block = block_event.block
    content: a.Content = (a.ThinkingContent(thinking="") if block.kind == "thinking" else
                          a.TextContent(text="") if block.kind == "text" else
                          a.ToolUseContent(id=block.call_id or "", name=block.name or "", input={}))
    return a.ContentBlockStart(index=block_event.index, content_block=content)


def _delta(block_event: BlockEvent) -> a.ContentBlockDelta:
    kind, text = block_event.block.kind, block_event.text
    delta = (a.ThinkingDelta(thinking=text) if kind == "thinking" else a.TextDelta(text=text) if kind == "text"
             else a.InputJsonDelta(partial_json=text))
    return a.ContentBlockDelta(index=block_event.index, delta=delta)


def _input(arguments: str) -> dict[str, Any]:
    """A call's input; a forced call cut short by max_tokens has unfinished JSON, and no input yet."""
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

    def chunks(self, gen: ResponseState, choice: Choice, delta: CompletionOutput, piece: ParsedText,
               prompt_index: int) -> list[str]:
        out = self._start(gen)
        for block_event in choice.events:
            if block_event.kind == "start":
                out.append(event(_start_block(block_event)))
            elif block_event.kind == "delta":
                out.append(event(_delta(block_event)))
            else:
                if block_event.block.kind == "thinking":
                    out.append(event(a.ContentBlockDelta(index=block_event.index,
                                                         delta=a.SignatureDelta(signature=""))))
                out.append(event(a.ContentBlockStop(index=block_event.index)))
        return out

    def end(self, gen: ResponseState) -> list[str]:
        reason, sequence = stop_reason(gen.choices.get(0))
        return self._start(gen) + [event(a.MessageDelta(delta=a.StopDelta(stop_reason=reason, stop_sequence=sequence),
                                                        usage=self._usage(gen))), event(a.MessageStop())]

    def failure(self, gen: ResponseState, error: r.ErrorInfo) -> list[str]:
        status = anthropic_status(int(error.code or 500))
        return [event(error_body(status, error.message))]

    def response(self, gen: ResponseState) -> a.Message:
        choice = gen.choices.get(0)
        content: list[a.Content] = []
        for block in choice.blocks.blocks if choice else []:
            if block.kind == "thinking":
                content.append(a.ThinkingContent(thinking=block.text))
            elif block.kind == "text":
                content.append(a.TextContent(text=block.text))
            else:
                content.append(a.ToolUseContent(id=block.call_id or "", name=block.name or "",
                                                input=_input(block.text)))
        return self._message(gen, content)


class Messages:
    def __init__(self, completions: Completions) -> None:
        self.completions = completions
        self.server = completions.server

    async def create(self, request: Request, key: str, body: a.MessagesRequest) -> Response:
        chat = chat_request(body)
        plan = await self.completions.plan_chat(chat, CHAT_NAMES)
        fmt = MessagesFormat(new_item_id("msg"), self.server.model_name)
        return await self.completions.run_chat(request, key, chat, plan, fmt)

    async def count_tokens(self, key: str, body: a.CountTokensRequest) -> Response:
        plan = await self.completions.plan_chat(chat_request(body), CHAT_NAMES)
        self.server.gateway.charge_tokens(key, len(plan.chat.ids))
        return json_response(a.TokenCount(input_tokens=len(plan.chat.ids)))

