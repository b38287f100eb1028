"""The words of zhuzi's prefix-cache endpoints (/v1/cache/pins): pin a prefix under a name, list the pins,
delete one. zhuzi's own words (no other API pins prefixes), strict as everywhere else."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, model_validator

from zhuzi.server.common.schema import Response
from zhuzi.server.openai.protocol import ChatMessage, ChatTemplateRequest

PinName = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")]


class PinRequest(ChatTemplateRequest):
    """A prefix to keep: token ids, or chat messages rendered by the chat template (without the generation
    prompt, so that the chats that begin with them share its pages). Its full KV pages are pinned."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str | None = None
    name: PinName  # a pin under the same name is replaced
    token_ids: list[int] | None = Field(None, min_length=1)
    messages: list[ChatMessage] | None = Field(None, min_length=1)  # type: ignore[assignment]
    add_generation_prompt: bool = False
    ttl: float | None = Field(None, gt=0)  # seconds; none: until deleted

    @model_validator(mode="after")
    def _one_prefix(self) -> PinRequest:
        if (self.token_ids is None) == (self.messages is None):
            raise ValueError("give exactly one of token_ids and messages")
        return self


class CachePin(Response):
    object: Literal["cache.pin"] = "cache.pin"
    name: str
    num_tokens: int  # pinned: the tokens of its full KV pages
    num_blocks: int  # KV pages (the JSON name keeps vLLM's word)
    bytes: int  # of KV cache its pages hold (per replica)
    created_at: int  # Unix seconds
    expires_at: int | None  # none: until deleted
    cached_tokens: int  # of the prefix, found cached when it was pinned


class CachePinList(Response):
    object: Literal["list"] = "list"
    data: list[CachePin]


class CachePinDeleted(Response):
    object: Literal["cache.pin.deleted"] = "cache.pin.deleted"
    name: str
    deleted: bool = True
