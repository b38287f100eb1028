"""Token quotas, a step of the gateway: the prompt and generated tokens each API key may use a day, counted as
the gateway counts them; past the quota a request gets 429 (insufficient_quota) until midnight UTC. Usage
is a component of the store (store.py), committed as it is counted.
"""
from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from zhuzi.server.common.gateway import GatewayError, key_id
from zhuzi.server.common.store import Component, Database

USAGE = Component("key_usage", 1, (
    "CREATE TABLE key_usage (key_id TEXT NOT NULL, day TEXT NOT NULL, tokens INTEGER NOT NULL, "
    "PRIMARY KEY (key_id, day))",
))


class UsageTable:
    """Tokens used per masked key id and UTC day."""

    def __init__(self, db: Database) -> None:
        self.db = db
        db.install(USAGE)

    def day(self, day: str) -> dict[str, int]:
        with self.db.lock:
            return dict(self.db.conn.execute("SELECT key_id, tokens FROM key_usage WHERE day = ?", (day,)))

    def add(self, ident: str, day: str, tokens: int) -> None:
        with self.db.transaction() as conn:
            conn.execute("INSERT INTO key_usage VALUES (?, ?, ?) ON CONFLICT (key_id, day) "
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
    def open(cls, limits: dict[str, int], store: Database) -> Quotas:
        """Quotas whose usage lives in zhuzi's store (its table made only when there are quotas)."""
        return cls(limits, UsageTable(store) if limits else None)

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
