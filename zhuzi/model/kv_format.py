"""The KV pool's formats (model -> attention): float32, bf16, or q8_0 (--kv-cache-dtype q8_0): per head its
head_dim int8 values, then one fp16 scale per 32 of them (llama.cpp's q8_0 blocks, scales after the values).
The kernels (kernels/kv_rows.h) write and read the same bytes; this is the torch side."""
from __future__ import annotations

import torch

Q8_0 = torch.uint8  # the pool dtype that means q8_0
NAMES = {"bf16": torch.bfloat16, "fp32": torch.float32, "q8_0": Q8_0}
BLOCK = 32


def name(dtype: torch.dtype) -> str:
    return "q8_0" if dtype == Q8_0 else str(dtype).removeprefix("torch.")


def head_width(head_dim: int, dtype: torch.dtype) -> int:
    """A head's last dimension in the pool."""
    return head_dim + head_dim // 16 if dtype == Q8_0 else head_dim


def head_bytes(head_dim: int, dtype: torch.dtype) -> int:
    return head_width(head_dim, dtype) * dtype.itemsize


def check(head_dim: int, dtype: torch.dtype) -> None:
    if dtype == Q8_0 and head_dim % BLOCK:
        raise ValueError(f"kv_cache_dtype q8_0 needs a head_dim that is a multiple of {BLOCK}, not {head_dim}")


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """[..., D] values -> [..., D + D // 16] uint8 q8_0 heads."""
    blocks = x.float().unflatten(-1, (-1, BLOCK))
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, 0)
    q = torch.round(blocks * inv).to(torch.int8).flatten(-2)
    return torch.cat([q.view(torch.uint8), d.squeeze(-1).half().view(torch.uint8)], -1)


def dequantize_q8_0(p: torch.Tensor) -> torch.Tensor:
    """[..., D + D // 16] uint8 q8_0 heads -> [..., D] float32."""
    dim = p.shape[-1] * 16 // 17
    q = p[..., :dim].view(torch.int8).float().unflatten(-1, (-1, BLOCK))
    d = p[..., dim:].contiguous().view(torch.float16).float()
    return (q * d[..., None]).flatten(-2)


def to_pool(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K or V rows [..., D] in the pool's format."""
    return quantize_q8_0(x) if dtype == Q8_0 else x.to(dtype)


def from_pool(rows: torch.Tensor) -> torch.Tensor:
    """Pool rows as values: q8_0 dequantized to float32, others as they are."""
    return dequantize_q8_0(rows) if rows.dtype == Q8_0 else rows
