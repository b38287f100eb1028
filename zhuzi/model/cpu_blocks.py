"""GGUF blocks on CPU through native kernels (decoder -> embedding rows and block linear layers).

TYPES names the block types the kernels serve. dequantize_rows: rows of blocks -> their values; pack_rows: a
matrix -> the packed layout of kernels/packed_layout.h, at load; block_linear: input rows against one or more
matrices of blocks. Whether a kernel serves a type is known at load (serves()); a call it does not serve raises.
"""
from __future__ import annotations

import ctypes
import hashlib
from dataclasses import dataclass
from functools import cache

import gguf
import torch

from zhuzi.model import native

Q = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class BlockType:
    """A GGUF block type the kernels serve, as kernels/blocks.h lays it out: every one is dequantized
    (dequantize_blocks.cpp), packed (packed_layout.h) and multiplied by block_linear.cpp and the fused decode
    step (decode_step.cpp), packed or not. A type outside TYPES is dequantized by the gguf package and runs
    dense."""

    qtype: Q
    inputs: int  # weights a block holds
    nbytes: int  # a block's bytes in the file
    packed_bytes: int  # a block's bytes in a packed row: the file's, bar the 6-bit scales of Q4_K, Q5_K, IQ4_XS
    made_by: str | None = None  # the --quantization that makes it at load from dense weights (quant.py)


TYPES = {t.qtype: t for t in (
    BlockType(Q.IQ4_NL, 32, 18, 18), BlockType(Q.IQ4_XS, 256, 136, 138), BlockType(Q.MXFP4, 32, 17, 17),
    BlockType(Q.Q4_0, 32, 18, 18), BlockType(Q.Q4_1, 32, 20, 20, "int4"), BlockType(Q.Q5_0, 32, 22, 22),
    BlockType(Q.Q5_1, 32, 24, 24), BlockType(Q.Q8_0, 32, 34, 34, "int8"), BlockType(Q.Q4_K, 256, 144, 148),
    BlockType(Q.Q5_K, 256, 176, 180), BlockType(Q.Q6_K, 256, 210, 210),
    BlockType(Q.Q3_K, 256, 110, 110), BlockType(Q.Q2_K, 256, 84, 84))}
PACKED_FLAG = 0x100  # kernels/packed_layout.h's FLAG: a packed matrix's type id is FLAG | its ggml type
_OUT = {torch.float32: 0, torch.bfloat16: 1}


def _dequantize_kernel():
    return native.entry("dequantize_blocks", "zhuzi_dequantize_rows",
                        [ctypes.c_int, ctypes.c_void_p] + [ctypes.c_int64] * 2 + [ctypes.c_void_p]
                        + [ctypes.c_int64] * 2 + [ctypes.c_void_p, ctypes.c_int, ctypes.c_int])


def _pack_kernel():
    return native.entry("dequantize_blocks", "zhuzi_pack_blocks",
                        [ctypes.c_int, ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] + [ctypes.c_int] * 2)


def _linear_kernel():
    return native.entry("block_linear", "zhuzi_block_linear",
                        [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
                        + [ctypes.c_int64] * 3 + [ctypes.c_int])


def dequantize_serves(qtype: int) -> bool:
    """Whether this process's kernels dequantize rows of this type (a packed one's too)."""
    return int(qtype) & ~PACKED_FLAG in TYPES and _dequantize_kernel() is not None


def linear_serves(qtype: int) -> bool:
    """Whether block_linear serves matrices of this type here."""
    return int(qtype) in TYPES and _linear_kernel() is not None


def packs(qtype: int, data: torch.Tensor, in_features: int) -> bool:
    """Whether the kernel packs this block matrix (uint8 [rows, bytes per row]): a type of TYPES, whole groups
    of 16 contiguous rows of in_features inputs, on CPU."""
    t = TYPES.get(int(qtype))
    if t is None:
        return False
    rows, row_bytes = data.shape
    return (rows % 16 == 0 and in_features % t.inputs == 0 and row_bytes == in_features // t.inputs * t.nbytes
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
    t = TYPES[int(qtype)]
    return rows, in_features // t.inputs * t.packed_bytes


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
                    dtype: torch.dtype) -> torch.Tensor:
    """Rows ids (all rows when None) of a block matrix of a type dequantize_serves() (uint8 [rows, bytes per
    row], contiguous rows, on CPU) as [n, in_features] values in dtype (float32 or bf16; others converted from
    float32)."""
    ids = ids.to(torch.int64, copy=False).contiguous().cpu() if ids is not None else None
    n = data.shape[0] if ids is None else ids.numel()
    out = torch.empty(n, in_features, dtype=dtype if dtype in _OUT else torch.float32)
    status = _dequantize_kernel()(int(qtype), data.data_ptr(), data.shape[0], data.stride(0),
                                  None if ids is None else ids.data_ptr(), n, in_features, out.data_ptr(),
                                  _OUT[out.dtype], torch.get_num_threads())
    if status == 1:
        raise IndexError(f"a row id is outside 0..{data.shape[0] - 1}")
    if status:
        raise ValueError(f"the dequantizer does not take a {tuple(data.shape)} matrix of type {int(qtype)}")
    return out.to(dtype)


class _Part(ctypes.Structure):
    """kernels/block_linear.cpp's Part: one matrix of blocks whose output rows follow the previous part's."""

    _fields_ = [("type", ctypes.c_int32), ("w", ctypes.c_void_p), ("rows", ctypes.c_int64),
                ("row_bytes", ctypes.c_int64)]


def prefill_on_amx() -> bool:
    """Whether block_linear's calls of many rows run through AMX tiles here (the avx512 build, on a CPU with
    AMX-INT8 whose kernel grants the tile state)."""
    fn = native.entry("block_linear", "zhuzi_block_linear_amx", [])
    return fn is not None and fn() == 1


def part_table(parts) -> ctypes.Array:
    """The kernel's view of a layer's parts (blocks.BlockWeight, whose data the layer keeps alive)."""
    return (_Part * len(parts))(*[_Part(p.kernel_type, p.data.data_ptr(), p.data.shape[0], p.data.stride(0))
                                  for p in parts])


def block_linear(x: torch.Tensor, table: ctypes.Array, out_features: int,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = x @ W^T for W the parts' rows one after another, of types linear_serves(); x: [M, K] float32 or bf16
    on CPU, quantized to q8 blocks with one scale per 32 inputs (per 256 for the K-quants: kernels/block_dot.h).
    Returns [M, out_features] in out_dtype (default x's)."""
    if not (x.is_cpu and x.dtype in _OUT and x.dim() == 2 and x.shape[0] > 0):
        raise ValueError(f"GGUF blocks take float32 or bf16 CPU rows, not {tuple(x.shape)} {x.dtype} on {x.device}")
    x = x.contiguous()
    y = torch.empty(x.shape[0], out_features, dtype=out_dtype or x.dtype)
    status = _linear_kernel()(ctypes.addressof(table), len(table), x.data_ptr(), _OUT[x.dtype], y.data_ptr(),
                              _OUT[y.dtype], x.shape[0], out_features, x.shape[1], torch.get_num_threads())
    if status:
        raise ValueError(f"the block kernel does not take these parts for {tuple(x.shape)} inputs")
    return y
