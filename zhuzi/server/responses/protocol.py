"""The words of OpenAI's Responses API (/v1/responses) in pydantic: the request and its input items, the
Response object and its output items, the stream's events; the answer's are those of the Open Responses
specification (openresponses.org), which writes every field a Response carries.

As everywhere, types are strict and every declared field does something; UNSUPPORTED says why some of
OpenAI's other fields are refused. These models are also the OpenAPI spec's schemas for those routes.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, RootModel, Tag, field_validator, model_validator

from zhuzi.server.common.schema import Request, Response, Text, _is_none, text_or
from zhuzi.server.openai.answers import TokenLogprob
from zhuzi.server.openai.protocol import CacheRetention, JsonSchemaFormat

UNSUPPORTED = {
    "conversation": "is not supported: continue a conversation with previous_response_id",
    "prompt": "(a stored prompt template) is not supported",
    "prompt_cache_options": "is not supported: zhuzi's prefix cache keeps what it can, matched by the tokens",
    "context_management": "is not supported: zhuzi does not compact a conversation",
    "background_options": "is not supported: it goes with background, which zhuzi does not run",
    "moderation": "is not supported: zhuzi runs no moderation model",
    "image": "(image options) is not supported: zhuzi's models write text only",
    "access_programs": "(OpenAI's domain-specific access programs) is not supported",
}
# include: what zhuzi adds to an answer for each value it honours; the others name tools and parts it refuses.
INCLUDES = ("message.output_text.logprobs", "reasoning.encrypted_content")
NO_INCLUDE = {"file_search_call.results": "file_search", "web_search_call.results": "web_search",
              "web_search_call.action.sources": "web_search", "code_interpreter_call.outputs": "code_interpreter",
              "computer_call_output.output.image_url": "computer_use", "message.input_image.image_url": "input_image"}
# reasoning.effort -> thinking_token_budget: a thinking model's thought ends after this many tokens.
EFFORT_BUDGETS = {"minimal": 256, "low": 1024, "medium": 4096, "high": 16384}
MAX_METADATA = 16


# ---------------------------------------------------------------- the request

class InputText(Request):
    type: Literal["input_text"]
    text: Text


class OutputTextPart(Request):
    type: Literal["output_text"]
    text: Text
    annotations: list[dict[str, Any]] = Field(default_factory=list, max_length=0)  # zhuzi writes none
    logprobs: list[dict[str, Any]] | None = None  # an earlier answer's, sent back with it: the prompt is the text


class MediaPart(Request):
    type: Literal["input_image", "input_file", "input_audio"]

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, value: Any) -> Any:
        kind = value.get("type", "") if isinstance(value, dict) else ""
        raise ValueError(f"{kind} parts are not supported: zhuzi's models read text only")


ContentPart = Annotated[InputText | OutputTextPart | MediaPart, Field(discriminator="type")]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


class MessageItem(Request):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: text_or(ContentPart)
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallItem(Request):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(Request):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: Text
    id: str | None = None
    status: ItemStatus | None = None


class ReasoningText(Request):
    type: Literal["reasoning_text", "summary_text"]
    text: Text


class ReasoningItem(Request):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: Text | None = None  # zhuzi's own: the thought itself, not encrypted (see INCLUDES)
    status: ItemStatus | None = None


def _item_type(value: Any) -> str:
    """An item's type; a message may leave it out (OpenAI's "easy" input message)."""
    return value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "")


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[ReasoningItem, Tag("reasoning")], Discriminator(_item_type)]


class FunctionTool(Request):
    type: str  # checked first, so that another kind of tool is refused for what it is
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("type")
    @classmethod
    def _function_tools_only(cls, kind: str) -> str:
        if kind != "function":
            raise ValueError(f"{kind} tools are not supported: zhuzi offers function tools (the client runs them)")
        return kind


class NamedFunctionTool(Request):
    type: Literal["function"]
    name: str


class TextFormat(Request):
    """text.format: OpenAI's flat json_schema (name, schema, strict beside type)."""

    model_config = ConfigDict(**Request.model_config, serialize_by_alias=True)  # "schema", as OpenAI spells it

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("a json_schema format needs name and schema")
        if self.type != "json_schema" and (self.name, self.schema_, self.strict) != (None, None, None):
            raise ValueError("name, schema and strict go only with type json_schema")
        if self.name is not None:
            JsonSchemaFormat(name=self.name)  # OpenAI's rule for the name
        return self


