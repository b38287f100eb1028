"""Attention over the paged KV cache (decoder -> every layer): CPU kernels (cpu_attention.py) or torch.

Every token of a step lives in one flat batch: the first `num_decode_tokens` are decodes (one token per
sequence), attended in one batch; the rest are prefill chunks, one sequence at a time. The pool stores keys and
values per slot (page * page_size + offset), reached through each sequence's slot list. Which path serves
decodes and prompt chunks is chosen once per model and pool (select()). A sliding-window layer
(ModelConfig.window) attends each token's last `window` positions; slots before a row's window are never read.
A layer with attention sinks (gpt-oss) has a learned logit per head that joins each softmax denominator and adds
no value, in every path.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache, cached_property

import torch
import torch.nn.functional as F

from zhuzi.model import cpu_attention, native
from zhuzi.model.kv_format import Q8_0, from_pool, to_pool
from zhuzi.model.recurrent import StateRun


@dataclass
class PrefillChunk:
    start: int  # first row of this chunk in the flat batch
    length: int  # query tokens in this chunk
    context: int  # tokens attended: cached prefix + this chunk
    slots: torch.Tensor  # [context] pool slots of the whole context

    @cached_property  # built once a step, read by every layer
    def query_slots(self) -> torch.Tensor:
        """[length, context]: each query token reads the same history, up to its own position."""
        return self.slots.expand(self.length, -1).contiguous()

    @cached_property
    def query_lengths(self) -> torch.Tensor:
        return torch.arange(self.context - self.length + 1, self.context + 1, device=self.slots.device)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens] where each new token's K/V is written
    num_decode_tokens: int
    decode_slots: torch.Tensor  # [decodes, longest context] pool slots, padded
    decode_lengths: torch.Tensor  # [decodes] context length of each decode
    prefills: list[PrefillChunk]
    state_runs: list[StateRun] = field(default_factory=list)  # a hybrid model's sequences in the state pool

    def to(self, device: torch.device) -> AttentionMetadata:
        """The same step's metadata on another device (the other side of a layer split)."""
        chunks = [PrefillChunk(c.start, c.length, c.context, c.slots.to(device)) for c in self.prefills]
        return AttentionMetadata(self.slot_mapping.to(device), self.num_decode_tokens, self.decode_slots.to(device),
                                 self.decode_lengths.to(device), chunks, self.state_runs)


def prefix_causal_mask(length: int, context: int, window: int | None = None) -> torch.Tensor:
    """Query i (at position context - length + i) sees every key up to its own position (the last `window`
    of them with a sliding window)."""
    rows = torch.arange(length)[:, None] + (context - length)
    cols = torch.arange(context)[None, :]
    return (cols <= rows) & (cols > rows - window) if window else cols <= rows


@dataclass(frozen=True)
class AttentionBackend:
    """Which path attends a model's decode rows ("kernel" or "torch") and its prompt chunks ("kernel", "decode
    kernel": each query a decode row, the reference's arithmetic, or "torch")."""

    decode: str
    prefill: str


@cache
def select(device: str, q_dtype: torch.dtype, kv_dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
           prefill_kernel: bool = True, variant: str | None = None) -> AttentionBackend:
    """The backend for a model's queries over its pool, by what the CPU's kernels serve (variant: the process's
    kernels, part of the key). Without prefill_kernel (--deterministic) prompt chunks get a decode row's
    arithmetic; a float32 pool is the reference, where they do too."""
    if device != "cpu" or (variant or native.current()) == "torch":
        return AttentionBackend("torch", "torch")
    shape = (q_dtype, kv_dtype, heads, kv_heads, head_dim)
    decode = "kernel" if cpu_attention.decode_serves(*shape) else "torch"
    if prefill_kernel and cpu_attention.prefill_serves(*shape):
        return AttentionBackend(decode, "kernel")
    return AttentionBackend(decode, "decode kernel" if decode == "kernel" else "torch")


