"""The GGUF header (model loading): a llama.cpp file's metadata and tensor directory, read in place from a
memory map without decoding its vocabulary."""
from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import torch

from zhuzi.model.blocks import DENSE_TYPES

GGUF_SCALARS = {
    gguf.GGUFValueType.UINT8: "B", gguf.GGUFValueType.INT8: "b", gguf.GGUFValueType.UINT16: "H",
    gguf.GGUFValueType.INT16: "h", gguf.GGUFValueType.UINT32: "I", gguf.GGUFValueType.INT32: "i",
    gguf.GGUFValueType.FLOAT32: "f", gguf.GGUFValueType.BOOL: "?", gguf.GGUFValueType.UINT64: "Q",
    gguf.GGUFValueType.INT64: "q", gguf.GGUFValueType.FLOAT64: "d",
}
INTEGERS = {kind for kind, fmt in GGUF_SCALARS.items() if fmt in "BbHhIiQq"}
PER_LAYER_VALUES = 1024  # an integer array this short is read (a value per layer); a longer one is a vocabulary's


@dataclass
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (GGUF lists dimensions innermost first)
    qtype: gguf.GGMLQuantizationType
    offset: int  # absolute, in bytes
    nbytes: int


@dataclass
class GGUFHeader:
    path: Path
    # scalar values; arrays appear as their length, but bool arrays (per-layer flags) and short integer ones (a
    # value per layer: KV heads, MLP widths) as lists
    metadata: dict[str, Any]
    tensors: list[GGUFTensorInfo]

    def has(self, name: str) -> bool:
        return any(t.name == name for t in self.tensors)

    def vector(self, name: str) -> list[float]:
        """A small float tensor's values, read from the file (a config needs them before any tensor is mapped)."""
        info = next(t for t in self.tensors if t.name == name)
        if info.qtype not in DENSE_TYPES:
            raise ValueError(f"tensor {info.name} is {info.qtype.name}, not a float type")
        with self.path.open("rb") as f:
            f.seek(info.offset)
            raw = bytearray(f.read(info.nbytes))
        return torch.frombuffer(raw, dtype=DENSE_TYPES[info.qtype]).float().tolist()


class _Cursor:
    """Reads little-endian GGUF fields from a buffer; struct.error means the buffer ended early."""

    def __init__(self, buffer: mmap.mmap):
        self.buffer, self.pos = buffer, 0

    def read(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.read("Q")
        if self.pos + length > len(self.buffer):
            raise struct.error("string runs past the end of the file")
        self.pos += length
        return self.buffer[self.pos - length:self.pos].decode("utf-8", "replace")

    def value(self, kind: gguf.GGUFValueType) -> Any:
        if kind == gguf.GGUFValueType.STRING:
            return self.string()
        if kind == gguf.GGUFValueType.ARRAY:
            return self.skip_array()
        return self.read(GGUF_SCALARS[kind])

    def skip_array(self) -> int | list[bool]:
        kind, count = gguf.GGUFValueType(self.read("I")), self.read("Q")
        if kind == gguf.GGUFValueType.BOOL:  # a flag per layer (sliding_window_pattern): small, and its values count
            self.pos += count
            return [bool(b) for b in self.buffer[self.pos - count:self.pos]]
        if kind in INTEGERS and count <= PER_LAYER_VALUES:
            return [self.read(GGUF_SCALARS[kind]) for _ in range(count)]
        if kind in GGUF_SCALARS:
            self.pos += count * struct.calcsize(GGUF_SCALARS[kind])
        elif kind == gguf.GGUFValueType.STRING:  # a vocabulary: ~100,000 lengths to step over, none decoded
            length, pos = struct.Struct("<Q").unpack_from, self.pos
            for _ in range(count):
                pos += 8 + length(self.buffer, pos)[0]
            if pos > len(self.buffer):
                raise struct.error("a string array runs past the end of the file")
            self.pos = pos
        else:
            for _ in range(count):
                self.value(kind)
        return count


class UnknownTensorType(ValueError):
    """A tensor of a ggml type id the gguf package does not know (a newer file's type): no corrupt header."""


def read_gguf_header(path: Path) -> GGUFHeader:
    """Metadata and tensor directory of a GGUF file, read directly: gguf.GGUFReader builds numpy views of
    every vocabulary array, which costs a large vocabulary far more than skipping them (docs/benchmarks.md).
    ValueError names what is wrong with the file."""
    with path.open("rb") as f:
        if f.read(4) != struct.pack("<I", gguf.GGUF_MAGIC):
            raise ValueError("not a GGUF file (bad magic number)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
            try:
                return _parse(path, _Cursor(buffer))
            except UnknownTensorType:
                raise
            except (struct.error, ValueError, KeyError) as e:
                raise ValueError(f"truncated or corrupt GGUF header ({e})") from None


def _parse(path: Path, cursor: _Cursor) -> GGUFHeader:
    cursor.pos = 4
    version = cursor.read("I")
    if version not in (2, 3):
        raise ValueError(f"unsupported GGUF version {version}")
    tensor_count, kv_count = cursor.read("Q"), cursor.read("Q")
    metadata = {}
    for _ in range(kv_count):
        key = cursor.string()
        metadata[key] = cursor.value(gguf.GGUFValueType(cursor.read("I")))
    infos = []
    for _ in range(tensor_count):
        name = cursor.string()
        dims = [cursor.read("Q") for _ in range(cursor.read("I"))]
        type_id, offset = cursor.read("I"), cursor.read("Q")
        if type_id not in gguf.GGML_QUANT_SIZES:
            raise UnknownTensorType(f"tensor {name} is of ggml type {type_id}, which zhuzi does not know")
        qtype = gguf.GGMLQuantizationType(type_id)
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        infos.append(GGUFTensorInfo(name, tuple(reversed(dims)), qtype, offset,
                                    math.prod(dims) // block_size * type_size))
    alignment = metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
    data_start = -(-cursor.pos // alignment) * alignment
    for info in infos:
        info.offset += data_start
        if info.offset + info.nbytes > len(cursor.buffer):
            raise ValueError(f"truncated: tensor {info.name} ends at byte {info.offset + info.nbytes} "
                             f"but the file has {len(cursor.buffer)} bytes")
    return GGUFHeader(path, metadata, infos)
