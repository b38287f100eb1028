"""The on-disk caches' one helper: keys that see a changed input, and writes a reader never sees half of."""
import os
from pathlib import Path

import pytest

from zhuzi.disk_cache import atomic_write, cache_path, file_identity


@pytest.fixture(autouse=True)
def cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ZHUZI_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_an_entry_is_keyed_by_the_file_it_was_made_from(tmp_path: Path, cache_root: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    before = cache_path("tokenizers", "m", *file_identity(model))
    assert before.parent == cache_root / "tokenizers" and before.name.startswith("m-")
    assert cache_path("tokenizers", "m", *file_identity(model)) == before
    os.utime(model, ns=(0, 10**18))  # a new version of the file: a new entry
    assert cache_path("tokenizers", "m", *file_identity(model)) != before


def test_a_failed_write_leaves_nothing_behind(cache_root: Path) -> None:
    target = cache_path("kernels", "k", "source", suffix=".so")
    with pytest.raises(RuntimeError), atomic_write(target) as tmp:
        tmp.write_bytes(b"half a library")
        raise RuntimeError("compiler crashed")
    assert not target.exists() and list(target.parent.iterdir()) == []


def test_a_finished_write_appears_whole_and_a_second_folder_keeps_the_first(cache_root: Path) -> None:
    target = cache_path("tokenizers", "t", "key")
    for content in ("first", "second"):
        with atomic_write(target) as tmp:
            tmp.mkdir()
            (tmp / "tokenizer.json").write_text(content)
    assert (target / "tokenizer.json").read_text() == "first"
    assert [p.name for p in target.parent.iterdir()] == [target.name]
