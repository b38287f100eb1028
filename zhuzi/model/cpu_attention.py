"""Attention over the paged KV pool on CPU (attention.py -> kernels/decode_attention.cpp and
prefill_attention.cpp): decode rows, each reading its history straight from the pool, and prompt chunks, whose
queries share each K/V row they read. A row's result never depends on the batch around it. What each kernel
serves is declared here (decode_serves, prefill_serves) for attention.py's choice at load; docs/cpu.md has
the design.
"""
from __future__ import annotations

import ctypes

import torch

from zhuzi.model import native
from zhuzi.model.kv_format import Q8_0, head_width

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, Q8_0: 2}  # kernels/api.h's KVType
_QUERIES = (torch.float32, torch.bfloat16)
HEAD_DIMS = (32, 64, 96, 128, 256)  # the head sizes the kernels are built for
BF16_PREFILL_HEAD_DIMS = (32, 64, 96, 128)  # the AVX512-BF16 prefill kernel's (bf16 queries over a bf16 pool)
MAX_HEADS, MAX_WIDTH = 128, 8192  # kernels/attention.h: a decode row's query heads, heads * head_dim


def _kernel():
    """The compiled entry point, or None when it cannot be built or loaded."""
    return native.entry("decode_attention", "zhuzi_decode_attention",
                        [ctypes.c_int] * 2 + [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 3
                        + [ctypes.c_int64, ctypes.c_float, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int])


def _prefill_kernel():
    return native.entry("prefill_attention", "zhuzi_prefill_attention",
                        [ctypes.c_int] * 2 + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 3
                        + [ctypes.c_int64, ctypes.c_float, ctypes.c_int64] + [ctypes.c_void_p] * 2 + [ctypes.c_int])


def decode_serves(q_dtype: torch.dtype, kv_dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the decode kernel serves queries of q_dtype over a pool of kv_dtype (the same float, bf16 under
    float32 queries, or q8_0) for this many heads."""
    dtypes = q_dtype in _QUERIES and kv_dtype in _DTYPES and (q_dtype, kv_dtype) != (torch.bfloat16, torch.float32)
    shape = head_dim in HEAD_DIMS and heads % kv_heads == 0 and heads <= MAX_HEADS and heads * head_dim <= MAX_WIDTH
    return dtypes and shape and _kernel() is not None


def prefill_serves(q_dtype: torch.dtype, kv_dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the prefill kernel serves prompt chunks of q_dtype over a bf16 or q8_0 pool (a float32 pool is
    the reference: each query a decode row)."""
    bf16 = (q_dtype, kv_dtype) == (torch.bfloat16, torch.bfloat16) and native.native_bf16()
    dims = BF16_PREFILL_HEAD_DIMS if bf16 else HEAD_DIMS
    return (q_dtype in _QUERIES and kv_dtype in (torch.bfloat16, Q8_0) and head_dim in dims and heads % kv_heads == 0
            and _prefill_kernel() is not None)


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Pools of q's head_dim and kv heads, contiguous, on CPU."""
    if not (q.device.type == "cpu" and q.dtype in _QUERIES and k_cache.dtype in _DTYPES
            and k_cache.dtype == v_cache.dtype and k_cache.shape == v_cache.shape
            and k_cache.shape[2] == head_width(q.shape[-1], k_cache.dtype) and q.shape[1] % k_cache.shape[1] == 0
            and k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"attention: pools {tuple(k_cache.shape)} {k_cache.dtype} do not fit queries "
                         f"{tuple(q.shape)} {q.dtype} on {q.device}")


def _sink_pointer(sinks: torch.Tensor | None, heads: int) -> int | None:
    """The kernels' sinks argument: [heads] float32 logits, or None (null) for attention without sinks."""
    if sinks is None:
        return None
    if sinks.shape != (heads,) or sinks.dtype != torch.float32 or not sinks.is_contiguous():
        raise ValueError(f"attention: sinks {tuple(sinks.shape)} {sinks.dtype} are not {heads} float32 logits")
    return sinks.data_ptr()


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slots: torch.Tensor, lengths: torch.Tensor, scale: float,
                           window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One decode token per row attends over its first lengths[b] slots of the pool (with a sliding window,
    over the last `window` of them: the slots before are never read). sinks: [heads] float32 logits that join
    each head's softmax denominator (attention sinks), or None.

    q: [B, heads, dim]; k_cache, v_cache: [slots, kv_heads, dim] contiguous, of dtypes decode_serves(); slots:
    [B, W] int64 (entries past a row's length are ignored); lengths: [B] int64 in 1..W. Query head h reads kv
    head h // (heads // kv_heads). Returns [B, heads, dim] in q's dtype.
    """
    b, heads, dim = q.shape
    _check(q, k_cache, v_cache)
    if slots.shape[0] != b or lengths.shape != (b,):
        raise ValueError(f"decode attention: {b} queries but slots {tuple(slots.shape)}, "
                         f"lengths {tuple(lengths.shape)}")
    q, slots, lengths = q.contiguous(), slots.contiguous().long(), lengths.contiguous().long()
    out = torch.empty_like(q)
    status = _kernel()(_DTYPES[q.dtype], _DTYPES[k_cache.dtype], q.data_ptr(), k_cache.data_ptr(),
                       v_cache.data_ptr(), slots.data_ptr(), lengths.data_ptr(), out.data_ptr(), b, slots.shape[1],
                       heads, k_cache.shape[1], dim, k_cache.shape[0], scale, window or 0, _sink_pointer(sinks, heads),
                       torch.get_num_threads())
    if status == 1:
        raise IndexError("decode attention: a length is outside 1..W or a slot is outside the pool")
    if status:
        raise ValueError(f"the decode attention kernel does not serve {tuple(q.shape)} {q.dtype} queries over a "
                         f"{k_cache.dtype} pool")
    return out


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                            scale: float, window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """A prompt chunk's causal attention over its whole history, in slabs.

    q: [L, heads, dim], the queries of positions context - L .. context - 1; caches: [slots, kv_heads, dim] of
    dtypes prefill_serves(), with the chunk's own K/V already written; slots: [context] int64, the pool slots of
    positions 0 .. context - 1 (with a sliding window, a query reads only its last `window` positions: the slots
    before the first query's window are never read); sinks as paged_decode_attention's. Returns [L, heads, dim]
    in q's dtype."""
    length, heads, dim = q.shape
    _check(q, k_cache, v_cache)
    q, slots = q.contiguous(), slots.contiguous().long()
    out = torch.empty_like(q)
    status = _prefill_kernel()(_DTYPES[q.dtype], _DTYPES[k_cache.dtype], q.data_ptr(), k_cache.data_ptr(),
                               v_cache.data_ptr(), slots.data_ptr(), length, slots.shape[0], heads,
                               k_cache.shape[1], dim, k_cache.shape[0], scale, window or 0,
                               _sink_pointer(sinks, heads), out.data_ptr(), torch.get_num_threads())
    if status == 1:
        raise IndexError("prefill attention: a slot is outside the pool")
    if status:
        raise ValueError(f"the prefill attention kernel does not serve {tuple(q.shape)} {q.dtype} queries over "
                         f"{slots.shape[0]} positions of a {k_cache.dtype} pool")
    return out
