"""Dense linear layers on CPU through native kernels (linear.py -> kernels/small_m_linear.cpp).

small_m_linear: bf16 or float32 weights against a decode batch of M <= 8 rows, each weight row streamed once
for all of them; fixed_order_linear: the same per-output arithmetic for any number of rows (--deterministic).
A row's outputs never depend on the other rows or the thread count. docs/cpu.md has the design.
"""
from __future__ import annotations

import ctypes

import torch

from zhuzi.model import native

MAX_ROWS = 8
# fixed_order_linear's input rows per pass over the weights: 128 rows of K = 1536 bf16 (384 KiB) stay in L2.
PASS_ROWS = 128

_WEIGHTS = {torch.float32: 0, torch.bfloat16: 1}
_FLOATS = (torch.float32, torch.bfloat16)


def _entry(name: str, sizes: int):
    """An entry point of the compiled kernel, or None when it cannot be built or loaded."""
    return native.entry("small_m_linear", name, [ctypes.c_int] * 2 + [ctypes.c_void_p] * 3
                        + [ctypes.c_int64] * sizes + [ctypes.c_int])


def available() -> bool:
    """Whether this process has the rows kernels (a variant's build, not torch; a compiler)."""
    return _entry("zhuzi_small_m_linear", 3) is not None and _entry("zhuzi_fixed_order_linear", 4) is not None


def _check(x: torch.Tensor, weight: torch.Tensor, max_rows: int) -> None:
    if not (x.is_cpu and weight.is_cpu and x.dim() == weight.dim() == 2 and 1 <= x.shape[0] <= max_rows
            and x.shape[1] == weight.shape[1] and x.dtype in _FLOATS and weight.is_contiguous()
            and weight.dtype in (x.dtype, torch.bfloat16)):
        raise ValueError(f"the rows kernel does not take {tuple(x.shape)} {x.dtype} inputs against "
                         f"{tuple(weight.shape)} {weight.dtype} weights")


def small_m_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y = x @ weight^T, float32 accumulation. x: [M, K] float32 or bf16 on CPU, 1 <= M <= 8; weight: [N, K]
    contiguous, x's dtype or bf16. Returns [M, N] in x's dtype; ValueError for what it does not serve."""
    _check(x, weight, MAX_ROWS)
    return _call(_entry("zhuzi_small_m_linear", 3), x, weight)


def fixed_order_linear(x: torch.Tensor, weight: torch.Tensor, pass_rows: int = PASS_ROWS) -> torch.Tensor:
    """small_m_linear for any number of rows: each row's outputs are the bits small_m_linear gives that
    row alone, whatever M, pass_rows or the thread count."""
    _check(x, weight, x.shape[0])
    return _call(_entry("zhuzi_fixed_order_linear", 4), x, weight, pass_rows)


def _call(fn, x: torch.Tensor, weight: torch.Tensor, *sizes: int) -> torch.Tensor:
    x = x.contiguous()
    y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    status = fn(_WEIGHTS[weight.dtype], int(x.dtype == torch.bfloat16), x.data_ptr(), weight.data_ptr(),
                y.data_ptr(), x.shape[0], weight.shape[0], x.shape[1], *sizes, torch.get_num_threads())
    if status:
        raise ValueError(f"the rows kernel refused {tuple(x.shape)} {x.dtype} inputs ({weight.dtype} weights)")
    return y
