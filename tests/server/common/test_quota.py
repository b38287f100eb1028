"""Daily token quotas on their own, with a hand-driven clock and a real SQLite store (the HTTP side, and a
kill -9 of the server, are in test_server_tenants.py; the store's refusals of foreign files and versions
in test_store.py)."""
from __future__ import annotations

import datetime
import sqlite3
from pathlib import Path

import pytest
from clock import Clock

from zhuzi.server.common.gateway import GatewayError, key_id
from zhuzi.server.common.quota import Quotas
from zhuzi.server.common.store import Database, StoreError

NOON = datetime.datetime(2026, 12, 1, 12, 0, tzinfo=datetime.UTC).timestamp()


def quotas(path: Path, clock: Clock, limits: dict[str, int] | None = None) -> Quotas:
    q = Quotas.open(limits or {"alice": 100}, Database(path))
    q.clock = clock
    return q


def test_over_the_quota_is_a_429_that_names_it_and_when_it_resets(tmp_path: Path) -> None:
    clock = Clock(NOON)
    q = quotas(tmp_path / "usage.sqlite3", clock)
    q.check("alice")
    q.charge("alice", 60)
    q.charge("alice", 50)
    q.charge("alice", -50)  # a request the engine refused: its prompt is given back
    q.check("alice")  # 60 of 100: a request may start, and may go over
    q.charge("alice", 70)
    with pytest.raises(GatewayError) as refused:
        q.check("alice")
    error = refused.value
    assert (error.status, error.type, error.code) == (429, "insufficient_quota", "insufficient_quota")
    assert "100 prompt + generated tokens a day and has used 130" in error.message
    assert "resets at 2026-12-02 00:00 UTC, in 12 h 0 min" in error.message
    assert error.retry_after == 12 * 3600
    q.check("bob")  # no quota, no limit
    clock.now += 12 * 3600  # midnight UTC: a new day
    q.check("alice")


def test_usage_counts_until_midnight_utc_and_the_new_day_starts_from_zero(tmp_path: Path) -> None:
    path = tmp_path / "usage.sqlite3"
    clock = Clock(datetime.datetime(2026, 12, 1, 23, 59, tzinfo=datetime.UTC).timestamp())
    q = quotas(path, clock)
    q.charge("alice", 60)
    clock.now += 59  # 23:59:59, the day's last second
    q.check("alice")
    q.charge("alice", 40)
    with pytest.raises(GatewayError) as refused:
        q.check("alice")
    assert refused.value.retry_after == 1 and "resets at 2026-12-02 00:00 UTC, in 0 h 0 min" in refused.value.message
    clock.now += 1  # 00:00:00 UTC
    q.check("alice")
    assert [(u.key_id, u.used, u.limit) for u in q.usage()] == [(key_id("alice"), 0, 100)]
    q.charge("alice", 7)
    rows = sqlite3.connect(path).execute("SELECT day, tokens FROM key_usage ORDER BY day").fetchall()
    assert rows == [("2026-12-01", 100), ("2026-12-02", 7)]  # yesterday's usage is kept, not added to today's


def test_usage_survives_reopening_and_is_kept_per_masked_key_and_day(tmp_path: Path) -> None:
    path, clock = tmp_path / "usage.sqlite3", Clock(NOON)
    q = quotas(path, clock)
    q.charge("alice", 120)
    q.charge("bob", 5)
    again = quotas(path, clock)
    with pytest.raises(GatewayError):
        again.check("alice")
    assert [(u.key_id, u.used, u.limit) for u in again.usage()] == sorted(
        [(key_id("alice"), 120, 100), (key_id("bob"), 5, None)])
    rows = sqlite3.connect(path).execute("SELECT key_id, day, tokens FROM key_usage ORDER BY tokens").fetchall()
    assert rows == [(key_id("bob"), "2026-12-01", 5), (key_id("alice"), "2026-12-01", 120)]  # never the key


def test_a_usage_table_of_a_newer_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "zhuzi.sqlite3"
    Quotas.open({"alice": 1}, Database(path))
    db = sqlite3.connect(path)
    db.execute("UPDATE zhuzi_schema SET version = 2 WHERE component = 'key_usage'")
    db.commit()
    with pytest.raises(StoreError, match="key_usage in schema version 2"):
        Quotas.open({"alice": 1}, Database(path))


def test_without_quotas_nothing_is_written(tmp_path: Path) -> None:
    path = tmp_path / "zhuzi.sqlite3"
    q = Quotas.open({}, Database(path))
    q.charge("alice", 10)
    q.check("alice")
    assert q.usage() == []
    assert sqlite3.connect(path).execute("SELECT name FROM sqlite_master WHERE name = 'key_usage'").fetchall() == []
