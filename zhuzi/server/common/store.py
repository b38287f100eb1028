"""What the server keeps beyond its own life: an embedded SQLite database (sqlite3 from the stdlib).

One file holds every part that must outlive the process (the stored responses of the Responses API, and
each key's token usage, quota.py): each part is a component with its own tables and its own schema version,
kept in the zhuzi_schema table. Opening a file creates what a component lacks, migrates an older version
forward, and refuses a newer one, or a file that is not zhuzi's, with a message that says so: nothing is ever dropped
silently. The file is marked as zhuzi's (PRAGMA application_id) and written ahead (WAL) with a full sync at
each commit, and a write commits before the server answers: a killed server (SIGKILL, power loss) loses
nothing it has answered. API keys are never written: a row belongs to a key's SHA-256.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zhuzi.disk_cache import cache_root

APPLICATION_ID = 0x7A68757A  # "zhuz"
DEFAULT_FILE = "responses.sqlite3"


class StoreError(ValueError):
    """A store file zhuzi cannot use; the message says why and what to do."""


def owner_of(key: str) -> str:
    """Who a row belongs to: the API key's digest (the anonymous key when the server has none)."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class Component:
    """A part of the file: its tables at its current version, and how each older version moves up one."""

    name: str
    version: int
    create: tuple[str, ...]
    migrations: tuple[tuple[str, ...], ...] = ()  # migrations[v - 1]: from version v to v + 1


class Database:
    """One SQLite file, shared by the components; every call may come from any worker thread."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path is not None else cache_root() / DEFAULT_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.lock = threading.Lock()
        try:
            self.conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._claim()
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{self.path} cannot be used as zhuzi's store: {exc}") from exc

    def _claim(self) -> None:
        """Mark a new file as zhuzi's; refuse one that belongs to something else."""
        app_id = self.conn.execute("PRAGMA application_id").fetchone()[0]
        tables = {row[0] for row in self.conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if app_id != APPLICATION_ID and (app_id or tables):
            raise StoreError(f"{self.path} is an SQLite database of something other than zhuzi: "
                             "give zhuzi a file of its own")
        self.conn.execute("PRAGMA journal_mode = WAL")
        self.conn.execute("PRAGMA synchronous = FULL")
        self.conn.execute("PRAGMA busy_timeout = 10000")
        with self.transaction():
            self.conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            self.conn.execute("CREATE TABLE IF NOT EXISTS zhuzi_schema (component TEXT PRIMARY KEY, "
                              "version INTEGER NOT NULL)")

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One transaction: committed (and synced) when the block ends, rolled back if it raises."""
        with self.lock:
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                yield self.conn
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise
            self.conn.execute("COMMIT")

    def install(self, component: Component) -> None:
        """Create the component's tables, or bring them from the version the file holds to the current one."""
        with self.transaction() as conn:
            row = conn.execute("SELECT version FROM zhuzi_schema WHERE component = ?", (component.name,)).fetchone()
            if row is None:
                for statement in component.create:
                    conn.execute(statement)
                conn.execute("INSERT INTO zhuzi_schema VALUES (?, ?)", (component.name, component.version))
                return
            found = row[0]
            if found > component.version:
                raise StoreError(f"{self.path} holds {component.name} in schema version {found}, written by a newer "
                                 f"zhuzi; this one reads up to version {component.version}: run the newer zhuzi, "
                                 "or give this one another file")
            for version in range(found, component.version):
                for statement in component.migrations[version - 1]:
                    conn.execute(statement)
            conn.execute("UPDATE zhuzi_schema SET version = ? WHERE component = ?", (component.version, component.name))


RESPONSES = Component("responses", 1, (
    "CREATE TABLE responses (id TEXT PRIMARY KEY, owner TEXT NOT NULL, previous_id TEXT, created_at REAL NOT NULL, "
    "expires_at REAL, response TEXT NOT NULL, input_items TEXT NOT NULL)",
    "CREATE INDEX responses_expiry ON responses (expires_at)",
))


@dataclass
class StoredResponse:
    id: str
    owner: str
    previous_id: str | None
    created_at: float
    response: dict[str, Any]  # the Response object as answered
    input_items: list[dict[str, Any]]  # this turn's input items, each with its id


class MissingResponse(LookupError):
    """A response that is not stored (or not the caller's): its id."""


class ResponseStore:
    """Stored responses. A conversation (a response and those before it, by previous_response_id) expires ttl
    seconds after its latest turn (0: never)."""

    def __init__(self, db: Database, ttl: float, clock: Callable[[], float] = time.time) -> None:
        self.db, self.ttl, self.clock = db, ttl, clock
        db.install(RESPONSES)

    def put(self, stored: StoredResponse) -> None:
        """Keep a response (committed when this returns) and keep its conversation as long as it."""
        now = self.clock()
        expires = now + self.ttl if self.ttl else None
        with self.db.transaction() as conn:
            conn.execute("DELETE FROM responses WHERE expires_at < ?", (now,))
            conn.execute("INSERT INTO responses VALUES (?, ?, ?, ?, ?, ?, ?)",
                         (stored.id, stored.owner, stored.previous_id, stored.created_at, expires,
                          json.dumps(stored.response), json.dumps(stored.input_items)))
            if expires is not None:
                conn.execute(f"WITH RECURSIVE {_CHAIN} UPDATE responses SET expires_at = ?4 "
                             "WHERE id IN (SELECT id FROM chain)", (stored.previous_id, stored.owner, now, expires))

    def get(self, response_id: str, owner: str) -> StoredResponse:
        """The caller's stored response; MissingResponse if it is not stored, expired, or another key's."""
        with self.db.lock:
            row = self.db.conn.execute(f"SELECT {_COLUMNS} FROM responses WHERE id = ? AND owner = ? AND "
                                       "(expires_at IS NULL OR expires_at >= ?)",
                                       (response_id, owner, self.clock())).fetchone()
        if row is None:
            raise MissingResponse(response_id)
        return _stored(row)

    def conversation(self, response_id: str, owner: str) -> list[StoredResponse]:
        """The response and every one before it, oldest first; MissingResponse names a link not stored."""
        with self.db.lock:
            rows = self.db.conn.execute(f"WITH RECURSIVE {_CHAIN} SELECT {_COLUMNS} FROM responses JOIN chain "
                                        "USING (id) ORDER BY depth DESC",
                                        (response_id, owner, self.clock())).fetchall()
        turns = [_stored(row) for row in rows]
        if not turns or turns[-1].id != response_id:
            raise MissingResponse(response_id)
        if turns[0].previous_id is not None:
            raise MissingResponse(turns[0].previous_id)
        return turns

    def delete(self, response_id: str, owner: str) -> None:
        with self.db.transaction() as conn:
            if conn.execute("DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner)).rowcount == 0:
                raise MissingResponse(response_id)


_COLUMNS = "responses.id, owner, responses.previous_id, created_at, response, input_items"
# The ids of a response (parameter 1) and of those before it, the owner's (2) and unexpired at (3).
_CHAIN = ("chain(id, previous_id, depth) AS (SELECT id, previous_id, 0 FROM responses WHERE id = ?1 AND owner = ?2 "
          "AND (expires_at IS NULL OR expires_at >= ?3) UNION ALL SELECT r.id, r.previous_id, chain.depth + 1 "
          "FROM responses r JOIN chain ON r.id = chain.previous_id WHERE r.owner = ?2 "
          "AND (r.expires_at IS NULL OR r.expires_at >= ?3))")


def _stored(row: tuple) -> StoredResponse:
    return StoredResponse(row[0], row[1], row[2], row[3], json.loads(row[4]), json.loads(row[5]))
