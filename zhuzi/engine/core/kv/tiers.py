"""The KV tiers below the pool: a bounded host-memory tier and a disk tier, each an LRU cache of whole
pages (or a hybrid model's states after pages) known by their prefix hash (connector.py decides what goes
where). A pinned page (its hash in the shared `pinned` set) is never evicted from a tier."""
from __future__ import annotations

import atexit
import logging
import math
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Container
from dataclasses import replace
from itertools import islice
from pathlib import Path
from typing import Any

import torch

from zhuzi.outputs import KVTierStats

log = logging.getLogger("zhuzi")

HEADER = struct.Struct("<8s16s16sQI4x")  # magic, identity digest, page hash, payload bytes, CRC-32
MAGIC = b"ZHUZIKV1"
WRITE_QUEUE_PAGES = 512  # pages waiting for the writer; beyond it a save is dropped (and counted)
STALE_TMP_S = 600.0  # a temporary file this old was left by a writer that died mid-write


class HostTier:
    """Pages in this process's memory, at most capacity bytes, least recently used evicted first."""

    def __init__(self, capacity: int, page_bytes: int, pinned: Container[bytes]):
        self.capacity, self.page_bytes, self.pinned = capacity, page_bytes, pinned
        self.pages: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.counts = KVTierStats()

    def __contains__(self, h: bytes) -> bool:
        return h in self.pages

    def put(self, h: bytes, data: torch.Tensor) -> None:
        if h in self.pages:
            self.pages.move_to_end(h)
            return
        if not _make_room(self.pages, self.pinned, self.capacity // self.page_bytes - 1, self._evict):
            self.counts.dropped += 1
            return
        self.pages[h] = data
        self.counts.stored += 1

    def get(self, h: bytes) -> torch.Tensor | None:
        data = self.pages.get(h)
        if data is not None:
            self.pages.move_to_end(h)
        return data

    def _evict(self, h: bytes) -> None:
        del self.pages[h]
        self.counts.evicted += 1

    def snapshot(self) -> KVTierStats:
        return replace(self.counts, pages=len(self.pages), bytes=len(self.pages) * self.page_bytes)


def _make_room(entries: OrderedDict[bytes, Any], pinned: Container[bytes], keep: int,
               evict: Callable[[bytes], None]) -> bool:
    """Evict the least recently used unpinned entries until at most keep remain; False if pins forbid it."""
    if keep < 0:
        return False
    # Walk from the oldest only as far as the victims needed: usually one, past whatever pins hold.
    for h in list(islice((h for h in entries if h not in pinned), max(0, len(entries) - keep))):
        evict(h)
    return len(entries) <= keep


class DiskTier:
    """Pages as files in folder (one folder per page identity, connector.KVLayout), at most capacity bytes
    of them. A file is a 56-byte header (magic, identity digest, page hash, payload length, CRC-32 of the
    payload) and the payload, written under a temporary name and renamed into place, so neither a reader nor
    a kill -9 ever leaves half a page behind; a file whose header or checksum does not match is skipped with
    a warning, never loaded. Writes run on a thread of their own, so the step loop never waits for the disk.
    Files and their modification times outlive the process: a restarted engine finds its pages, least
    recently used first. A hybrid model's states are a second such tier in the same folder, files of another
    suffix; on_evict lets the states after a page go with it."""

    def __init__(self, folder: Path, capacity: int, identity: bytes, shape: tuple[int, ...], dtype: torch.dtype,
                 pinned: Container[bytes], suffix: str = ".kv", on_evict: Callable[[bytes], None] | None = None):
        self.folder, self.identity, self.shape, self.dtype, self.pinned = folder, identity, shape, dtype, pinned
        self.suffix, self.on_evict = suffix, on_evict
        self.payload_bytes = dtype.itemsize * math.prod(shape)
        self.file_bytes = HEADER.size + self.payload_bytes
        self.capacity = capacity
        self.counts = KVTierStats()
        self._lock = threading.Lock()  # the index: the step loop reads it, the writer adds to it
        self.index: OrderedDict[bytes, None] = OrderedDict()  # least recently used first
        self._pending: set[bytes] = set()  # queued for the writer
        self._queue: queue.Queue[tuple[bytes, torch.Tensor] | None] = queue.Queue(WRITE_QUEUE_PAGES)
        folder.mkdir(parents=True, exist_ok=True)
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="zhuzi-kv-disk", daemon=True)
        self._writer.start()
        atexit.register(self.close)  # an offline LLM's queued pages are written before the interpreter ends

    def path(self, h: bytes) -> Path:
        return self.folder / (h.hex() + self.suffix)

    def _scan(self) -> None:
        """Index the files a previous run (or another replica sharing the folder) left, oldest first."""
        found = []
        now = time.time()
        for entry in os.scandir(self.folder):
            name, stat = entry.name, entry.stat()
            if name.startswith(".") and name.endswith(".tmp") and now - stat.st_mtime > STALE_TMP_S:
                Path(entry.path).unlink(missing_ok=True)
            elif (h := _hash_of(name, self.suffix)) is not None and stat.st_size == self.file_bytes:
                found.append((stat.st_mtime, h))
        with self._lock:
            for _, h in sorted(found):
                self.index[h] = None
            self._make_room(0)

    def __contains__(self, h: bytes) -> bool:
        with self._lock:
            if h in self.index or h in self._pending:
                return True
        if self.path(h).is_file():  # written by another replica that shares the folder
            with self._lock:
                self.index[h] = None
            return True
        return False

    def put(self, h: bytes, data: torch.Tensor) -> None:
        """Queue a page for writing (a copy: the pool may reuse its slots at once)."""
        with self._lock:
            if h in self.index or h in self._pending:
                return
            try:
                self._queue.put_nowait((h, data))
            except queue.Full:
                self.counts.dropped += 1
                return
            self._pending.add(h)

    def get(self, h: bytes) -> torch.Tensor | None:
        """The page's K/V, or None: missing, or refused (corrupt or foreign) with a warning."""
        path = self.path(h)
        try:
            raw = path.read_bytes()
        except OSError:
            self._forget(h)
            return None
        if (problem := self._check(h, raw)) is not None:
            log.warning("KV disk tier: skipping %s: %s", path.name, problem)
            self.counts.refused += 1
            self._forget(h)
            if problem.startswith("corrupt"):
                path.unlink(missing_ok=True)
            return None
        try:
            os.utime(path)  # its recency outlives the process: a restart evicts the least recently used first
        except OSError:
            pass
        with self._lock:
            self.index[h] = None
            self.index.move_to_end(h)
        return torch.frombuffer(bytearray(raw[HEADER.size:]), dtype=self.dtype).view(self.shape)

    def _check(self, h: bytes, raw: bytes) -> str | None:
        if len(raw) < HEADER.size:
            return f"corrupt: {len(raw)} bytes, shorter than its header"
        magic, identity, page_hash, length, crc = HEADER.unpack_from(raw)
        if magic != MAGIC:
            return "foreign: not a zhuzi KV page file"
        if identity != self.identity or page_hash != h:
            return "foreign: written for another model, dtype or layout"
        if length != self.payload_bytes or len(raw) != self.file_bytes:
            return f"corrupt: {len(raw) - HEADER.size} payload bytes, expected {self.payload_bytes}"
        if zlib.crc32(memoryview(raw)[HEADER.size:]) != crc:
            return "corrupt: checksum mismatch"
        return None

    def _forget(self, h: bytes) -> None:
        with self._lock:
            self.index.pop(h, None)

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            h, data = item
            try:
                self._write(h, data)
            except OSError as exc:
                log.warning("KV disk tier: cannot write a page to %s: %s", self.folder, exc)
                self.counts.dropped += 1
            finally:
                with self._lock:
                    self._pending.discard(h)
                self._queue.task_done()
        self._queue.task_done()

    def _write(self, h: bytes, data: torch.Tensor) -> None:
        payload = data.contiguous().view(torch.uint8).reshape(-1).numpy()
        header = HEADER.pack(MAGIC, self.identity, h, len(payload), zlib.crc32(payload))
        target = self.path(h)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, target)  # atomic: the name shows a whole page or nothing
        finally:
            tmp.unlink(missing_ok=True)
        with self._lock:
            self._make_room(1)
            self.index[h] = None
            self.counts.stored += 1

    def _make_room(self, incoming: int) -> None:
        """Under the lock: delete least recently used unpinned files until incoming more fit."""
        keep = self.capacity // self.file_bytes - incoming
        if not _make_room(self.index, self.pinned, keep, self._evict) and incoming:
            log.warning("KV disk tier: full of pinned pages; %d over its bound", len(self.index) + incoming - keep)

    def _evict(self, h: bytes) -> None:
        del self.index[h]
        self.path(h).unlink(missing_ok=True)
        self.counts.evicted += 1
        if self.on_evict is not None:
            self.on_evict(h)

    def discard(self, h: bytes) -> None:
        """Delete h's file (its page went: nothing can resume from it); one still queued is written after."""
        with self._lock:
            if h in self.index:
                self._evict(h)

    def flush(self) -> None:
        """Wait until every page queued so far is written (or given up)."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the writer (once)."""
        atexit.unregister(self.close)
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()

    @property
    def writing(self) -> bool:
        """Pages are queued for the writer or being written."""
        with self._lock:
            return bool(self._pending)

    def snapshot(self) -> KVTierStats:
        with self._lock:
            pages = len(self.index)
        return replace(self.counts, pages=pages, bytes=pages * self.file_bytes)


def _hash_of(name: str, suffix: str) -> bytes | None:
    if not name.endswith(suffix) or len(name) != 32 + len(suffix):
        return None
    try:
        return bytes.fromhex(name[:32])
    except ValueError:
        return None
