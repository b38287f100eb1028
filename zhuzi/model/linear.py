"""The model's linear layers (decoder -> every projection): dense, int8, zhuzi's 4/8-bit packing, or a GGUF file's
own blocks, each picking its fastest path for the rows of a step.

float32 weights are the reference: every format runs there as torch's matmul over its weights' exact values
(quantized values included), so a quantized fp32 model keeps the invariants of an fp32 one. float32
activations over bf16, int8 or 4-bit weights (dtype auto without native bf16) run through the kernels, which
widen the weights (or quantize the activations to q8 blocks) in registers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from zhuzi.model import cpu_blocks
from zhuzi.model.blocks import BlockWeight
from zhuzi.model.cpu_linear import (
    fixed_order_linear,
    int8_matmul,
    quant_linear,
    quant_linear_available,
    small_m_linear,
)
from zhuzi.model.quant import pack_q4, pack_q8, quantize_int8, unpack_q4, unpack_q8

QUANTIZATIONS = ("int8", "int4", "gguf")
# Weight format of the layers and of the LM head for the quantizations made at load.
FORMATS = {"int8": ("int8", "int8"), "int4": ("q4", "q8")}
_QUANT_PACKERS = {"q4": (pack_q4, unpack_q4), "q8": (pack_q8, unpack_q8)}


class Linear:
    """y = x W^T + b with W kept in the compute dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight.contiguous(), bias

    fixed_order = False  # --deterministic: every row's outputs by the same operations, whatever the rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        y = self._fixed_order(flat) if self.fixed_order else self._kernel(flat)
        if y is None:
            y = self._matmul(flat)
        elif self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], -1)

    def _fixed_order(self, flat: torch.Tensor) -> torch.Tensor:
        y = fixed_order_linear(flat, self.weight)
        if y is None:
            raise RuntimeError(f"the fixed-order kernel cannot serve {tuple(flat.shape)} {flat.dtype} inputs")
        return y

    def _kernel(self, flat: torch.Tensor) -> torch.Tensor | None:
        # Decode batches of a few rows are a weight-streaming problem: the kernel reads W at close to
        # memory speed, well above torch's GEMV. float32 weights are the reference: torch.
        return small_m_linear(flat, self.weight) if self.weight.dtype != torch.float32 else None

    def _matmul(self, flat: torch.Tensor) -> torch.Tensor:
        if flat.dtype == self.weight.dtype:
            return F.linear(flat, self.weight, self.bias)
        # float32 inputs against bf16 weights: the rows kernel widens them in registers; torch would need a
        # float32 copy of the matrix every call.
        y = fixed_order_linear(flat, self.weight)
        if y is None:
            return F.linear(flat, self.weight.to(flat.dtype), self.bias)
        return y + self.bias if self.bias is not None else y

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.weight, self.bias) if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


class Int8Linear(Linear):
    """int8 weights, one float32 scale per output channel. Decode batches (<= 8 rows) stream them against
    the inputs (bf16 ones as they are with AVX512-BF16, q8 blocks elsewhere); bigger batches run int8 compute."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(weight, bias)
        self.scale = scale.float().contiguous()
        self.code_sums = weight.sum(1, dtype=torch.int32)  # int8 compute removes the inputs' zero points with these

    def _kernel(self, flat: torch.Tensor) -> torch.Tensor | None:
        return small_m_linear(flat, self.weight, self.scale)

    def _matmul(self, flat: torch.Tensor) -> torch.Tensor:
        # Beyond a few rows the step is compute-bound: int8 inputs and products (smooth.py keeps the
        # inputs' ranges tame).
        y = int8_matmul(flat, self.weight, self.scale, self.code_sums, self.bias)
        if y is None:  # no kernels: dequantize on the fly
            y = F.linear(flat, (self.weight.float() * self.scale[:, None]).to(flat.dtype), self.bias)
        return y

    @property
    def tensors(self) -> list[torch.Tensor]:
        return super().tensors + [self.scale]


class QuantLinear(Linear):
    """zhuzi's own 4-bit or 8-bit packing (quant.py) through the quant kernel, for any number of rows on CPU."""

    def __init__(self, packed: torch.Tensor, fmt: str, out_features: int, bias: torch.Tensor | None = None):
        self.packed, self.fmt, self.out_features, self.bias = packed, fmt, out_features, bias

    def _kernel(self, flat: torch.Tensor) -> torch.Tensor | None:
        return quant_linear(flat, self.packed, self.fmt, self.out_features)

    def _matmul(self, flat: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{self.fmt} weights take float32 or bf16 CPU inputs, got {flat.dtype} on {flat.device}")

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.packed, self.bias) if t is not None]


class BlockLinear(Linear):
    """A GGUF file's blocks (blocks.py; repacked at load for the kernels): one matrix, or several whose output
    rows follow each other (q, k, v; gate, up), each of its own type, through the block kernels for any number
    of bf16 rows. An output's arithmetic depends only on its own input row, so the layer is fixed-order as it
    is."""

    def __init__(self, parts: list[BlockWeight], bias: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None):
        parts = [p.pack() for p in parts]
        self.parts, self.bias, self.out_dtype = parts, bias, out_dtype  # out_dtype: default the inputs'
        self.out_features = sum(p.shape[0] for p in parts)
        self.table = cpu_blocks.part_table(parts)

    def _kernel(self, flat: torch.Tensor) -> torch.Tensor | None:
        return cpu_blocks.block_linear(flat, self.table, self.out_features, self.out_dtype)

    _fixed_order = _kernel

    def _matmul(self, flat: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"GGUF blocks take bf16 CPU inputs, got {flat.dtype} on {flat.device}")

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [p.data for p in self.parts] + ([self.bias] if self.bias is not None else [])


def block_linear(parts: list[BlockWeight], bias: torch.Tensor | None,
                 out_dtype: torch.dtype | None = None) -> BlockLinear | None:
    """A layer on these blocks, or None where the kernels do not serve one of their types on this CPU."""
    return BlockLinear(parts, bias, out_dtype) if all(cpu_blocks.linear_serves(p.qtype) for p in parts) else None


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, fmt: str | None, dtype: torch.dtype) -> Linear:
    """A layer of weight [N, K] stored in format fmt (None: dense, "int8", "q4" or "q8") for a model whose
    weights are dtype. float32 weights (the reference) and formats without a kernel here run their exact
    values dense through torch."""
    device = weight.device
    if fmt is None:
        return Linear(weight.to(dtype), bias)
    if fmt == "int8":
        q, scale = quantize_int8(weight)
        if dtype == torch.float32:
            return Linear(q.float() * scale[:, None], bias)
        return Int8Linear(q.to(device), scale.to(device), bias)
    pack, unpack = _QUANT_PACKERS[fmt]
    packed = pack(weight)
    if dtype == torch.bfloat16 and device.type == "cpu" and quant_linear_available():
        return QuantLinear(packed, fmt, weight.shape[0], bias)
    return Linear(unpack(packed, weight.shape[0]).to(dtype).to(device), bias)
