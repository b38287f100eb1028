"""Token quotas, a step of the gateway: how many prompt + generated tokens each API key may use a day.

A key's usage is counted as the gateway counts its tokens per minute: the prompt when the request is
admitted, the generated tokens when it ends. A request that starts under the quota finishes; the next one
gets 429 with OpenAI's insufficient_quota error, naming the quota and when it resets (midnight UTC).
Usage is kept in an embedded SQLite file (WAL), one row per masked key id and day, written as it is
counted, so it survives a restart or a kill -9. The file belongs to zhuzi (SQLite's application_id) and
each part of it records its schema version in zhuzi_schema, as the Responses store does (issue 22), so the
two can share one file; a file of another program or a newer version is refused, never used. Usage is
shown per masked key id in /metrics.
"""
from __future__ import annotations

import datetime
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from zhuzi.server.gateway import GatewayError, key_id

APPLICATION_ID = 0x7A68757A  # "zhuz": the file is zhuzi's
TABLE, SCHEMA_VERSION = "key_usage", 1


def open_store(path: Path) -> sqlite3.Connection:
    """zhuzi's SQLite file at path, created if missing; ValueError for a file that is not zhuzi's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        (app,) = db.execute("PRAGMA application_id").fetchone()
        tables = db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
        if app != APPLICATION_ID and (app or tables):
            raise ValueError(f"{path} is not a zhuzi store (another program's SQLite file?); give another path")
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")  # with WAL, a commit survives the process dying
        db.execute(f"PRAGMA application_id={APPLICATION_ID}")
        db.execute("CREATE TABLE IF NOT EXISTS zhuzi_schema (component TEXT PRIMARY KEY, version INTEGER NOT NULL)")
    except sqlite3.DatabaseError as exc:
        db.close()
        raise ValueError(f"{path} cannot be read as a zhuzi store: {exc}") from None
    except ValueError:
        db.close()
        raise
    return db


class UsageTable:
    """Tokens used per masked key id and UTC day."""

    def __init__(self, db: sqlite3.Connection, path: Path) -> None:
        self.db = db
        row = db.execute("SELECT version FROM zhuzi_schema WHERE component = ?", (TABLE,)).fetchone()
        if row is not None and row[0] != SCHEMA_VERSION:
            raise ValueError(f"{path}: its {TABLE} table is version {row[0]}, this zhuzi reads {SCHEMA_VERSION}")
        with db:
            db.execute("BEGIN")
            db.execute(f"CREATE TABLE IF NOT EXISTS {TABLE} (key_id TEXT NOT NULL, day TEXT NOT NULL, "
                       "tokens INTEGER NOT NULL, PRIMARY KEY (key_id, day))")
            db.execute("INSERT OR IGNORE INTO zhuzi_schema VALUES (?, ?)", (TABLE, SCHEMA_VERSION))

    def day(self, day: str) -> dict[str, int]:
        return dict(self.db.execute(f"SELECT key_id, tokens FROM {TABLE} WHERE day = ?", (day,)))

    def add(self, ident: str, day: str, tokens: int) -> None:
        self.db.execute(f"INSERT INTO {TABLE} VALUES (?, ?, ?) ON CONFLICT (key_id, day) "
                        "DO UPDATE SET tokens = tokens + excluded.tokens", (ident, day, tokens))


@dataclass
class KeyUsage:
    key_id: str
    used: int  # tokens today
    limit: int | None  # tokens a day, None: no quota


@dataclass
class Quotas:
    """Each key's daily quota and today's usage (kept in the table, when there is one)."""

    limits: dict[str, int]  # API key -> tokens a day
    table: UsageTable | None = None
    clock: Callable[[], float] = time.time
    today: str = ""
    used: dict[str, int] = field(default_factory=dict)  # masked key id -> tokens today

    @classmethod
    def open(cls, limits: dict[str, int], store: Path) -> Quotas:
        """Quotas whose usage lives in the SQLite file store (opened only when there are quotas)."""
        return cls(limits, UsageTable(open_store(store), store) if limits else None)

    def _now(self) -> datetime.datetime:
        now = datetime.datetime.fromtimestamp(self.clock(), datetime.UTC)
        if (day := now.date().isoformat()) != self.today:  # a new day: yesterday's usage stays in the table
            self.today, self.used = day, self.table.day(day) if self.table else {}
        return now

    def check(self, key: str) -> None:
        """GatewayError 429 when the key has used its quota today."""
        limit = self.limits.get(key)
        if limit is None:
            return
        now = self._now()
        used = self.used.get(key_id(key), 0)
        if used < limit:
            return
        reset = datetime.datetime.combine(now.date() + datetime.timedelta(days=1), datetime.time(), datetime.UTC)
        wait = (reset - now).total_seconds()
        raise GatewayError(
            429, f"Daily token quota exceeded: this key may use {limit} prompt + generated tokens a day and has "
                 f"used {used}. The quota resets at {reset:%Y-%m-%d %H:%M} UTC, in {int(wait // 3600)} h "
                 f"{int(wait % 3600 // 60)} min.", "insufficient_quota", "insufficient_quota", retry_after=wait)

    def charge(self, key: str, tokens: int) -> None:
        """Count tokens against the key's quota (a refund when negative)."""
        if self.table is None or not tokens:
            return
        self._now()
        ident = key_id(key)
        self.used[ident] = self.used.get(ident, 0) + tokens
        self.table.add(ident, self.today, tokens)

    def usage(self) -> list[KeyUsage]:
        """Today's usage per masked key id, every key with a quota included."""
        if self.table is None:
            return []
        self._now()
        limits = {key_id(key): limit for key, limit in self.limits.items()}
        return [KeyUsage(ident, self.used.get(ident, 0), limits.get(ident)) for ident in sorted({*self.used, *limits})]
