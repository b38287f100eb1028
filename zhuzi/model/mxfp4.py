"""MXFP4 weights of a Hugging Face directory (loader): transformers' quant_method mxfp4 stores a matrix X as
X_blocks, 4-bit e2m1 codes two to a byte (the even element in the low nibble), 32 values a block, and
X_scales, one e8m0 exponent (bias 127) a block. The loader reads the pair as X, dequantized at load. A GGUF
file's MXFP4 blocks are another layout (blocks.py reads them)."""
from __future__ import annotations

from collections.abc import Iterable

import torch

BLOCKS, SCALES = "_blocks", "_scales"
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BYTE_VALUES = torch.tensor([[E2M1[b & 0x0F], E2M1[b >> 4]] for b in range(256)])  # a byte's even, odd value


def stored_names(names: Iterable[str]) -> dict[str, str | tuple[str, str]]:
    """A file's tensor names -> what holds each: itself, or for an MXFP4 matrix X its (X_blocks, X_scales)."""
    names = set(names)
    pairs = {name.removesuffix(BLOCKS) for name in names
             if name.endswith(BLOCKS) and name.removesuffix(BLOCKS) + SCALES in names}
    held: dict[str, str | tuple[str, str]] = {name: name for name in names
                                              if name.removesuffix(BLOCKS).removesuffix(SCALES) not in pairs}
    return held | {name: (name + BLOCKS, name + SCALES) for name in pairs}


def unpack(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks uint8 [..., rows, K / 32, 16] and scales uint8 [..., rows, K / 32] -> float32 [..., K, rows]: the
    values in the unquantized parameter's layout (transformers' gpt-oss experts multiply x @ W)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)}")
    # a byte's pair of values looked up at once, by 32-bit indexes: a real checkpoint's matrix has billions
    values = BYTE_VALUES.index_select(0, blocks.flatten().int()).view(*scales.shape, 32)
    values *= torch.exp2(scales.float() - 127)[..., None]  # exact: a power of two
    return values.flatten(-2, -1).transpose(-1, -2)
