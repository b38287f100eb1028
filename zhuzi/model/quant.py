"""Weight formats of the quantized linear layers, made at load time (loader -> decoder -> linear.py).

int8: one int8 code per weight and one scale per output channel (w = q * scale).
Q4 (`quantization="int4"`): the GGUF's Q4_1 blocks: per group of 32 inputs of an output row, 4-bit codes
    q in 0..15 with an fp16 scale d and minimum m, w = q * d + m (5 bits a weight). Picking d and m from
    the group's range reproduces a Q4_1 checkpoint's blocks exactly, so int4 of a Q4_1 GGUF is its own
    weights.
Q8: the GGUF's Q8_0 blocks: per group of 32, int8 codes and an fp16 scale d, w = q * d (8.5 bits a
    weight); the int4 model's LM head (SmolLM2's tied embedding is Q8_0 in its GGUF; 4 bits cost too
    much top-1 agreement there).

Q4 and Q8 are repacked into row groups of 16 output rows, stored as units of 32 inputs (one group of
each row), for kernels/quant_packed.h (the layout is described there; the same on every CPU variant);
pure torch here: packing, and unpacking for the reference path and the tests.
"""
from __future__ import annotations

import torch

GROUP, LANES = 32, 16
Q4_BYTES, Q8_BYTES = 320, 544


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> int8 codes [N, K] and float32 scales [N] (symmetric, per output channel)."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous(), scale


def _groups(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> float32 [row_groups * 16, K / 32, 32], zero rows padding N to whole row groups of 16."""
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"in_features {k} is not a multiple of {GROUP}: no 4/8-bit packing for this matrix")
    w = torch.zeros(-(-n // LANES) * LANES, k, dtype=torch.float32)
    w[:n] = weight.float()
    return w.view(-1, k // GROUP, GROUP)


def _per_group(values: torch.Tensor) -> torch.Tensor:
    """fp16 [row_groups * 16, groups] -> the bytes of each unit's 16 values, [row_groups, groups, 32]."""
    rows, groups = values.shape
    return values.view(rows // LANES, LANES, groups).transpose(1, 2).contiguous().view(torch.uint8)


def _per_row(raw: torch.Tensor) -> torch.Tensor:
    """The inverse of _per_group, as float32 [row_groups * 16, groups, 1]."""
    row_groups, groups = raw.shape[:2]
    values = raw.contiguous().view(torch.float16).view(row_groups, groups, LANES)
    return values.transpose(1, 2).reshape(-1, groups, 1).float()


def pack_q4(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float -> Q4 units, uint8 [ceil(N / 16), K / 32, 320]."""
    w = _groups(weight)
    row_groups, groups = w.shape[0] // LANES, w.shape[1]
    lo, hi = w.amin(-1), w.amax(-1)
    d, m = ((hi - lo) / 15).half(), lo.half()  # rounded first: the codes are chosen against the stored values
    step = d.float()[..., None]
    q = torch.where(step > 0, torch.round((w - m.float()[..., None]) / step.clamp(min=1e-30)), 0).clamp(0, 15)
    q = q.to(torch.uint8).view(row_groups, LANES, groups, 4, 2, 4)  # row group, row, group, chunk, nibble, byte
    q = q.permute(0, 2, 3, 1, 5, 4)  # row group, group, chunk, row, byte, nibble
    codes = (q[..., 0] | (q[..., 1] << 4)).reshape(row_groups, groups, 256)
    return torch.cat([codes, _per_group(d), _per_group(m)], -1).contiguous()


def unpack_q4(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """Q4 units -> the float32 [N, K] weights they stand for."""
    row_groups, groups = packed.shape[:2]
    codes = packed[..., :256].reshape(row_groups, groups, 4, LANES, 4)
    q = torch.stack([codes & 15, codes >> 4], -1)  # row group, group, chunk, row, byte, nibble
    q = q.permute(0, 3, 1, 2, 5, 4).reshape(row_groups * LANES, groups, GROUP).float()
    w = q * _per_row(packed[..., 256:288]) + _per_row(packed[..., 288:320])
    return w.view(row_groups * LANES, -1)[:out_features]


def pack_q8(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float -> Q8 units, uint8 [ceil(N / 16), K / 32, 544]."""
    w = _groups(weight)
    row_groups, groups = w.shape[0] // LANES, w.shape[1]
    d = (w.abs().amax(-1) / 127).half()
    q = torch.round(w / d.float().clamp(min=1e-30)[..., None]).clamp(-127, 127).to(torch.int8)
    q = q.view(row_groups, LANES, groups, 8, 4).permute(0, 2, 3, 1, 4)  # row group, group, quad, row, input
    codes = q.reshape(row_groups, groups, 512).view(torch.uint8)
    return torch.cat([codes, _per_group(d)], -1).contiguous()


def unpack_q8(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """Q8 units -> the float32 [N, K] weights they stand for."""
    row_groups, groups = packed.shape[:2]
    q = packed[..., :512].contiguous().view(torch.int8).view(row_groups, groups, 8, LANES, 4)
    q = q.permute(0, 3, 1, 2, 4).reshape(row_groups * LANES, groups, GROUP).float()
    return (q * _per_row(packed[..., 512:544])).view(row_groups * LANES, -1)[:out_features]