class TextConfig(Request):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None

    @field_validator("verbosity")
    @classmethod
    def _medium_only(cls, verbosity: str | None) -> str | None:
        if verbosity not in (None, "medium"):
            raise ValueError(f"{verbosity} is not supported: zhuzi's models have no verbosity control (medium, "
                             "the default, is how they answer)")
        return verbosity


class ReasoningConfig(Request):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # The reasoning comes whole, as the reasoning item's content, more than any summary; summary stays [].
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # summary's old name


class StreamOptions(Request):
    include_obfuscation: bool | None = None

    @field_validator("include_obfuscation")
    @classmethod
    def _not_padded(cls, obfuscation: bool | None) -> bool | None:
        if obfuscation:
            raise ValueError("true is not supported: zhuzi does not pad its stream's deltas (set it to false)")
        return obfuscation


class ResponsesRequest(Request):
    model: str | None = None
    input: text_or(InputItem, min_parts=1)
    instructions: Text | None = None  # a system message for this turn only (a follow-up does not inherit it)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionTool | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    presence_penalty: float | None = None  # checked by the engine's sampling, as chat's
    frequency_penalty: float | None = None
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        None, max_length=MAX_METADATA)  # OpenAI's limits: 16 pairs, keys of 64 characters, values of 512
    store: bool = True  # kept for GET, input_items and a later previous_response_id
    previous_response_id: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None  # logged with the request, as chat's
    safety_identifier: str | None = Field(None, max_length=64)  # logged with the request, as user
    prompt_cache_key: str | None = None  # echoed: the prefix cache matches a prompt by its tokens, whatever the key
    prompt_cache_retention: CacheRetention = None
    service_tier: Literal["auto", "default", "flex", "priority", "scale"] | None = None
    priority: int = 0  # vLLM's extension, as chat's (extra_body): lower is served first
    background: bool = False  # false, what zhuzi does, as Open Responses clients may send it
    max_tool_calls: int | None = None  # null (no limit), likewise

    @field_validator("include")
    @classmethod
    def _includes_zhuzi_has(cls, include: list[str] | None) -> list[str] | None:
        for value in include or []:
            if value in NO_INCLUDE:
                raise ValueError(f"{value} is not supported: zhuzi has no {NO_INCLUDE[value]}")
            if value not in INCLUDES:
                raise ValueError(f"{value!r} is not a value zhuzi knows (it honours {', '.join(INCLUDES)})")
        return include

    @field_validator("background")
    @classmethod
    def _in_the_foreground(cls, background: bool) -> bool:
        if background:
            raise ValueError("true is not supported: a response runs while its request waits (or streams)")
        return background

    @field_validator("max_tool_calls")
    @classmethod
    def _no_call_limit(cls, limit: int | None) -> int | None:
        if limit is not None:
            raise ValueError("a limit is not supported: tool_choice and parallel_tool_calls say how many calls a "
                             "reply makes (null: no limit)")
        return limit

    @field_validator("truncation")
    @classmethod
    def _no_auto_truncation(cls, truncation: str | None) -> str | None:
        if truncation == "auto":
            raise ValueError("auto is not supported: a conversation longer than the context window is refused "
                             "(400), as with disabled")
        return truncation

    @field_validator("service_tier")
    @classmethod
    def _tiers_zhuzi_has(cls, tier: str | None) -> str | None:
        if tier == "scale":
            raise ValueError("scale is not supported: zhuzi has no reserved capacity (auto, default, flex, priority)")
        return tier

    @property
    def logprobs(self) -> bool:
        return "message.output_text.logprobs" in (self.include or [])

    @property
    def encrypted_reasoning(self) -> bool:
        return "reasoning.encrypted_content" in (self.include or [])

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> ResponsesRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs include message.output_text.logprobs")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, NamedFunctionTool) and self.tool_choice.name not in {
                tool.name for tool in self.tools or []}:
            raise ValueError(f"tool_choice names {self.tool_choice.name!r}, which is not among the tools")
        return self


# ---------------------------------------------------------------- the Response object

class OutputText(Response):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: list[TokenLogprob] | None = Field(None, exclude_if=_is_none)  # include message.output_text.logprobs


