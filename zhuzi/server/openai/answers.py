"""The answers of the HTTP step: OpenAI's response, chunk and error objects in pydantic.

They serialize to exactly the JSON that OpenAI clients parse, and are the OpenAPI spec's
answer schemas (see app.py).
"""
from __future__ import annotations

import time
from typing import Literal

from pydantic import Field

from zhuzi.server.common.schema import Response, _is_none


class PromptTokensDetails(Response):
    cached_tokens: int = 0


class CompletionTokensDetails(Response):
    reasoning_tokens: int = 0  # of the completion's tokens, those inside the thought


class Usage(Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = Field(None, exclude_if=_is_none)

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
           reasoning_tokens: int | None = None) -> Usage:
        """reasoning_tokens: None for a model that does not think."""
        details = None if reasoning_tokens is None else CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
                   completion_tokens_details=details)


class TopLogprob(Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(Response):
    content: list[TokenLogprob] | None = None

class FunctionCallOut(Response):
    name: str
    arguments: str


class ToolCallOut(Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatResponseMessage(Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = Field(None, exclude_if=_is_none)
    tool_calls: list[ToolCallOut] | None = Field(None, exclude_if=_is_none)


class ChatChoice(Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = Field(None, exclude_if=_is_none)
    draft_accepted: list[bool] | None = Field(None, exclude_if=_is_none)  # see ChatFormat.draft_marks
    drafts_rejected: list[list[int] | None] | None = Field(None, exclude_if=_is_none)


class ChatCompletionResponse(Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = Field(None, exclude_if=_is_none)


class DeltaFunction(Response):
    name: str | None = Field(None, exclude_if=_is_none)
    arguments: str | None = Field(None, exclude_if=_is_none)


class DeltaToolCall(Response):
    index: int
    id: str | None = Field(None, exclude_if=_is_none)
    type: Literal["function"] | None = Field(None, exclude_if=_is_none)
    function: DeltaFunction


class DeltaMessage(Response):
    role: Literal["assistant"] | None = Field(None, exclude_if=_is_none)
    content: str | None = Field(None, exclude_if=_is_none)
    reasoning_content: str | None = Field(None, exclude_if=_is_none)
    tool_calls: list[DeltaToolCall] | None = Field(None, exclude_if=_is_none)


class ChatChunkChoice(Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = Field(None, exclude_if=_is_none)
    token_ids: list[int] | None = Field(None, exclude_if=_is_none)  # this delta's, even when its text waits
    draft_accepted: list[bool] | None = Field(None, exclude_if=_is_none)  # see ChatFormat.draft_marks
    drafts_rejected: list[list[int] | None] | None = Field(None, exclude_if=_is_none)


class PromptProgress(Response):
    """llama.cpp's return_progress: how much of the prompt the engine has read (prefilled), before the
    first token; processed counts the tokens found in the prefix cache too."""

    prompt_tokens_processed: int
    prompt_tokens_total: int
    cached: int


class ChatCompletionChunk(Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(None, exclude_if=_is_none)
    prompt_token_ids: list[int] | None = Field(None, exclude_if=_is_none)  # on the first chunk
    prompt_progress: PromptProgress | None = Field(None, exclude_if=_is_none)  # return_progress, choices empty


class CompletionLogprobs(Response):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []



class PromptLogprob(Response):
    logprob: float
    rank: int
    decoded_token: str | None = None


class CompletionChoice(Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = Field(None, exclude_if=_is_none)
    # vLLM's: per prompt token (null for the first), token id -> its logprob; on a stream's first chunk
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(None, exclude_if=_is_none)


class CompletionResponse(Response):
    """A whole completion, or (object text_completion too) one streamed chunk of it."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = Field(None, exclude_if=_is_none)
    prompt_progress: PromptProgress | None = Field(None, exclude_if=_is_none)  # return_progress, choices empty


class RenderResponse(Response):
    """vLLM's /v1/chat/completions/render: the prompt a chat request makes, nothing generated."""

    model: str
    prompt: str  # the chat template's text
    token_ids: list[int]


class ModelCard(Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "zhuzi"
    root: str | None = None
    max_model_len: int | None = Field(None, exclude_if=_is_none)  # known once loaded
    # A server of many models: whether it is loaded, the bytes it holds loaded, why its last load failed.
    state: Literal["loaded", "loading", "unloaded"] | None = Field(None, exclude_if=_is_none)
    memory: int | None = Field(None, exclude_if=_is_none)
    error: str | None = Field(None, exclude_if=_is_none)


class ModelList(Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(Response):
    tokens: list[int]
    token_strs: list[str]
    count: int
    max_model_len: int


class DetokenizeResponse(Response):
    prompt: str


class Embedding(Response):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64: the little-endian float32 bytes


class EmbeddingUsage(Response):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(Response):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class ErrorInfo(Response):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(Response):
    error: ErrorInfo

