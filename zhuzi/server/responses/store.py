"""The Responses API's stored responses: each a row of the server's store (common/store.py), kept by its owner's
key digest, a conversation alive until a TTL after its latest turn."""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zhuzi.server.common.store import Component, Database

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
