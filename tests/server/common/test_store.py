"""The server's SQLite store on real files: schema versions read, migrated or refused, foreign files refused,
conversations kept per key and as long as their latest turn."""
from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest
from clock import Clock

from zhuzi.server.common.store import (
    RESPONSES,
    Component,
    Database,
    MissingResponse,
    ResponseStore,
    StoredResponse,
    StoreError,
    owner_of,
)

ALICE, BOB = owner_of("alice"), owner_of("bob")


def turn(response_id: str, previous: str | None = None, owner: str = ALICE) -> StoredResponse:
    return StoredResponse(response_id, owner, previous, time.time(), {"id": response_id, "output": []},
                          [{"id": f"msg_{response_id}", "type": "message"}])


def test_a_conversation_is_read_back_oldest_first_and_only_by_its_owner(tmp_path: Path) -> None:
    store = ResponseStore(Database(tmp_path / "store.sqlite3"), ttl=0)
    for stored in (turn("a"), turn("b", "a"), turn("c", "b"), turn("x", owner=BOB)):
        store.put(stored)
    assert [t.id for t in store.conversation("c", ALICE)] == ["a", "b", "c"]
    assert store.get("b", ALICE).input_items == [{"id": "msg_b", "type": "message"}]
    for missing in (lambda: store.get("c", BOB), lambda: store.conversation("c", BOB),
                    lambda: store.delete("c", BOB), lambda: store.get("x", ALICE)):
        with pytest.raises(MissingResponse):
            missing()
    store.delete("a", ALICE)
    with pytest.raises(MissingResponse) as broken:
        store.conversation("c", ALICE)
    assert broken.value.args == ("a",)  # names the turn that is gone


def test_a_conversation_expires_a_ttl_after_its_latest_turn(tmp_path: Path) -> None:
    clock = Clock()
    store = ResponseStore(Database(tmp_path / "store.sqlite3"), ttl=600, clock=clock)
    store.put(turn("a"))
    clock.now += 400
    store.put(turn("b", "a"))  # keeps "a" alive with it
    clock.now += 600  # "a"'s own ttl is long past, "b"'s ends now
    assert [t.id for t in store.conversation("b", ALICE)] == ["a", "b"]
    assert store.get("a", ALICE).id == "a"
    clock.now += 0.001
    for expired in (lambda: store.get("a", ALICE), lambda: store.get("b", ALICE),
                    lambda: store.conversation("b", ALICE)):
        with pytest.raises(MissingResponse):
            expired()


def test_what_was_committed_is_there_when_the_file_is_opened_again(tmp_path: Path) -> None:
    path = tmp_path / "store.sqlite3"
    ResponseStore(Database(path), ttl=0).put(turn("a"))  # never closed, as after a kill
    assert ResponseStore(Database(path), ttl=0).get("a", ALICE).response == {"id": "a", "output": []}
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone() == ("wal",)


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
