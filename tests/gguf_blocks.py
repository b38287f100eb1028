"""Random GGUF blocks of every type the kernels serve (kernels/blocks.h), for the dequantizer and kernel tests:
random bytes, with the fp16 scales (MXFP4's E8M0 exponent) set to finite values of a realistic size."""
from __future__ import annotations

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
KERNEL_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K,
                Q.Q3_K, Q.Q2_K, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4]
# Byte offsets of each block's fp16 fields: (scales, mins-or-offsets).
HALVES = {Q.Q4_0: ([0], []), Q.Q4_1: ([0], [2]), Q.Q5_0: ([0], []), Q.Q5_1: ([0], [2]), Q.Q8_0: ([0], []),
          Q.Q4_K: ([0], [2]), Q.Q5_K: ([0], [2]), Q.Q6_K: ([208], []),
          Q.Q3_K: ([108], []), Q.Q2_K: ([80], [82]), Q.IQ4_NL: ([0], []), Q.IQ4_XS: ([0], []), Q.MXFP4: ([], [])}


def random_blocks(qtype: gguf.GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, bytes per row] of random blocks for a [rows, cols] matrix."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = 0.02 / (block // 32) / (4 if block == 256 else 1)  # K-quants: sub-scales ~32
    if qtype in (Q.IQ4_NL, Q.IQ4_XS):  # codes up to 127, not 15: a 4-bit block's weights want d / 16
        scale /= 16
    scales, offsets = HALVES[qtype]
    shape = (rows, cols // block, 1)
    for at in scales:
        data[..., at:at + 2] = (rng.uniform(0.2, 1.0, shape) * scale).astype(np.float16).view(np.uint8)
    for at in offsets:
        data[..., at:at + 2] = (rng.uniform(-1, 1, shape) * scale * 8).astype(np.float16).view(np.uint8)
    if qtype == Q.MXFP4:  # 2^(e - 128) times codes up to 12: weights up to 0.1, as the others'
        data[..., 0] = rng.integers(115, 122, shape[:2], dtype=np.uint8)
    return data.reshape(rows, -1)
