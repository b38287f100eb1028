"""Attention over the paged KV pool on CPU (model runner -> attention): decode rows, and prompt chunks.

Batched decoding reads every sequence's whole history each step, so this is a
memory-bandwidth problem: a small C++ kernel walks each sequence's slot list
and reads its keys and values straight from the pool, once, prefetching a few
positions ahead, with an online (flash-decoding style) softmax in float32. No
gathered copy is made: a tile of 32 positions' K and V rows of a kv head is
widened to float once for all of its query heads, which score 8 keys at a time.

Each row (with fewer rows than threads, each kv head of a row) is computed by
one thread with arithmetic that depends only on that row (its query, slots and
length), never on the batch around it, so a request decodes to the same bits
alone or in any batch.

Float32 queries may read a bf16 pool (dtype auto without native bf16: half the
bytes of a float32 pool), widened in registers; both read q8_0 pools
(--kv-cache-dtype q8_0, kv_format.py: a quarter of float32's bytes), each
vector of int8 widened and multiplied by its block's scale in registers.

A prompt chunk's queries are many and share their history, so there the
problem is compute and reuse: the prefill kernel takes a few consecutive query
positions of one head at a time (16 with AVX512-BF16, 3 vectors elsewhere), one
per vector lane, and walks their keys from position 0 in tiles of 32 (or as many
as its queries). Each K and V row it reads serves all of them at once: with bf16
and AVX512-BF16, scores
come from broadcasting the key's bf16 pairs against the queries' (vdpbf16ps)
and the probabilities meet V as bf16 pairs; elsewhere the tile's rows are
widened to float once and met with float FMAs. The online softmax runs per
lane in float32. Before, every prompt token re-read its whole history alone, as
a decode row does. A float32 pool keeps the per-token decode arithmetic for
prompts too (its results are the reference: the same bits whether a token was
prefilled or decoded).

The kernels (kernels/decode_attention.cpp, kernels/prefill_attention.cpp) are built per CPU variant and
loaded by native.py; they share torch's OpenMP thread pool. Without a compiler the caller's torch path runs.
"""
from __future__ import annotations

import ctypes

import torch

from zhuzi.model import native
from zhuzi.model.kv_format import Q8_0, head_width

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, Q8_0: 2}  # kernels/api.h's KVType


def _kernel():
    """The compiled entry point, or None when it cannot be built or loaded."""
    return native.entry("decode_attention", "zhuzi_decode_attention",
                        [ctypes.c_int] * 2 + [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 3
                        + [ctypes.c_int64, ctypes.c_float, ctypes.c_int64, ctypes.c_int])


def _pools(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """q's dtype against the pools': the same (float32 or bf16), float32 queries over bf16 pools, or either
    over q8_0 pools; pools of q's head_dim, contiguous."""
    dtypes = (k_cache.dtype == v_cache.dtype and q.dtype in (torch.float32, torch.bfloat16)
              and k_cache.dtype in _DTYPES and (q.dtype != torch.bfloat16 or k_cache.dtype != torch.float32))
    return (q.device.type == "cpu" and dtypes and k_cache.shape == v_cache.shape
            and k_cache.shape[2] == head_width(q.shape[-1], k_cache.dtype) and q.shape[1] % k_cache.shape[1] == 0
            and k_cache.is_contiguous() and v_cache.is_contiguous())


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slots: torch.Tensor, lengths: torch.Tensor, scale: float,
                           window: int | None = None) -> torch.Tensor | None:
    """One decode token per row attends over its first lengths[b] slots of the pool (with a sliding window,
    over the last `window` of them: the slots before are never read).

    q: [B, heads, dim] bf16 or float32; k_cache, v_cache: [slots, kv_heads, dim] contiguous, q's dtype (or
    bf16 under float32 queries), or q8_0 (kv_format.py); slots: [B, W] int64 (entries past a row's length are
    ignored); lengths: [B] int64 in 1..W. Query head h reads kv head h // (heads // kv_heads). Returns
    [B, heads, dim] in q's dtype, or None when this path cannot serve the call (the caller then uses its torch
    path).
    """
    b, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    fn = _kernel() if _pools(q, k_cache, v_cache) else None
    if fn is None:
        return None
    if slots.shape[0] != b or lengths.shape != (b,):
        raise ValueError(f"decode attention: {b} queries but slots {tuple(slots.shape)}, "
                         f"lengths {tuple(lengths.shape)}")
    q, slots, lengths = q.contiguous(), slots.contiguous().long(), lengths.contiguous().long()
    out = torch.empty_like(q)
    status = fn(_DTYPES[q.dtype], _DTYPES[k_cache.dtype], q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                slots.data_ptr(), lengths.data_ptr(), out.data_ptr(), b, slots.shape[1], heads, kv_heads, dim,
                k_cache.shape[0], scale, window or 0, torch.get_num_threads())
    if status == 1:
        raise IndexError("decode attention: a length is outside 1..W or a slot is outside the pool")
    return out if status == 0 else None


def _prefill_kernel():
    return native.entry("prefill_attention", "zhuzi_prefill_attention",
                        [ctypes.c_int] * 2 + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 3
                        + [ctypes.c_int64, ctypes.c_float, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                            scale: float, window: int | None = None) -> torch.Tensor | None:
    """A prompt chunk's causal attention over its whole history, in tiles (bf16 or q8_0 pools).

    q: [L, heads, dim] bf16 or float32, the queries of positions context - L .. context - 1; caches:
    [slots, kv_heads, dim] bf16 or q8_0 with the chunk's own K/V already written; slots: [context] int64, the
    pool slots of positions 0 .. context - 1 (with a sliding window, a query reads only its last `window`
    positions: the slots before the first query's window are never read). Returns [L, heads, dim] in q's dtype,
    or None when this path cannot serve the call."""
    length, heads, dim = q.shape
    usable = _pools(q, k_cache, v_cache) and k_cache.dtype != torch.float32 and 1 <= length <= slots.shape[0]
    fn = _prefill_kernel() if usable else None
    if fn is None:
        return None
    q, slots = q.contiguous(), slots.contiguous().long()
    out = torch.empty_like(q)
    status = fn(_DTYPES[q.dtype], _DTYPES[k_cache.dtype], q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                slots.data_ptr(), length, slots.shape[0], heads, k_cache.shape[1], dim, k_cache.shape[0], scale,
                window or 0, out.data_ptr(), torch.get_num_threads())
    if status == 1:
        raise IndexError("prefill attention: a slot is outside the pool")
    return out if status == 0 else None
