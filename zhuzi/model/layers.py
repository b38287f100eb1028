"""Model building blocks: RMSNorm (plain and Gemma's offset form) and rotary position embedding (RoPE) with
its scalings (linear, Llama-3, LongRoPE, YaRN)."""
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


def rms_norm_unscaled(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight (Gemma 4's norm of V), in float32."""
    return F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def rope_kind(scaling: dict | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None, long: bool = False) -> torch.Tensor:
    """Inverse frequencies, with Llama-3 / linear / LongRoPE / YaRN scaling when the checkpoint asks for it (long:
    LongRoPE's factors for positions past the original context). A GGUF's frequency factors (llama.cpp's
    rope_freqs, in the scaling dict as frequency_factors) divide each frequency before the scaling applies."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling and "frequency_factors" in scaling:
        inv_freq = inv_freq / torch.tensor(scaling["frequency_factors"][:head_dim // 2], dtype=torch.float64)
    kind = rope_kind(scaling)
    if kind == "default":
        return inv_freq.float()
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float()
    if kind == "proportional":  # Gemma 4's: the first frequencies of the whole head turn, the others are 0
        turning = int(scaling.get("partial_rotary_factor", 1.0) * head_dim // 2)
        inv_freq[turning:] = 0.0
        return (inv_freq / scaling.get("factor", 1.0)).float()
    if kind == "longrope":
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float64)
        return (inv_freq / factors).float()
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old_len / wavelen) - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(medium, blended, scaled).float()
    if kind == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling).float()
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3, longrope, "
                     "proportional, yarn)")


def _yarn_inv_freq(inv_freq: torch.Tensor, dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN (gpt-oss): frequencies that turn more than beta_fast times over the original context keep their
    value, those under beta_slow times are divided by the factor, and a linear ramp over the dims between
    blends the two (transformers' _compute_yarn_parameters; truncate rounds the ramp's ends outward)."""
    original = scaling["original_max_position_embeddings"]

    def dim_of(rotations: float) -> float:  # the dim whose frequency turns `rotations` times over the context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 0.001)).clamp(0, 1)
    return inv_freq / scaling["factor"] * ramp + inv_freq * (1 - ramp)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def rope_attention_factor(scaling: dict | None) -> float:
    """What LongRoPE and YaRN scale cos and sin by, as transformers computes it: the config's attention_factor,
    else LongRoPE's sqrt(1 + ln(factor) / ln(original context)) for a context stretched factor times, YaRN's
    0.1 ln(factor) + 1 (or the ratio of two such with DeepSeek's mscale keys); 1 for the other kinds."""
    kind = rope_kind(scaling)
    if kind not in ("longrope", "yarn"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    if kind == "yarn":
        mscale, all_dims = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and all_dims:
            return _yarn_mscale(scaling["factor"], mscale) / _yarn_mscale(scaling["factor"], all_dims)
        return _yarn_mscale(scaling["factor"])
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    return math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0


class Rotary:
    """Precomputed cos/sin tables; `apply` rotates q and k at the given positions. Frequency i turns the
    pair of dims (i, i + d/2) (the Hugging Face layout), or (2i, 2i + 1) when interleaved (llama.cpp's), of
    the first d = rotary_dim dims of a head; the others pass unturned (Phi-3's partial_rotary_factor).

    LongRoPE (Phi-3) turns positions within the original context by its short factors and those past it by
    its long ones, as vLLM's tables do: a position's rotation never depends on the batch or on the length
    the sequence reaches, so cached K stays valid. transformers equals it for sequences within the original
    context; past it, transformers recomputes the whole sequence with the long factors (docs/models.md)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_positions: int,
                 interleaved: bool = False, rotary_dim: int | None = None, device: torch.device | str = "cpu"):
        self.dim = rotary_dim or head_dim
        positions = torch.arange(max_positions, dtype=torch.float32)
        angles = torch.outer(positions, rope_inv_freq(self.dim, theta, scaling))
        if rope_kind(scaling) == "longrope":
            start = scaling["original_max_position_embeddings"]
            angles[start:] = torch.outer(positions[start:], rope_inv_freq(self.dim, theta, scaling, long=True))
        scale = rope_attention_factor(scaling)
        # [positions, rotary_dim / 2], where the step's positions are
        self.cos, self.sin = (angles.cos() * scale).to(device), (angles.sin() * scale).to(device)
        self.interleaved = interleaved

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for one step's tokens, one per dim, computed once and shared by every layer."""
        cos, sin = self.cos[positions], self.sin[positions]
        if self.interleaved:
            return cos.repeat_interleave(2, -1).to(dtype)[:, None], sin.repeat_interleave(2, -1).to(dtype)[:, None]
        return torch.cat([cos, cos], -1).to(dtype)[:, None], torch.cat([sin, sin], -1).to(dtype)[:, None]

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [tokens, heads, head_dim] rotated by a step's tables: each pair (a, b) -> (a c - b s, b c + a s)."""
        if self.dim < x.shape[-1]:
            return torch.cat([self.apply(x[..., :self.dim], cos, sin), x[..., self.dim:]], -1)
        if self.interleaved:
            pairs = x.unflatten(-1, (-1, 2))
            rotated = torch.stack([-pairs[..., 1], pairs[..., 0]], -1).flatten(-2)
        else:
            half = x.shape[-1] // 2
            rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin
