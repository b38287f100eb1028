"""GGUF weights as the file stores them (loader -> decoder -> linear.py): a matrix's rows of quantized blocks,
read in place from the memory-mapped file (or made at load by quant.py), and their exact values where a layer
needs them dense. A linear layer's matrices are repacked at load into the kernels' layout; a file's matrix is
packed once, into zhuzi's disk cache (kind "packed"), which later loads map. docs/cpu.md describes both.
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from zhuzi.disk_cache import atomic_write, cache_path
from zhuzi.model import cpu_blocks

log = logging.getLogger(__name__)

Q = gguf.GGMLQuantizationType
DENSE_TYPES = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}


@dataclass(frozen=True)
class Origin:
    """Where a matrix's rows lie in a file: the file as disk_cache.file_identity() tells its versions apart,
    and the byte its first row starts at."""

    file: tuple[str, int, int]
    offset: int


@dataclass(frozen=True)
class BlockWeight:
    """A [rows, in_features] matrix of GGUF blocks; data: uint8 [rows, bytes per row]."""

    qtype: gguf.GGMLQuantizationType
    data: torch.Tensor
    in_features: int
    packed: bool = False  # data in kernels/packed_layout.h's layout: rows in groups of 16
    # origin: data is a view of this file's mapping, nothing written: its pages may be dropped, and its packed
    # copy is cached
    origin: Origin | None = None

    @property
    def kernel_type(self) -> int:
        """The type id the kernels take: the ggml type, or packed_layout.h's FLAG | it."""
        return int(self.qtype) | (cpu_blocks.PACKED_FLAG if self.packed else 0)

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.in_features

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def __getitem__(self, rows: slice) -> BlockWeight:
        start, _, step = rows.indices(self.data.shape[0])
        origin = None if self.origin is None or step != 1 else \
            Origin(self.origin.file, self.origin.offset + start * self.data.stride(0))
        return BlockWeight(self.qtype, self.data[rows], self.in_features, self.packed, origin)

    def pack(self) -> BlockWeight:
        """This matrix in the kernels' packed layout where they have one for its type and shape, else itself. A
        file's matrix is packed once, into the disk cache, whose entry later loads map (_cached_pack)."""
        if self.packed or not cpu_blocks.packs(self.qtype, self.data, self.in_features):
            return self
        data = cpu_blocks.pack_rows(self.qtype, self.data, self.in_features) if self.origin is None \
            else _cached_pack(self)
        return BlockWeight(self.qtype, data, self.in_features, packed=True)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Every row's exact values, in dtype."""
        return self._values(None, dtype)

    def take(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ids (an embedding lookup), [len(ids), in_features] in dtype."""
        return self._values(ids.reshape(-1), dtype).view(*ids.shape, self.in_features)

    def _values(self, ids: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        if cpu_blocks.dequantize_serves(self.kernel_type):
            return cpu_blocks.dequantize_rows(self.kernel_type, self.data, self.in_features, ids, dtype)
        rows = self.data if ids is None else self.data[ids.cpu()]
        flat = gguf.quants.dequantize(rows.numpy(), self.qtype)  # [rows, in_features] float32
        return torch.from_numpy(np.ascontiguousarray(flat)).to(dtype)


def runs(qtype: gguf.GGMLQuantizationType) -> bool:
    """Whether zhuzi runs a matrix of this block type: the kernels compute it, or the gguf package dequantizes
    it (tried on one block of zeros)."""
    if qtype in cpu_blocks.TYPES:
        return True
    try:
        gguf.quants.dequantize(np.zeros(gguf.GGML_QUANT_SIZES[qtype][1], np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def _entry(w: BlockWeight) -> Path:
    """Where the disk cache keeps a file's matrix packed: a folder per version of the file and of the packed
    layout, a file per matrix named by its first byte in the file, its shape and type."""
    folder = cache_path("packed", Path(w.origin.file[0]).stem, *w.origin.file, cpu_blocks.layout_version())
    return folder / f"{w.origin.offset}-{w.shape[0]}x{w.in_features}-{w.qtype.name}"


_unwritable: set[Path] = set()  # cache folders a load could not write to, warned of once
_claimed: set[Path] = set()  # cache folders this process has recorded (_claim)


def _record(folder: Path) -> Path:
    """The file beside a packed folder that says which GGUF it was packed from."""
    return folder.with_name(f"{folder.name}.json")


def _claim(folder: Path, file: str) -> None:
    """Records, once, that folder holds file's matrices, and removes its stale neighbours: the folders of the
    same name that hold an earlier version of file (or an earlier packed layout), a file that is gone, or were
    made before records were kept. A process still mapping one keeps its pages; the next load repacks."""
    record = _record(folder)
    if folder in _claimed or record.exists():
        _claimed.add(folder)
        return
    try:
        with atomic_write(record) as tmp:
            tmp.write_text(json.dumps({"file": file}))
    except OSError:
        return  # an unwritable cache: _cached_pack says so
    _claimed.add(folder)
    stem = folder.name.rsplit("-", 1)[0]
    for other in folder.parent.iterdir():
        if other.is_dir() and other != folder and other.name.rsplit("-", 1)[0] == stem and _stale(other, file):
            shutil.rmtree(other, ignore_errors=True)
            _record(other).unlink(missing_ok=True)


def _stale(folder: Path, file: str) -> bool:
    try:
        packed_from = json.loads(_record(folder).read_text())["file"]
    except (OSError, ValueError, KeyError):
        return True  # made before records were kept, or its record was cut short
    return packed_from == file or not Path(packed_from).exists()


def _cached_pack(w: BlockWeight) -> torch.Tensor:
    """A file's matrix packed, as a mapping of its disk cache entry (clean pages of a file, like the GGUF's).
    On a miss it is packed from the file's mapping, whose pages then leave the process, into the entry;
    where the cache cannot be written (read-only, full), into memory."""
    entry = _entry(w)
    _claim(entry.parent, w.origin.file[0])
    if not entry.exists():
        try:
            # Two loads packing the same matrix at once each write a whole entry of the same bytes: the last
            # rename wins, and a reader never sees half of one.
            with atomic_write(entry) as tmp:
                _pack_into_file(w, tmp)
        except OSError as e:
            if entry.parent not in _unwritable:
                _unwritable.add(entry.parent)
                log.warning("packed weights cannot be cached in %s (%s): every load repacks them", entry.parent, e)
            return cpu_blocks.pack_rows(w.qtype, w.data, w.in_features, release=True)
    return torch.from_numpy(np.memmap(entry, dtype=np.uint8, mode="c")).view(w.shape[0], -1)


def _pack_into_file(w: BlockWeight, path: Path) -> None:
    """w packed straight into a new file, through a shared mapping of it: no copy in anonymous memory, which
    the allocator would keep (on huge pages) once freed."""
    shape = cpu_blocks.packed_shape(w.qtype, *w.shape)
    with path.open("wb") as f:
        os.posix_fallocate(f.fileno(), 0, math.prod(shape))  # a full disk fails here, not as a SIGBUS below
    out = np.memmap(path, dtype=np.uint8, mode="r+", shape=shape)
    cpu_blocks.pack_rows(w.qtype, w.data, w.in_features, release=True, out=torch.from_numpy(out))
    out.flush()
    del out
    # Pages written through a mapping stay small folios in the page cache; read back by readahead they come as
    # large ones, which a mapping of the entry gets on huge pages (2 MiB, where aligned): a decode step streams
    # the weights with far fewer TLB misses. So the written pages go to disk and leave the cache now, once per
    # entry.
    with path.open("rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
