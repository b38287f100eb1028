"""GGUF weights as the file stores them (loader -> decoder -> linear.py): a matrix's rows of quantized
blocks, read in place from the memory-mapped file, and their exact values where a layer needs them dense.

The block layouts are described once, in kernels/blocks.h; here a matrix is its ggml type, its bytes
([rows, bytes per row], a view of the mapping: nothing is copied while the rows stay as they are) and its
number of inputs. Values come from the native dequantizer (kernels/dequantize_blocks.cpp, the same bits as
gguf's reference), else from the gguf package.

A linear layer's matrices are repacked once at load (pack(): kernels/packed_blocks.h's 16-row groups, which a
decode step streams at memory speed); the packed copy replaces the file's pages.
"""
from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import torch

from zhuzi.model import cpu_blocks

Q = gguf.GGMLQuantizationType
DENSE_TYPES = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}


@dataclass(frozen=True)
class BlockWeight:
    """A [rows, in_features] matrix of GGUF blocks; data: uint8 [rows, bytes per row]."""

    qtype: gguf.GGMLQuantizationType
    data: torch.Tensor
    in_features: int
    packed: bool = False  # data in kernels/packed_blocks.h's layout: rows in groups of 16
    mapped: bool = False  # data is a view of the file's mapping, nothing written: its pages may be dropped

    @property
    def kernel_type(self) -> int:
        """The type id the kernels take: the ggml type, or packed_blocks.h's FLAG | it."""
        return int(self.qtype) | (cpu_blocks.PACKED_FLAG if self.packed else 0)

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.in_features

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def __getitem__(self, rows: slice) -> BlockWeight:
        return BlockWeight(self.qtype, self.data[rows], self.in_features, self.packed, self.mapped)

    def pack(self) -> BlockWeight:
        """This matrix in the kernels' packed layout where they have one for its type and shape, else itself."""
        data = None if self.packed else cpu_blocks.pack_rows(self.qtype, self.data, self.in_features, self.mapped)
        return self if data is None else BlockWeight(self.qtype, data, self.in_features, packed=True)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Every row's exact values, in dtype."""
        return self._values(None, dtype)

    def take(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ids (an embedding lookup), [len(ids), in_features] in dtype."""
        return self._values(ids.reshape(-1), dtype).view(*ids.shape, self.in_features)

    def _values(self, ids: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        values = cpu_blocks.dequantize_rows(self.kernel_type, self.data, self.in_features, ids, dtype)
        if values is not None or self.packed:
            return values
        rows = self.data if ids is None else self.data[ids.cpu()]
        flat = gguf.quants.dequantize(rows.numpy(), self.qtype)  # [rows, in_features] float32
        return torch.from_numpy(np.ascontiguousarray(flat)).to(dtype)
