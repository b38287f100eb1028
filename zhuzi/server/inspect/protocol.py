"""The words of the inspector's own endpoints (/inspect/...): what the page asks the engine and what it gets.

zhuzi's words, not OpenAI's, so unknown fields are refused as everywhere else.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from zhuzi.server.common.schema import Request, Response, Text
from zhuzi.server.openai.protocol import ChatTemplateRequest
from zhuzi.server.pins.protocol import CachePin

MAX_CONTEXTS = 16
MAX_TOP_N = 1000
MAX_STEPS = 256
MAX_REQUEST_ID = 128
REQUEST_ID_PATTERN = r"[A-Za-z0-9_-]+"
TokenIds = Annotated[list[int], Field(min_length=1)]


class InspectRequest(Request):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str | None = None


class NextTokenRequest(InspectRequest):
    """The raw next-token logits at the end of each context (read at its last position)."""

    contexts: list[TokenIds] = Field(min_length=1, max_length=MAX_CONTEXTS)
    top_n: int = Field(300, ge=0, le=MAX_TOP_N)  # the best tokens listed with their text
    full_logits: bool = False  # also every logit, float32 little-endian, base64


class LogitLensRequest(InspectRequest):
    """Every layer's residual stream at the last of token_ids, read out through the final norm and LM head."""

    token_ids: TokenIds
    top_k: int = Field(5, ge=1, le=20)


class DocumentRequest(ChatTemplateRequest):
    """The document a chat request with these messages makes, each token with its author."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str | None = None


class BpeRequest(InspectRequest):
    """The tokenizer's byte-level BPE on text, merge by merge."""

    text: Text


class InspectToken(Response):
    id: int
    token: str  # its bytes as text (U+FFFD where they hold part of a character)
    bytes: list[int]


class NextTokenCandidate(InspectToken):
    logit: float
    logprob: float


class NextTokenResult(Response):
    position: int  # of the context's last token
    cached_tokens: int  # of the context, found in the prefix cache (the rest was computed again)
    top: list[NextTokenCandidate]
    logits_b64: str | None = None


class NextTokenResponse(Response):
    object: Literal["inspect.next_token"] = "inspect.next_token"
    vocab_size: int
    results: list[NextTokenResult]


class LensCandidate(InspectToken):
    logprob: float


class LensRow(Response):
    layer: int  # 0: after the first layer; the last row is the model's output
    top: list[LensCandidate]


class LogitLensResponse(Response):
    object: Literal["inspect.logit_lens"] = "inspect.logit_lens"
    position: int
    cached_tokens: int
    token: InspectToken  # the input token at that position
    layers: list[LensRow]


class DocumentToken(InspectToken):
    author: Literal["template", "system", "developer", "user", "assistant", "tool"]
    special: bool  # a control token (only the template's own markers are)


class DocumentResponse(Response):
    object: Literal["inspect.document"] = "inspect.document"
    text: str
    token_ids: list[int]  # the prompt a chat request with these messages reads
    tokens: list[DocumentToken]
    # With tools: "template" when the chat template writes them, "generic" when it ignores them and zhuzi's
    # generic tool prompt goes into the system message; None without tools.
    tool_prompt: Literal["template", "generic"] | None = None


class BpeWord(Response):
    text: str
    pieces: list[InspectToken]  # before any merge: one per byte


class BpeStep(Response):
    rank: int  # the rule's line in the merges list
    pair: tuple[str, str]  # as the merges list writes it (the byte alphabet)
    merged: InspectToken
    at: list[tuple[int, int]]  # (word, piece index before this step) where it applied


class BpeResponse(Response):
    object: Literal["inspect.bpe"] = "inspect.bpe"
    words: list[BpeWord]
    steps: list[BpeStep]  # lowest rank first
    token_ids: list[int]  # after the last step
    tokenizer_token_ids: list[int]  # what the tokenizer itself gives


