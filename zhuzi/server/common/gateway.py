"""The gateway, the request path's second step: who may ask (API keys: Bearer or x-api-key, 401), how often
(requests and tokens per minute per key, token buckets, 429 with Retry-After), and whether there is room (each
model's batch, then one waiting room all models share: 429 at once past it). Each key is a tenant for the
engines' fair shares, known by a masked id. A server of many models has one gateway: a key's limits count its
requests to every model.
"""
from __future__ import annotations

import hashlib
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from zhuzi.engine.sequence import Tenant

ANONYMOUS = ""  # the one identity when no keys are configured: limits then apply server-wide


def key_id(key: str) -> str:
    """A key's stable masked id: a digest prefix, so that logs, metrics and stored usage never hold the key
    (a digest of a guessable key can be guessed: keys should be long random strings)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12] if key else ANONYMOUS


@dataclass
class GatewayError(Exception):
    status: int
    message: str
    type: str
    code: str
    retry_after: float | None = None

    def __str__(self) -> str:
        return self.message


@dataclass
class TokenBucket:
    per_minute: float
    level: float = field(init=False)
    updated: float  # the clock's time of the last refill

    def __post_init__(self) -> None:
        self.level = self.per_minute

    def _refill(self, now: float) -> None:
        self.level = min(self.per_minute, self.level + (now - self.updated) * self.per_minute / 60)
        self.updated = now

    def wait_time(self, now: float) -> float:
        """Seconds until at least one unit is available (0 when one is)."""
        self._refill(now)
        return 0.0 if self.level >= 1 else (1 - self.level) * 60 / self.per_minute

    def take(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level -= amount


@dataclass
class Admission:
    gateway: Gateway
    model: str
    num_seqs: int
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.gateway.in_flight[self.model] -= self.num_seqs


@dataclass
class KeyLimits:
    requests: TokenBucket | None
    tokens: TokenBucket | None


class Gateway:
    def __init__(self, api_keys: list[str] | None = None, rpm: int | None = None, tpm: int | None = None,
                 max_waiting: int = 0, weights: dict[str, float] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.api_keys = [key.encode() for key in api_keys or []]
        self.tenants = {key: Tenant(key_id(key), (weights or {}).get(key, 1.0)) for key in api_keys or []}
        self.rpm, self.tpm = rpm, tpm
        self.max_waiting = max_waiting  # sequences that may wait beyond the batches, all models' together
        self.batches: dict[str, int] = {}  # model -> sequences its engine runs at once (its max_num_seqs)
        self.in_flight: dict[str, int] = {}  # model -> sequences admitted and not yet finished
        self.clock = clock  # what the per-minute limits refill by
        self._limits: dict[str, KeyLimits] = {}  # touched only from the event loop: no lock

    def authenticate(self, authorization: str | None, x_api_key: str | None = None) -> str:
        """The caller's key (ANONYMOUS without configured keys), from either header; GatewayError 401 otherwise."""
        if not self.api_keys:
            return ANONYMOUS
        scheme, _, token = (authorization or "").partition(" ")
        given = (token.strip() if scheme.lower() == "bearer" else "").encode()
        if x_api_key is not None and not given:
            given = x_api_key.strip().encode()
        # Compare against every key so the time taken says nothing about which one nearly matched.
        matches = [secrets.compare_digest(given, key) for key in self.api_keys]
        if not any(matches):
            raise GatewayError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>' "
                               "or 'x-api-key: <key>'.", "invalid_request_error", "invalid_api_key")
        return given.decode()

    def tenant(self, key: str) -> Tenant:
        """Whom the engine serves a request of this key for."""
        return self.tenants.get(key, Tenant())

    def check_rate(self, key: str) -> None:
        """Count one request against the key's limits; GatewayError 429 when a limit is spent."""
        now = self.clock()
        limits = self._limits_of(key)
        for bucket, kind in ((limits.requests, "requests"), (limits.tokens, "tokens")):
            if bucket is not None and (wait := bucket.wait_time(now)) > 0:
                raise GatewayError(
                    429, f"Rate limit reached: {bucket.per_minute:g} {kind} per minute for this key. "
                         f"Try again in {wait:.1f} s.", kind, "rate_limit_exceeded", retry_after=wait)
        if limits.requests is not None:
            limits.requests.take(1, now)

    def charge_tokens(self, key: str, num_tokens: int) -> None:
        bucket = self._limits_of(key).tokens
        if bucket is not None:
            bucket.take(num_tokens, self.clock())

    def waiting(self) -> int:
        """Sequences admitted beyond their model's batch."""
        return sum(max(0, n - self.batches.get(model, 0)) for model, n in self.in_flight.items())

    def admit(self, num_seqs: int, model: str) -> Admission:
        """Take num_seqs places: in the model's batch while it has room, then in the waiting room; the caller
        releases them when the request ends."""
        batch = self.batches.get(model, 0)
        if num_seqs > batch + self.max_waiting:  # no wait would help: say so instead of 429
            raise GatewayError(400, f"The request asks for {num_seqs} sequences (n times prompts); this server "
                                    f"holds at most {batch + self.max_waiting} for {model!r}.",
                               "invalid_request_error", "too_many_sequences")
        mine = self.in_flight.get(model, 0)
        waiting = self.waiting() - max(0, mine - batch) + max(0, mine + num_seqs - batch)
        if waiting > self.max_waiting:
            raise GatewayError(
                429, f"Server busy: {mine} sequences are running or waiting for {model!r}, and {self.waiting()} "
                     f"wait in all (limit {self.max_waiting}). Try again shortly.", "server_busy", "queue_full",
                retry_after=1.0)
        self.in_flight[model] = mine + num_seqs
        return Admission(self, model, num_seqs)

    def _limits_of(self, key: str) -> KeyLimits:
        if key not in self._limits:
            now = self.clock()
            self._limits[key] = KeyLimits(TokenBucket(self.rpm, now) if self.rpm else None,
                                          TokenBucket(self.tpm, now) if self.tpm else None)
        return self._limits[key]


def retry_after_header(seconds: float) -> str:
    """Retry-After carries whole seconds; round up so a client that obeys it succeeds."""
    return str(max(1, math.ceil(seconds)))
