"""Linear layers on CPU through native kernels (model runner -> every projection of a step).

small_m_linear: dense bf16 / float32 / int8 weights against a decode batch of M <= 8 rows.
quant_linear: zhuzi's own 4-bit and 8-bit weights (quant.py) against any number of bf16 rows.

A decode step multiplies a handful of rows (one per running request) by every
weight matrix once, so its time is the time to stream the weights from memory.
torch's GEMM is built for the other case and reaches about half the bandwidth at
one row. This kernel streams each weight row once for all M <= 8 input rows,
prefetching ahead, and accumulates in float32: bf16 weights (and int8 ones,
which are exact in bf16, when the inputs are bf16) with AVX512-BF16
`vdpbf16ps` where the CPU has it, otherwise widened to float in registers.

Output rows are split over torch's OpenMP threads. The arithmetic of one output
value depends only on its input row and weight row, never on M or the thread
count, so a request's logits are the same bits alone or in a small batch.

The quant kernel (kernels/quant_linear.cpp, loops in kernels/quant_packed.h) streams each 16-row group
once per 8 input rows, turning codes into bf16 in registers: at one row it reads int4 weights at
close to memory speed, and for prefill it does the same vdpbf16ps work as a bf16 GEMM without ever
materialising bf16 weights. Results are batch-invariant in the same way.

For --deterministic, fixed_order_linear serves any number of rows with that same per-output
routine (inputs in sets of up to 8 rows): a token's projections are then the same bits in a decode
of one row, a batch of 30 or a prefill chunk of 512, which torch's GEMM (whose blocking follows the
shape) does not promise.

The kernels (kernels/*.cpp) are compiled on first use for this very CPU and loaded by native.py;
without a compiler, and for shapes they do not serve, the caller's torch path runs.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from zhuzi.model import native

MAX_ROWS = 8
# fixed_order_linear's input rows per pass over the weights: 128 rows of K = 1536 bf16 (384 KiB) stay in L2.
PASS_ROWS = 128

_WEIGHTS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
_FLOATS = (torch.float32, torch.bfloat16)


def _entry(name: str, sizes: int):
    """An entry point of the compiled kernel, or None when it cannot be built or loaded."""
    return native.entry("small_m_linear", name, [ctypes.c_int] * 2 + [ctypes.c_void_p] * 3
                        + [ctypes.c_int, ctypes.c_void_p] + [ctypes.c_int64] * sizes + [ctypes.c_int])


def _kernel():
    return _entry("zhuzi_small_m_linear", 3)


def fixed_order_available() -> bool:
    return _entry("zhuzi_fixed_order_linear", 4) is not None


def _serves(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, max_rows: int = MAX_ROWS) -> bool:
    if not (x.is_cpu and weight.is_cpu and x.dim() == weight.dim() == 2 and 1 <= x.shape[0] <= max_rows
            and x.shape[1] == weight.shape[1] and x.dtype in _FLOATS and weight.is_contiguous()):
        return False
    if weight.dtype == torch.int8:
        return scale is not None and scale.is_cpu and scale.dtype in _FLOATS and scale.shape == weight.shape[:1]
    return scale is None and weight.dtype in (x.dtype, torch.bfloat16)


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """y = x @ weight^T (times scale per output channel for int8 weights), float32 accumulation.

    x: [M, K] float32 or bf16; weight: [N, K] contiguous, x's dtype or bf16 (scale None) or int8 with
    scale [N] float32 or bf16. Returns [M, N] in x's dtype, or None when this path does not serve
    the call (M > 8, not CPU, other dtypes or shapes, no compiler): the caller then uses torch.
    """
    fn = _kernel() if _serves(x, weight, scale) else None
    return None if fn is None else _call(fn, x, weight, scale)


def fixed_order_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                       pass_rows: int = PASS_ROWS) -> torch.Tensor | None:
    """small_m_linear for any number of rows: each row's outputs are the bits small_m_linear gives that
    row alone, whatever M, pass_rows or the thread count. None when it cannot serve the call."""
    fn = _entry("zhuzi_fixed_order_linear", 4) if _serves(x, weight, scale, max_rows=x.shape[0]) else None
    return None if fn is None else _call(fn, x, weight, scale, pass_rows)


def _call(fn, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, *sizes: int) -> torch.Tensor | None:
    x = x.contiguous()
    scale = scale.contiguous() if scale is not None else None
    y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    scale_bf16 = int(scale is not None and scale.dtype == torch.bfloat16)
    status = fn(_WEIGHTS[weight.dtype], int(x.dtype == torch.bfloat16), x.data_ptr(), weight.data_ptr(),
                scale.data_ptr() if scale is not None else None, scale_bf16,
                y.data_ptr(), x.shape[0], weight.shape[0], x.shape[1], *sizes, torch.get_num_threads())
    return y if status == 0 else None


def _quant_kernel(variant: str | None = None):
    return native.entry("quant_linear", "zhuzi_quant_linear",
                        [ctypes.c_int] * 2 + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int], variant)


QUANT_FORMATS = {"q4": 0, "q8": 1}


def quant_linear_available() -> bool:
    """Whether the process's kernels serve quant.py's packed weights."""
    return _quant_served(native.current())


@functools.cache
def _quant_served(variant: str) -> bool:
    fn = _quant_kernel(variant)
    if fn is None:
        return False
    x, y = torch.zeros(1, 32, dtype=torch.bfloat16), torch.empty(1, 16, dtype=torch.bfloat16)
    w = torch.zeros(1, 1, 544, dtype=torch.uint8)
    return fn(1, 1, x.data_ptr(), w.data_ptr(), y.data_ptr(), 1, 16, 32, 1) == 0


def quant_linear(x: torch.Tensor, packed: torch.Tensor, fmt: str, out_features: int) -> torch.Tensor | None:
    """y = x @ W^T for W packed as quant.py's `fmt` ("q4" or "q8"); x: [M, K] float32 or bf16 on CPU.
    Returns [M, out_features] in x's dtype, or None when the kernel does not serve the call."""
    fn = _quant_kernel()
    if fn is None or not (x.is_cpu and x.dtype in _FLOATS and x.dim() == 2 and x.shape[0] > 0
                          and x.shape[1] == packed.shape[1] * 32):
        return None
    x = x.contiguous()
    y = torch.empty(x.shape[0], out_features, dtype=x.dtype)
    status = fn(QUANT_FORMATS[fmt], int(x.dtype == torch.bfloat16), x.data_ptr(), packed.data_ptr(), y.data_ptr(),
                x.shape[0], out_features, x.shape[1], torch.get_num_threads())
    return y if status == 0 else None