class OutputMessage(Response):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class ReasoningContent(Response):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningOutput(Response):
    id: str
    type: Literal["reasoning"] = "reasoning"
    status: ItemStatus
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[ReasoningContent]
    encrypted_content: str | None = Field(None, exclude_if=_is_none)  # include reasoning.encrypted_content


class FunctionCallOutput(Response):
    id: str
    type: Literal["function_call"] = "function_call"
    status: ItemStatus
    call_id: str
    name: str
    arguments: str


OutputItem = Annotated[OutputMessage | ReasoningOutput | FunctionCallOutput, Field(discriminator="type")]


class InputTokensDetails(Response):
    cached_tokens: int  # of the input, found in the prefix cache
    cache_write_tokens: int  # of the input, newly kept in the prefix cache (its whole KV pages)


class ReasoningTokensDetails(Response):
    reasoning_tokens: int


class ResponseUsage(Response):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: ReasoningTokensDetails
    total_tokens: int


class ResponseError(Response):
    code: str
    message: str


class IncompleteDetails(Response):
    reason: str  # max_output_tokens, or the engine's finish reason (abort: the server ended it, as on a timeout)


class PlainFormat(Response):
    type: Literal["text", "json_object"]


class SchemaFormat(Response):
    model_config = ConfigDict(serialize_by_alias=True)

    type: Literal["json_schema"] = "json_schema"
    name: str
    description: str | None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool  # whether the schema's objects were closed (additionalProperties false)


class TextUsed(Response):
    """text as a Response reports it: the format the reply was held to (plain text unless one was asked)."""

    format: PlainFormat | SchemaFormat
    verbosity: Literal["medium"] = "medium"  # the only one zhuzi's models have


ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed"]


class ResponseObject(Response):
    """Every field the Open Responses specification requires, each as this response was run: the sampling
    values are the engine's, after its defaults."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None  # only a completed response has it
    status: ResponseStatus
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None  # None: up to the context window
    max_tool_calls: None = None  # no limit (a request's limit is refused)
    metadata: dict[str, str] = Field(default_factory=dict)
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    reasoning: ReasoningConfig | None = None
    store: bool
    background: Literal[False] = False  # a response runs while its request waits (true is refused)
    temperature: float
    top_p: float
    presence_penalty: float
    frequency_penalty: float
    top_logprobs: int  # the alternatives given per token (0 unless include asks for logprobs)
    text: TextUsed
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionTool
    tools: list[FunctionTool]
    truncation: Literal["disabled"] = "disabled"
    service_tier: Literal["default", "flex", "priority"] = "default"
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = Field(None, exclude_if=_is_none)
    safety_identifier: str | None = None
    usage: ResponseUsage | None = None
    user: str | None = Field(None, exclude_if=_is_none)


class DeletedResponse(Response):
    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True


class InputItemList(Response):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]]  # the input items as stored, each with its id
    first_id: str | None
    last_id: str | None
    has_more: bool


# ---------------------------------------------------------------- the stream's events

class Event(Response):
    sequence_number: int = 0  # numbered as it goes out


class ResponseEvent(Event):
    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete",
                  "response.failed"]
    response: ResponseObject


class ItemEvent(Event):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class ItemEventBase(Event):
    item_id: str
    output_index: int


class ContentEvent(ItemEventBase):
    content_index: int = 0  # zhuzi's items hold one part


class ContentPartEvent(ContentEvent):
    type: Literal["response.content_part.added", "response.content_part.done"]
    part: OutputText | ReasoningContent


class TextDeltaEvent(ContentEvent):
    type: Literal["response.output_text.delta", "response.reasoning.delta"]
    delta: str
    logprobs: list[TokenLogprob] | None = Field(None, exclude_if=_is_none)  # output_text's: [] unless included


class TextDoneEvent(ContentEvent):
    type: Literal["response.output_text.done", "response.reasoning.done"]
    text: str
    logprobs: list[TokenLogprob] | None = Field(None, exclude_if=_is_none)


class ArgumentsDeltaEvent(ItemEventBase):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    delta: str


class ArgumentsDoneEvent(ItemEventBase):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    arguments: str  # the call's name is on its item (output_item.added and .done)


class ResponseStreamEvent(RootModel[ResponseEvent | ItemEvent | ContentPartEvent | TextDeltaEvent | TextDoneEvent
                            | ArgumentsDeltaEvent | ArgumentsDoneEvent]):
    """Any event of a stream: its SSE name is its type."""
