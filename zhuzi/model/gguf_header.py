"""The GGUF header (model loading): a llama.cpp file's metadata and tensor directory, read in place from a
memory map without decoding its vocabulary; a split GGUF's parts (llama.cpp's gguf-split) read as one."""
from __future__ import annotations

import math
import mmap
import re
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
SPLIT_PART = re.compile(r"(.+)-(\d{5})-of-(\d{5})\.gguf")  # llama.cpp's gguf-split names its parts so
SPLIT_NO, SPLIT_COUNT = gguf.Keys.Split.LLM_KV_SPLIT_NO, gguf.Keys.Split.LLM_KV_SPLIT_COUNT
SPLIT_TENSORS = gguf.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT


@dataclass
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (GGUF lists dimensions innermost first)
    qtype: gguf.GGMLQuantizationType
    offset: int  # absolute, in bytes
    nbytes: int
    file: Path  # the file it lies in: the GGUF, or the split's part


@dataclass
class GGUFHeader:
    path: Path  # the file, or a split's first part (which holds the metadata)
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
        with info.file.open("rb") as f:
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
                                    math.prod(dims) // block_size * type_size, path))
    alignment = metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
    data_start = -(-cursor.pos // alignment) * alignment
    for info in infos:
        info.offset += data_start
        if info.offset + info.nbytes > len(cursor.buffer):
            raise ValueError(f"truncated: tensor {info.name} ends at byte {info.offset + info.nbytes} "
                             f"but the file has {len(cursor.buffer)} bytes")
    return GGUFHeader(path, metadata, infos)


def _split_parts(path: Path) -> list[Path]:
    """The files of the GGUF path names: itself, or, named as a split's part, every part of that split in order."""
    name = SPLIT_PART.fullmatch(path.name)
    if name is None:
        return [path]
    count = int(name[3])
    return [path.with_name(f"{name[1]}-{n:05d}-of-{count:05d}.gguf") for n in range(1, count + 1)]


def read_gguf(path: Path) -> GGUFHeader:
    """A GGUF model's header: a file's, or a split's (named by its first part, as llama.cpp loads one): the first
    part's metadata and every part's tensors. ValueError names a part that is missing or of another split."""
    first = read_gguf_header(path)
    count = first.metadata.get(SPLIT_COUNT, 1)
    if count <= 1:
        return first
    if (no := first.metadata.get(SPLIT_NO)) != 0:
        raise ValueError(f"part {no + 1} of a split GGUF of {count} parts: load the split by its first part")
    parts = _split_parts(path)
    if len(parts) != count:
        raise ValueError(f"a split GGUF of {count} parts, not named as gguf-split names them (NAME-00001-of-"
                         f"{count:05d}.gguf)")
    expected = (first.metadata.get(SPLIT_TENSORS), count)
    tensors = {t.name: t for t in first.tensors}
    for no, part in enumerate(parts[1:], 1):
        if not part.is_file():
            raise ValueError(f"split GGUF part {part.name} is missing")
        try:
            header = read_gguf_header(part)
        except ValueError as e:
            raise ValueError(f"split GGUF part {part.name}: {e}") from None
        split = (header.metadata.get(SPLIT_TENSORS), header.metadata.get(SPLIT_COUNT), header.metadata.get(SPLIT_NO))
        if split != (*expected, no) or any(t.name in tensors for t in header.tensors):
            raise ValueError(f"split GGUF part {part.name} is part of another split")
        tensors |= {t.name: t for t in header.tensors}
    if len(tensors) != expected[0]:
        raise ValueError(f"split GGUF of {count} parts holds {len(tensors)} tensors, its first part lists "
                         f"{expected[0]}: a part is of another split")
    return GGUFHeader(path, first.metadata, list(tensors.values()))
