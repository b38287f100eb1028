"""The KV tiers on their own (no model): LRU order, bounds, pins, checksums, foreign files, kill -9, a hybrid
model's state files beside their pages."""
import logging
import multiprocessing
import os
import signal
from collections import Counter

import torch

from zhuzi.engine.core.kv.tiers import HEADER, DiskTier, HostTier

SHAPE = (2, 2, 4, 2, 8)  # layers, K/V, page_size, kv_heads, head_dim
PAGE_BYTES = 2 * 2 * 4 * 2 * 8 * 4  # float32
IDENTITY = b"i" * 16


def h(n: int) -> bytes:
    return n.to_bytes(16, "big")


def page(n: int) -> torch.Tensor:
    return torch.full(SHAPE, float(n))


def disk(folder, pages: int = 4, pinned=None, identity: bytes = IDENTITY) -> DiskTier:
    tier = DiskTier(folder, pages * (PAGE_BYTES + HEADER.size), identity, SHAPE, torch.float32, pinned or Counter())
    return tier


def test_the_host_tier_evicts_the_least_recently_used_page_first():
    tier = HostTier(3 * PAGE_BYTES, PAGE_BYTES, Counter())
    for n in range(3):
        tier.put(h(n), page(n))
    assert tier.get(h(0)) is not None  # 0 is now the most recently used: 1 goes first
    tier.put(h(3), page(3))
    assert [h(0) in tier, h(1) in tier, h(2) in tier, h(3) in tier] == [True, False, True, True]
    assert torch.equal(tier.get(h(3)), page(3))
    stats = tier.snapshot()
    assert (stats.pages, stats.bytes, stats.stored, stats.evicted) == (3, 3 * PAGE_BYTES, 4, 1)


def test_pinned_pages_stay_in_the_host_tier_and_a_tier_full_of_pins_drops_new_pages():
    pinned = Counter({h(0): 1, h(1): 1})
    tier = HostTier(2 * PAGE_BYTES, PAGE_BYTES, pinned)
    tier.put(h(0), page(0))
    tier.put(h(1), page(1))
    tier.put(h(2), page(2))
    assert h(0) in tier and h(1) in tier and h(2) not in tier and tier.snapshot().dropped == 1
    del pinned[h(0)]
    tier.put(h(2), page(2))
    assert h(0) not in tier and h(1) in tier and h(2) in tier


def test_the_disk_tier_writes_whole_pages_reads_them_back_and_finds_them_after_a_restart(tmp_path):
    tier = disk(tmp_path)
    for n in range(3):
        tier.put(h(n), page(n))
    tier.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(h(n).hex() + ".kv" for n in range(3))
    again = disk(tmp_path)
    assert all(h(n) in again for n in range(3)) and h(9) not in again
    assert torch.equal(again.get(h(1)), page(1))
    again.close()


def test_the_disk_tier_keeps_within_its_bound_least_recently_used_first_across_restarts(tmp_path):
    tier = disk(tmp_path, pages=3)
    for n in range(3):
        tier.put(h(n), page(n))
        tier.flush()
        os.utime(tier.path(h(n)), (1000 + n, 1000 + n))  # written at distinct times
    tier.close()
    again = disk(tmp_path, pages=3)
    assert again.get(h(0)) is not None  # read: now the most recently used, also for the next start
    again.put(h(3), page(3))
    again.close()
    assert sorted(p.name[:32] for p in tmp_path.iterdir()) == sorted(h(n).hex() for n in (0, 2, 3))
    smaller = disk(tmp_path, pages=2)  # a smaller bound at start: the oldest file goes
    assert h(2) not in smaller.index and len(list(tmp_path.iterdir())) == 2
    smaller.close()


def test_a_pinned_page_is_never_deleted_from_disk(tmp_path):
    pinned = Counter({h(0): 1})
    tier = disk(tmp_path, pages=2, pinned=pinned)
    for n in range(4):
        tier.put(h(n), page(n))
        tier.flush()
    tier.close()
    assert sorted(p.name[:32] for p in tmp_path.iterdir()) == sorted([h(0).hex(), h(3).hex()])


