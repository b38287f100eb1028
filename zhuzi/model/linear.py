"""The model's linear layers (decoder -> every projection): dense weights, or GGUF blocks (a file's own, or made
at load by quant.py). Each layer picks its backend once, at construction, by its weights' dtype, format and
device and by the CPU's kernels; float32 weights are the reference and run through torch.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from zhuzi.model import cpu_blocks, cpu_linear
from zhuzi.model.blocks import BlockWeight

QUANTIZATIONS = ("int8", "int4", "gguf")


class Linear:
    """y = x W^T + b with W dense, in the compute dtype."""

    fixed_order = False  # --deterministic: every row's outputs by the same operations, whatever the rows

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight.contiguous(), bias
        # bf16 weights on CPU run through the rows kernels where this CPU has them: a decode batch of a few rows
        # is a weight-streaming problem, which the kernel reads at close to memory speed (torch's GEMV does
        # not), and float32 inputs meet the bf16 weights widened in registers (torch would need a float32 copy
        # of the matrix every call).
        rows = self.weight.is_cpu and self.weight.dtype == torch.bfloat16 and cpu_linear.available()
        self.backend = "rows" if rows else "torch"
        self._forward: Callable[[torch.Tensor], torch.Tensor] = self._rows if rows else self._torch

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        y = self._fixed_order(flat) if self.fixed_order else self._forward(flat)
        return y.view(*x.shape[:-1], -1)

    def _torch(self, flat: torch.Tensor) -> torch.Tensor:
        return F.linear(flat, self.weight.to(flat.dtype), self.bias)

    def _rows(self, flat: torch.Tensor) -> torch.Tensor:
        m = flat.shape[0]
        if m == 0 or (m > cpu_linear.MAX_ROWS and flat.dtype == self.weight.dtype):
            return self._torch(flat)  # a prompt's rows in the weights' dtype: torch's GEMM
        y = cpu_linear.small_m_linear(flat, self.weight) if m <= cpu_linear.MAX_ROWS \
            else cpu_linear.fixed_order_linear(flat, self.weight)
        return y + self.bias if self.bias is not None else y

    def _fixed_order(self, flat: torch.Tensor) -> torch.Tensor:
        y = cpu_linear.fixed_order_linear(flat, self.weight)
        return y + self.bias if self.bias is not None else y

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.weight, self.bias) if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def _whole_groups(w: BlockWeight) -> list[BlockWeight]:
    """w as its whole 16-row groups, then the rows past them: the groups pack, and a row group of the fused
    step never straddles two parts."""
    whole = w.shape[0] // 16 * 16
    return [w] if whole in (0, w.shape[0]) else [w[:whole], w[whole:]]


class BlockLinear(Linear):
    """GGUF blocks (blocks.py; repacked at load for the kernels): one matrix, or several whose output rows
    follow each other (q, k, v; gate, up), each of its own type, through the block kernels for any number of
    rows. An output's arithmetic depends only on its own input row, so the layer is fixed-order as it is."""

    backend = "blocks"

    def __init__(self, parts: list[BlockWeight], bias: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None):
        parts = [p.pack() for part in parts for p in _whole_groups(part)]
        self.parts, self.bias, self.out_dtype = parts, bias, out_dtype  # out_dtype: default the inputs'
        self.out_features = sum(p.shape[0] for p in parts)
        self.table = cpu_blocks.part_table(parts)

    def _forward(self, flat: torch.Tensor) -> torch.Tensor:
        y = cpu_blocks.block_linear(flat, self.table, self.out_features, self.out_dtype)
        return y + self.bias if self.bias is not None else y

    _fixed_order = _forward

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [p.data for p in self.parts] + ([self.bias] if self.bias is not None else [])


def blocks_serve(parts: list[BlockWeight], device: str) -> bool:
    """Whether the block kernels run a layer of these parts here (else their values run dense)."""
    return torch.device(device).type == "cpu" and all(cpu_blocks.linear_serves(p.qtype) for p in parts)
