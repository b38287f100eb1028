"""The server's SQLite store on real files: schema versions read, migrated or refused, foreign files refused."""
from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from zhuzi.server.common.store import Component, Database, StoreError
from zhuzi.server.responses.store import RESPONSES


def test_an_older_schema_is_migrated_and_a_newer_one_refused(tmp_path: Path) -> None:
    path = tmp_path / "store.sqlite3"
    v1 = Component("notes", 1, ("CREATE TABLE notes (text TEXT)",))
    v2 = Component("notes", 2, ("CREATE TABLE notes (text TEXT, author TEXT)",),
                   migrations=(("ALTER TABLE notes ADD COLUMN author TEXT",),))
    first = Database(path)
    first.install(v1)
    first.conn.execute("INSERT INTO notes VALUES ('kept')")
    Database(path).install(v2)
    assert sqlite3.connect(path).execute("SELECT text, author FROM notes").fetchall() == [("kept", None)]
    with pytest.raises(StoreError, match=r"schema version 2, written by a newer zhuzi; this one reads up to version 1"):
        Database(path).install(v1)
    assert sqlite3.connect(path).execute("SELECT text FROM notes").fetchall() == [("kept",)]  # nothing dropped
    Database(path).install(RESPONSES)  # another component beside it in the same file


def test_a_file_that_is_not_zhuzis_store_is_refused(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.sqlite3"
    garbage.write_bytes(b"not a database at all" * 100)
    with pytest.raises(StoreError, match="cannot be used as zhuzi's store"):
        Database(garbage)
    foreign = tmp_path / "foreign.sqlite3"
    sqlite3.connect(foreign).execute("CREATE TABLE photos (id INTEGER)")
    with pytest.raises(StoreError, match="of something other than zhuzi"):
        Database(foreign)
    assert sqlite3.connect(foreign).execute("SELECT name FROM sqlite_master").fetchall() == [("photos",)]
