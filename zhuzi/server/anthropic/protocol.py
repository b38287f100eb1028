"""Anthropic's wire format in pydantic: the Messages requests, the answers, the stream's events and the error
object. Strict as everywhere (an unknown field is a 400 naming it); cache_control is accepted, since the prefix
cache keeps every prefix anyway. Also the OpenAPI spec's schemas for those routes.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, RootModel, model_validator

from zhuzi.server.common.schema import Request, Response, Text, _is_none, text_or

MIN_THINKING_BUDGET = 1024  # Anthropic's floor for thinking.budget_tokens
# Fields of the anthropic SDK's messages.create that zhuzi refuses, and why (any other unknown field is refused too).
UNSUPPORTED = {
    "container": "is not supported: zhuzi runs no code execution containers",
    "inference_geo": "is not supported: zhuzi runs where it was started",
    "diagnostics": "is not supported: zhuzi does not explain prefix-cache misses between requests",
    "mcp_servers": "is not supported: zhuzi connects to no MCP servers (run the tools in the client)",
}
# output_config.effort -> thinking_token_budget: a thinking model's thought ends after this many tokens (None: none).
EFFORT_BUDGETS = {"low": 1024, "medium": 4096, "high": 16384, "xhigh": None, "max": None}


# ---------------------------------------------------------------- requests

class CacheControl(Request):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(Request):
    type: Literal["text"]
    text: Text
    cache_control: CacheControl | None = None


class MediaBlock(Request):
    """An image or a document: refused, with a reason (zhuzi's models read text only)."""

    type: Literal["image", "document"]
    source: dict[str, Any]
    cache_control: CacheControl | None = None

    @model_validator(mode="after")
    def _refused(self) -> MediaBlock:
        raise ValueError(f"{self.type} blocks are not supported: zhuzi's models read text only")


class ToolUseBlock(Request):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(Request):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: text_or(Annotated[TextBlock | MediaBlock, Field(discriminator="type")]) = ""
    is_error: bool = False  # the model reads the result as an error (see serving.py)
    cache_control: CacheControl | None = None


class ThinkingBlock(Request):
    type: Literal["thinking"]
    thinking: Text
    signature: str


ContentBlock = Annotated[TextBlock | MediaBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock,
                         Field(discriminator="type")]


class MessageParam(Request):
    role: Literal["user", "assistant"]
    content: text_or(ContentBlock)

    @model_validator(mode="after")
    def _parts_by_role(self) -> MessageParam:
        kinds = {block.type for block in self.content} if isinstance(self.content, list) else set()
        wrong = kinds & ({"tool_use", "thinking"} if self.role == "user" else {"tool_result"})
        if wrong:
            raise ValueError(f"a {self.role} message cannot hold {' or '.join(sorted(wrong))} blocks")
        return self


class Tool(Request):
    type: Literal["custom"] | None = None  # server tools (web search, code execution) run at Anthropic's
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None  # true: its inputs always match input_schema (held to it by a grammar)
    cache_control: CacheControl | None = None


class ToolChoiceAuto(Request):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(Request):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(Request):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(Request):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")]


class ThinkingEnabled(Request):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=MIN_THINKING_BUDGET)  # at most this many tokens of thought, then the answer


class ThinkingAdaptive(Request):
    type: Literal["adaptive"]  # the model thinks as long as it likes


class ThinkingDisabled(Request):
    type: Literal["disabled"]


Thinking = Annotated[ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled, Field(discriminator="type")]


class JsonOutputFormat(Request):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")  # the reply is held to it by the grammar


class OutputConfig(Request):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


class Metadata(Request):
    user_id: str | None = None  # logged with the request, as chat's `user`