def test_a_corrupt_file_is_skipped_with_a_warning_and_removed(tmp_path, caplog):
    tier = disk(tmp_path)
    tier.put(h(1), page(1))
    tier.put(h(2), page(2))
    tier.flush()
    raw = bytearray(tier.path(h(1)).read_bytes())
    raw[100] ^= 0xFF  # one flipped byte in the payload
    tier.path(h(1)).write_bytes(raw)
    tier.path(h(2)).write_bytes(tier.path(h(2)).read_bytes()[:200])  # torn
    with caplog.at_level(logging.WARNING, "zhuzi"):
        assert tier.get(h(1)) is None and tier.get(h(2)) is None
    assert "checksum mismatch" in caplog.text and "corrupt" in caplog.text
    assert not tier.path(h(1)).exists() and h(1) not in tier and tier.snapshot().refused == 2
    tier.close()


def test_a_foreign_file_is_skipped_with_a_warning_never_loaded(tmp_path, caplog):
    other = disk(tmp_path / "other", identity=b"o" * 16)  # another model's (or dtype's, or layout's) page
    other.put(h(1), page(1))
    other.close()
    tier = disk(tmp_path / "ours")
    (tmp_path / "ours" / (h(1).hex() + ".kv")).write_bytes((tmp_path / "other" / (h(1).hex() + ".kv")).read_bytes())
    (tmp_path / "ours" / (h(2).hex() + ".kv")).write_bytes(b"not a page" * 100)
    with caplog.at_level(logging.WARNING, "zhuzi"):
        assert h(1) in tier and tier.get(h(1)) is None
        assert tier.get(h(2)) is None
    assert "written for another model" in caplog.text and "not a zhuzi KV page file" in caplog.text
    assert tier.snapshot().refused == 2
    tier.close()


def test_a_state_file_goes_with_its_page_and_one_of_another_shape_is_never_loaded(tmp_path, caplog):
    state_shape = (5,)
    states = DiskTier(tmp_path, 10 * (20 + HEADER.size), IDENTITY, state_shape, torch.float32, Counter(),
                      suffix=".state")
    pages = DiskTier(tmp_path, 2 * (PAGE_BYTES + HEADER.size), IDENTITY, SHAPE, torch.float32, Counter(),
                     on_evict=states.discard)
    for n in range(3):
        states.put(h(n), torch.full(state_shape, float(n)))
        states.flush()
        pages.put(h(n), page(n))
        pages.flush()
    assert h(0) not in pages and h(0) not in states and not states.path(h(0)).exists()  # page 0 went: its state too
    assert torch.equal(states.get(h(2)), torch.full(state_shape, 2.0)) and states.snapshot().evicted == 1
    wider = DiskTier(tmp_path / "wider", 10 * (24 + HEADER.size), IDENTITY, (6,), torch.float32, Counter(),
                     suffix=".state")
    wider.path(h(1)).write_bytes(states.path(h(1)).read_bytes())  # a state of 5 floats where 6 are expected
    with caplog.at_level(logging.WARNING, "zhuzi"):
        assert h(1) in wider and wider.get(h(1)) is None
    assert "payload bytes" in caplog.text
    for tier in (states, pages, wider):
        tier.close()


def _write_until_killed(folder) -> None:
    tier = disk(folder, pages=10_000)
    for n in range(10_000):
        tier.put(h(n), page(n))
        if n % 50 == 0 and len(os.listdir(folder)) > 20:
            os.kill(os.getpid(), signal.SIGKILL)  # while the writer thread still has pages queued


def test_a_kill_9_while_writing_leaves_only_whole_pages(tmp_path):
    process = multiprocessing.get_context("spawn").Process(target=_write_until_killed, args=(tmp_path,))
    process.start()
    process.join()
    assert process.exitcode == -signal.SIGKILL
    tier = disk(tmp_path, pages=10_000)
    assert tier.index, "no page was written before the kill"
    for key in list(tier.index):
        n = int.from_bytes(key, "big")
        assert torch.equal(tier.get(key), page(n))
    assert tier.snapshot().refused == 0
    tier.close()