def _int8_rows():
    return _int8_rows_of(native.current())


@functools.cache
def _int8_rows_of(variant: str):
    lib = native.load("int8_rows", variant)
    if lib is None:
        return None
    lib.zhuzi_quantize_rows.restype = lib.zhuzi_scale_rows.restype = None
    lib.zhuzi_quantize_rows.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_int]
    lib.zhuzi_scale_rows.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 2 + [ctypes.c_int]
    return lib


def int8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, code_sums: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x @ (weight * scale[:, None])^T + bias with int8 compute: each row of x quantized to int8 over its
    own range (asymmetric: x = s (q - z), the range widened to hold 0), exact int32 products
    (torch._int_mm: VNNI, faster than a bf16 GEMM where the CPU has it), the zero point's share removed with
    the weight rows' code sums, then scaled back and rounded once. A row's result depends only on that row.

    x: [M, K] float32 or bf16 on CPU; weight: int8 [N, K]; scale: float32 [N]; code_sums: int32 [N]
    (weight.sum(1)); bias in x's dtype. None when the kernels cannot be built.

    The variants without native bf16 (avx2, neon) have no fast int8 GEMM behind torch._int_mm: there each
    row runs through the rows kernel on q8 activations (int8 dot products, the decode rows' arithmetic)."""
    if not native.native_bf16():
        y = fixed_order_linear(x, weight, scale)
        return y + bias if y is not None and bias is not None else y
    lib = _int8_rows()
    if lib is None or not (x.is_cpu and x.dtype in _FLOATS):
        return None
    x = x.contiguous()
    m, k = x.shape
    bf16, threads = int(x.dtype == torch.bfloat16), torch.get_num_threads()
    q = torch.empty(m, k, dtype=torch.int8)
    row_scale, zero = torch.empty(m, dtype=torch.float32), torch.empty(m, dtype=torch.int32)
    lib.zhuzi_quantize_rows(bf16, x.data_ptr(), q.data_ptr(), row_scale.data_ptr(), zero.data_ptr(), m, k, threads)
    acc = torch._int_mm(q, weight.t())
    y = torch.empty(m, weight.shape[0], dtype=x.dtype)
    bias = bias.contiguous() if bias is not None else None
    lib.zhuzi_scale_rows(bf16, acc.data_ptr(), row_scale.data_ptr(), zero.data_ptr(), code_sums.data_ptr(),
                         scale.data_ptr(), _ptr(bias), y.data_ptr(), m, weight.shape[0], threads)
    return y


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
