"""On-disk caches of start-up work (not the KV cache): converted tokenizers, weight digests, compiled kernels,
packed GGUF weights.

Each entry lives at $ZHUZI_CACHE (default ~/.cache/zhuzi) / kind / name-digest, where the digest
covers everything the entry was made from, so a changed input is never answered from a stale
entry. Entries are written under a temporary name and renamed into place, so a reader never sees
half an entry and concurrent writers never see each other's; an entry that costs seconds to make (a
kernel build) is made by one process while the others wait for it (one_maker).
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("ZHUZI_CACHE") or Path.home() / ".cache" / "zhuzi")


def cache_path(kind: str, name: str, *key: object, suffix: str = "") -> Path:
    """Where the entry made from key lives."""
    digest = hashlib.sha256("\0".join(map(str, key)).encode()).hexdigest()[:16]
    return cache_root() / kind / f"{name}-{digest}{suffix}"


def file_identity(path: Path) -> tuple[str, int, int]:
    """What tells a file apart from its earlier versions without reading it."""
    stat = path.stat()
    return str(path.resolve()), stat.st_size, stat.st_mtime_ns


@contextmanager
def one_maker(target: Path) -> Iterator[None]:
    """Held by one process (or thread) at a time for target: the next waits for the first to finish making
    it, then finds it there, instead of making the same entry side by side (two servers, or two test
    workers, starting on a cold cache)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(f".{target.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        yield


@contextmanager
def atomic_write(target: Path) -> Iterator[Path]:
    """Yields a temporary path to create a file or folder at; it becomes target when the block ends
    without an error. When another writer published a folder first, theirs is kept."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        yield tmp
        try:
            os.replace(tmp, target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)


def content_digest(files: list[Path]) -> str:
    """A digest of a model's stored weights (its files: loader.weight_files), the same wherever those bytes lie;
    read once, then remembered by the files' identities."""
    entry = cache_path("digests", files[0].name, *(part for f in files for part in file_identity(f)))
    try:
        return entry.read_text()
    except OSError:
        pass
    digest = hashlib.blake2b(digest_size=16)
    for file in files:
        with open(file, "rb") as f:
            digest.update(hashlib.file_digest(f, "blake2b").digest())
    text = digest.hexdigest()
    try:
        with atomic_write(entry) as tmp:
            tmp.write_text(text)
    except OSError:
        pass  # a read-only cache: the next start reads the weights again
    return text