def paged_attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, prefill_kernel: bool = True, window: int | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [tokens, heads, dim]; k, v: [tokens, kv_heads, dim], written to the caches first (None: a layer that
    attends an earlier layer's K/V, written this step already); caches: [slots, kv_heads, dim]. Without
    prefill_kernel, prompt chunks get a decode row's arithmetic (--deterministic); window: the layer's
    sliding window (None: the whole context); sinks: [heads] float32 sink logits (None: no sinks)."""
    backend = select(q.device.type, q.dtype, k_cache.dtype, q.shape[1], k_cache.shape[1], q.shape[2],
                     prefill_kernel, native.current())
    if k is not None:
        k_cache.index_copy_(0, meta.slot_mapping, to_pool(k, k_cache.dtype))
        v_cache.index_copy_(0, meta.slot_mapping, to_pool(v, v_cache.dtype))
    out = torch.empty_like(q)
    n = meta.num_decode_tokens
    if n:
        out[:n] = _decode_attention(q[:n], k_cache, v_cache, meta, window, sinks, backend)
    for chunk in meta.prefills:
        rows = slice(chunk.start, chunk.start + chunk.length)
        out[rows] = _prefill_attention(q[rows], k, v, k_cache, v_cache, chunk, window, sinks, backend)
    return out


def _prefill_attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, chunk: PrefillChunk, window: int | None, sinks: torch.Tensor | None,
                       backend: AttentionBackend) -> torch.Tensor:
    """A prompt chunk is a batch of queries that each read the history up to their own position. The prefill
    kernel reads each K/V row once for many queries; the decode kernel serves each query with a decode step's
    own arithmetic (the reference: a token's K/V are the same bits whether it was prefilled or decoded)."""
    scale = q.shape[-1] ** -0.5
    if backend.prefill == "kernel":
        return cpu_attention.paged_prefill_attention(q, k_cache, v_cache, chunk.slots, scale, window, sinks)
    if backend.prefill == "decode kernel":
        return cpu_attention.paged_decode_attention(q, k_cache, v_cache, chunk.query_slots, chunk.query_lengths,
                                                    scale, window, sinks)
    if chunk.context == chunk.length and not window and k_cache.dtype != Q8_0 and k is not None:
        rows = slice(chunk.start, chunk.start + chunk.length)  # the chunk's K/V is the context
        keys, values, mask = _compute_dtype(k[rows]), _compute_dtype(v[rows]), None
    else:
        keys, values = _gather(k_cache, chunk.slots), _gather(v_cache, chunk.slots)
        mask = prefix_causal_mask(chunk.length, chunk.context, window).to(q.device)
    return _sdpa(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), mask, sinks).transpose(0, 1)


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                      window: int | None, sinks: torch.Tensor | None, backend: AttentionBackend) -> torch.Tensor:
    if backend.decode == "kernel":
        return cpu_attention.paged_decode_attention(q, k_cache, v_cache, meta.decode_slots, meta.decode_lengths,
                                                    q.shape[-1] ** -0.5, window, sinks)
    # The portable path (CUDA, or no compiler): gather each history, then torch's attention.
    b, width = meta.decode_slots.shape
    keys = _gather(k_cache, meta.decode_slots.reshape(-1)).view(b, width, -1, q.shape[-1]).transpose(1, 2)
    values = _gather(v_cache, meta.decode_slots.reshape(-1)).view(b, width, -1, q.shape[-1]).transpose(1, 2)
    positions, lengths = torch.arange(width, device=q.device), meta.decode_lengths[:, None]
    mask = (positions < lengths) & (positions >= lengths - window) if window else positions < lengths
    mask = mask[:, None, None]
    return _sdpa(q[:, :, None], keys, values, mask, sinks)[:, :, 0]


def _compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """On CPU, torch's bf16 attention kernel is several times slower than its float32 one at
    these shapes, so attention runs in float32 (converted while still contiguous: cheap)."""
    return x.float() if x.device.type == "cpu" else x


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    # index_select is a plain memcpy per row; advanced indexing is many times slower on CPU. Slots of pages a
    # sliding window gave back are negative: zeros stand in for them (the mask hides them; what their page
    # holds now might be anything).
    rows = _compute_dtype(from_pool(cache.index_select(0, slots.clamp(min=0))))
    return rows.masked_fill_((slots < 0)[:, None, None], 0)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [..., heads, queries, dim], k and v: [..., kv_heads, keys, dim]; causal when mask is None."""
    if sinks is not None:
        k, v, mask = _sink_key(q, k, v, mask, sinks)
    out = F.scaled_dot_product_attention(q.to(k.dtype), k, v, attn_mask=mask, is_causal=mask is None,
                                         enable_gqa=True)
    return out.to(q.dtype)


def _sink_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention sinks as one more key: a zero key and value whose score the mask sets to each head's sink
    logit, so it joins the softmax denominator and adds nothing to the output."""
    queries, keys = q.shape[-2], k.shape[-2]
    if mask is None:
        mask = torch.ones(queries, keys, dtype=torch.bool, device=q.device).tril(keys - queries)
    zero = k.new_zeros(*k.shape[:-2], 1, k.shape[-1])
    bias = torch.zeros(mask.shape, dtype=k.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    bias = bias.expand(*bias.shape[:-3], q.shape[-3], queries, keys)
    sink = sinks.to(k.dtype)[:, None, None].expand(*bias.shape[:-1], 1)
    return torch.cat([k, zero], -2), torch.cat([v, zero], -2), torch.cat([bias, sink], -1)