class MessagesPrompt(Request):
    """What makes the prompt: shared by /v1/messages and /v1/messages/count_tokens."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: text_or(TextBlock) | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    cache_control: CacheControl | None = None

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> MessagesPrompt:
        if isinstance(self.tool_choice, (ToolChoiceAny, ToolChoiceTool)) and not self.tools:
            raise ValueError(f"tool_choice {self.tool_choice.type} needs tools")
        if isinstance(self.tool_choice, ToolChoiceTool):
            names = {tool.name for tool in self.tools or []}
            if self.tool_choice.name not in names:
                raise ValueError(f"tool_choice names {self.tool_choice.name!r}, which is not among the tools "
                                 f"{sorted(names)}")
        return self


class MessagesRequest(MessagesPrompt):
    max_tokens: int
    stop_sequences: list[Annotated[Text, Field(min_length=1)]] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    metadata: Metadata | None = None
    stream: bool = False
    priority: int = 0  # vLLM's extension, as chat's (extra_body): lower is served first
    output_config: OutputConfig | None = None
    output_format: JsonOutputFormat | None = None  # the structured-outputs beta's name for output_config.format
    service_tier: Literal["auto", "standard_only"] | None = None  # zhuzi has one tier, the standard: both get it
    speed: Literal["standard"] | None = None  # "fast" is refused: zhuzi has no faster mode to switch to

    @model_validator(mode="after")
    def _budget_below_max_tokens(self) -> MessagesRequest:
        if isinstance(self.thinking, ThinkingEnabled) and self.thinking.budget_tokens >= self.max_tokens:
            raise ValueError("thinking.budget_tokens must be less than max_tokens")
        if self.output_format is not None and self.output_config is not None and self.output_config.format:
            raise ValueError("give the output format once: output_config.format or output_format")
        return self

    @property
    def output_schema(self) -> dict[str, Any] | None:
        fmt = self.output_format or (self.output_config.format if self.output_config else None)
        return fmt.schema_ if fmt is not None else None


class CountTokensRequest(MessagesPrompt):
    pass


# ---------------------------------------------------------------- answers

class TextContent(Response):
    type: Literal["text"] = "text"
    text: str


class ThinkingContent(Response):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # zhuzi does not sign thoughts: a thought sent back is read as it is


class ToolUseContent(Response):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


Content = Annotated[TextContent | ThinkingContent | ToolUseContent, Field(discriminator="type")]


class ThinkingTokensDetails(Response):
    thinking_tokens: int


class MessageUsage(Response):
    input_tokens: int  # not counting those read from the prefix cache, as Anthropic counts
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    output_tokens_details: ThinkingTokensDetails | None = Field(None, exclude_if=_is_none)


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Message(Response):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[Content]
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    usage: MessageUsage


class TokenCount(Response):
    input_tokens: int


class ErrorDetail(Response):
    type: str
    message: str


class AnthropicError(Response):
    type: Literal["error"] = "error"
    error: ErrorDetail


# ---------------------------------------------------------------- the stream's events

class MessageStart(Response):
    type: Literal["message_start"] = "message_start"
    message: Message


class ContentBlockStart(Response):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: Content


class TextDelta(Response):
    type: Literal["text_delta"] = "text_delta"
    text: str


class ThinkingDelta(Response):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class SignatureDelta(Response):
    type: Literal["signature_delta"] = "signature_delta"
    signature: str


class InputJsonDelta(Response):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ContentBlockDelta(Response):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: Annotated[TextDelta | ThinkingDelta | SignatureDelta | InputJsonDelta, Field(discriminator="type")]


class ContentBlockStop(Response):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class StopDelta(Response):
    stop_reason: StopReason | None
    stop_sequence: str | None = None


class MessageDelta(Response):
    type: Literal["message_delta"] = "message_delta"
    delta: StopDelta
    usage: MessageUsage


class MessageStop(Response):
    type: Literal["message_stop"] = "message_stop"


class Ping(Response):
    type: Literal["ping"] = "ping"


AnyEvent = Annotated[MessageStart | ContentBlockStart | ContentBlockDelta | ContentBlockStop | MessageDelta
                     | MessageStop | Ping | AnthropicError, Field(discriminator="type")]


class MessageStreamEvent(RootModel[AnyEvent]):
    """Any event of a stream: its SSE name is its type."""