class EngineModel(Response):
    name: str
    architecture: str
    dtype: str  # activations, and the weights' and KV cache's where they differ: "float32 (weights and KV bfloat16)"
    cpu_kernels: dict[str, str]  # "variant" (avx512, avx2-vnni, avx2, neon-i8mm, neon, generic, torch), then
    # per operation
    bytes_per_value: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_model_len: int
    kv_bytes_per_token: int  # 2 x layers x KV heads x head dim x bytes per value
    weight_bytes_per_decode_step: int
    eos_token_ids: list[int]
    special_token_ids: list[int]


class EngineKV(Response):
    """The KV pool; its JSON names say "blocks" (vLLM's word) for KV pages, as the inspector's script reads them."""

    block_size: int
    num_blocks: int
    used_blocks: int
    free_blocks: int  # a free page may still hold a cached prefix: it is reusable
    cached_blocks: int
    capacity_tokens: int
    pool_bytes: int


class EngineTenant(Response):
    key: str | None  # the API key's masked id (never the key); None on a server without keys
    running: int
    waiting: int


class EngineRequests(Response):
    running: int  # sequences, inspections included
    waiting: int
    tenants: list[EngineTenant]  # the same per API key, for those with sequences in the engine


class EnginePrefixCache(Response):
    queries: int  # prompt tokens looked up
    hits: int
    hit_rate: float | None


class EngineStep(Response):
    index: int  # steps since the engine started
    age_s: float
    duration_s: float
    prefill_tokens: int
    decode_tokens: int  # rows that decoded one token
    verify_tokens: int  # speculative verification: drafts and one position each
    kv_tokens_read: int  # context tokens the decodes attended to


class EngineSettings(Response):
    deterministic: bool  # --deterministic: answers do not depend on the batch
    speculative_method: str | None  # --speculative-config's method, or None
    num_speculative_tokens: int


class EngineRoofline(Response):
    read_bandwidth_bytes_per_s: float  # measured on this machine
    decode_step_floor_s: float  # the weights of one decode step read at that bandwidth


class EngineKVTier(Response):
    tier: Literal["host", "disk"]
    blocks: int
    bytes: int
    hit_tokens: int  # prompt tokens loaded from it instead of computed
    stored: int  # pages put into it
    evicted: int  # pages it let go to make room
    refused: int  # files skipped: corrupt or foreign


class EnginePins(Response):
    blocks: int  # KV pages of the pool, held by pins
    bytes: int
    limit_bytes: int  # --kv-pinned-memory
    pins: list[CachePin]


class EngineTransfers(Response):
    """Prefill/decode hand-offs (--kv-role): requests whose KV pages this replica sent or received."""

    sent: int
    received: int
    failed: int  # never arrived: the decode replica computed the prompt itself
    blocks_sent: int
    blocks_received: int


class EngineResponse(Response):
    object: Literal["inspect.engine"] = "inspect.engine"
    model: EngineModel
    kv: EngineKV
    requests: EngineRequests
    prefix_cache: EnginePrefixCache
    kv_tiers: list[EngineKVTier]  # the ones configured (--kv-offload-memory, --kv-offload-dir)
    pins: EnginePins
    kv_transfers: EngineTransfers
    steps: list[EngineStep]  # oldest first
    roofline: EngineRoofline
    settings: EngineSettings


class BatchRow(Response):
    """One sequence's share of a step. Request ids are never shown: only the caller's own is marked."""

    request: int  # the requests of one answer numbered 0, 1, ... in order of first appearance
    yours: bool  # a sequence of the request_id the call named
    kind: Literal["prefill", "decode", "verify"]
    tokens: int  # tokens whose K/V the step computed for it
    context: int  # tokens its last one attended to
    drafts: int  # verify: draft tokens checked
    accepted: int  # verify: of those, accepted


class BatchStep(Response):
    index: int
    age_s: float
    duration_s: float
    prefill_tokens: int
    decode_rows: int
    verify_tokens: int
    rows: list[BatchRow]  # in the step's order


class BatchResponse(Response):
    object: Literal["inspect.batch"] = "inspect.batch"
    steps: list[BatchStep]  # oldest first
