"""The Responses API's stored responses on real files: conversations kept per key, as long as their latest turn,
and what was committed there after a kill."""
from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest
from clock import Clock

from zhuzi.server.common.store import Database, owner_of
from zhuzi.server.responses.store import MissingResponse, ResponseStore, StoredResponse

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
