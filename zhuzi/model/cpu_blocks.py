"""GGUF blocks on CPU through native kernels (decoder -> embedding rows and block linear layers).

dequantize_rows: rows of blocks -> their exact values (kernels/dequantize_blocks.cpp), for the embedding's
rows of a step and for matrices that run dense.
pack_rows: a block matrix -> the packed layout of kernels/packed_layout.h (16-row groups), at load.
block_linear: bf16 input rows against one or more matrices of blocks (kernels/block_linear.cpp).
"""
from __future__ import annotations

import ctypes
import hashlib
from functools import cache

import gguf
import torch

from zhuzi.model import native

KERNEL_TYPES = frozenset({2, 3, 6, 7, 8, 12, 13, 14})  # kernels/blocks.h: Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K
PACKED_FLAG = 0x100  # kernels/packed_layout.h's FLAG: a packed matrix's type id is FLAG | its ggml type
# Types packed_layout.h packs: (inputs a block, a row's bytes a block once packed: the file's, bar the 6-bit
# scales of Q4_K and Q5_K)
PACKED = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
          12: (256, 148), 13: (256, 180), 14: (256, 210)}
_OUT = {torch.float32: 0, torch.bfloat16: 1}


def _dequantize_kernel():
    return native.entry("dequantize_blocks", "zhuzi_dequantize_rows",
                        [ctypes.c_int, ctypes.c_void_p] + [ctypes.c_int64] * 2 + [ctypes.c_void_p]
                        + [ctypes.c_int64] * 2 + [ctypes.c_void_p, ctypes.c_int, ctypes.c_int])


def dequantize_serves(qtype: int) -> bool:
    return int(qtype) in KERNEL_TYPES and _dequantize_kernel() is not None


def _pack_kernel():
    return native.entry("dequantize_blocks", "zhuzi_pack_blocks",
                        [ctypes.c_int, ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] + [ctypes.c_int] * 2)


def packs(qtype: int, data: torch.Tensor, in_features: int) -> bool:
    """Whether the kernel packs this block matrix (uint8 [rows, bytes per row]): a type packed_layout.h packs,
    whole groups of 16 contiguous rows of in_features inputs, on CPU."""
    if int(qtype) not in PACKED:
        return False
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, row_bytes = data.shape
    return (rows % 16 == 0 and in_features % block == 0 and row_bytes == in_features // block * block_bytes
            and data.is_cpu and data.is_contiguous() and _pack_kernel() is not None)


@cache
def layout_version() -> str:
    """What a packed matrix's bytes depend on besides its file's: the packing code's sources (the layout, the
    blocks it reads, the loop over a matrix), not the kernels', which change far more often. Every variant packs
    the same bytes (packed_layout.h's pack() is plain scalar code), so no variant is in it."""
    digest = hashlib.sha256()
    for name in ("dequantize_blocks.cpp", "packed_layout.h", "blocks.h", "prelude.h"):
        digest.update((native.KERNELS / name).read_bytes())
    return digest.hexdigest()[:16]


def packed_shape(qtype: int, rows: int, in_features: int) -> tuple[int, int]:
    """A matrix's shape in the packed layout: [rows, packed bytes per row]."""
    block, nbytes = PACKED[int(qtype)]
    return rows, in_features // block * nbytes


def pack_rows(qtype: int, data: torch.Tensor, in_features: int, release: bool = False,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """A block matrix that packs() takes in the packed layout, uint8 packed_shape(), in out where given.
    release: data is a view of the file's mapping, whose pages then leave this process's resident set."""
    shape = packed_shape(qtype, data.shape[0], in_features)
    out = torch.empty(shape, dtype=torch.uint8) if out is None else out.view(shape)
    status = _pack_kernel()(int(qtype), data.data_ptr(), data.shape[0], data.stride(0), in_features,
                            out.data_ptr(), int(release), torch.get_num_threads())
    if status:
        raise RuntimeError(f"the packing kernel refused a {tuple(data.shape)} matrix of type {int(qtype)}")
    return out


def dequantize_rows(qtype: int, data: torch.Tensor, in_features: int, ids: torch.Tensor | None,
                    dtype: torch.dtype) -> torch.Tensor | None:
    """Rows ids (all rows when None) of a block matrix (uint8 [rows, bytes per row], contiguous rows) as
    [n, in_features] values in dtype (float32 or bf16; others converted from float32). None when the
    kernel does not serve the type or cannot be built."""
    known = int(qtype) & ~PACKED_FLAG in KERNEL_TYPES
    fn = _dequantize_kernel() if known and data.is_cpu and data.stride(-1) == 1 else None
    if fn is None:
        return None
    ids = ids.to(torch.int64, copy=False).contiguous().cpu() if ids is not None else None
    n = data.shape[0] if ids is None else ids.numel()
    out = torch.empty(n, in_features, dtype=dtype if dtype in _OUT else torch.float32)
    status = fn(int(qtype), data.data_ptr(), data.shape[0], data.stride(0), None if ids is None else ids.data_ptr(),
                n, in_features, out.data_ptr(), _OUT[out.dtype], torch.get_num_threads())
    if status == 1:
        raise IndexError(f"a row id is outside 0..{data.shape[0] - 1}")
    return out.to(dtype) if status == 0 else None


class _Part(ctypes.Structure):
    """kernels/block_linear.cpp's Part: one matrix of blocks whose output rows follow the previous part's."""

    _fields_ = [("type", ctypes.c_int32), ("w", ctypes.c_void_p), ("rows", ctypes.c_int64),
                ("row_bytes", ctypes.c_int64)]


def _linear_kernel():
    return native.entry("block_linear", "zhuzi_block_linear",
                        [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
                        + [ctypes.c_int64] * 3 + [ctypes.c_int])


def prefill_on_amx() -> bool:
    """Whether block_linear's calls of many rows run through AMX tiles here (the avx512 build, on a CPU with
    AMX-INT8 whose kernel grants the tile state)."""
    fn = native.entry("block_linear", "zhuzi_block_linear_amx", [])
    return fn is not None and fn() == 1


def linear_serves(qtype: int) -> bool:
    return int(qtype) in KERNEL_TYPES and _linear_kernel() is not None


def part_table(parts) -> ctypes.Array:
    """The kernel's view of a layer's parts (blocks.BlockWeight, whose data the layer keeps alive)."""
    return (_Part * len(parts))(*[_Part(p.kernel_type, p.data.data_ptr(), p.data.shape[0], p.data.stride(0))
                                  for p in parts])


def block_linear(x: torch.Tensor, table: ctypes.Array, out_features: int,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """y = x @ W^T for W the parts' rows one after another; x: [M, K] float32 or bf16 on CPU, quantized to
    q8 blocks with one scale per 32 inputs (per 256 for the K-quants: kernels/block_dot.h). Returns
    [M, out_features] in out_dtype (default x's), or None when the kernel does not serve the call."""
    fn = _linear_kernel()
    if fn is None or not (x.is_cpu and x.dtype in _OUT and x.dim() == 2 and x.shape[0] > 0):
        return None
    x = x.contiguous()
    y = torch.empty(x.shape[0], out_features, dtype=out_dtype or x.dtype)
    status = fn(ctypes.addressof(table), len(table), x.data_ptr(), _OUT[x.dtype], y.data_ptr(), _OUT[y.dtype],
                x.shape[0], out_features, x.shape[1], torch.get_num_threads())
    return y if status == 0 else None
