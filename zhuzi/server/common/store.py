"""What the server keeps beyond its own life: one SQLite file (stored responses, token usage), each part a
component with its own tables and schema version. Opening creates or migrates a component and refuses a newer
one or a foreign file; every write commits (WAL, full sync) before the server answers. Keys are never written.
"""
from __future__ import annotations

import contextlib
import hashlib
import sqlite3
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

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
