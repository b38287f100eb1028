"""Model building blocks: RMSNorm, rotary position embedding, fused linear helpers."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32 as the reference does, then return to the compute dtype.
    return F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype) * weight


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """Gemma's RMSNorm: scales by (offset + w), in float32 before rounding (w stays exact in bf16 this way)."""
    return (F.rms_norm(x.float(), weight.shape, eps=eps) * (offset + weight.float())).to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies, with Llama-3 / linear rope scaling when the checkpoint asks for it."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq.float()
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float()
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old_len / wavelen) - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(medium, blended, scaled).float()
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


class Rotary:
    """Precomputed cos/sin tables; `apply` rotates q and k at the given positions. Frequency i turns the
    pair of dims (i, i + d/2) (the Hugging Face layout), or (2i, 2i + 1) when interleaved (llama.cpp's)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_positions: int,
                 interleaved: bool = False):
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.cos, self.sin = angles.cos(), angles.sin()  # [positions, head_dim / 2]
        self.interleaved = interleaved

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for one step's tokens, one per dim, computed once and shared by every layer."""
        cos, sin = self.cos[positions], self.sin[positions]
        if self.interleaved:
            return cos.repeat_interleave(2, -1).to(dtype)[:, None], sin.repeat_interleave(2, -1).to(dtype)[:, None]
        return torch.cat([cos, cos], -1).to(dtype)[:, None], torch.cat([sin, sin], -1).to(dtype)[:, None]

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [tokens, heads, head_dim] rotated by a step's tables: each pair (a, b) -> (a c - b s, b c + a s)."""
        if self.interleaved:
            pairs = x.unflatten(-1, (-1, 2))
            rotated = torch.stack([-pairs[..., 1], pairs[..., 0]], -1).flatten(-2)
        else:
            half = x.shape[-1] // 2
            rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin
