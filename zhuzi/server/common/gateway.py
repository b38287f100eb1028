"""The gateway, the request path's second step: who may ask (API keys: Bearer or x-api-key, 401), how often
(requests and tokens per minute per key, token buckets, 429 with Retry-After), and whether there is room (a
bounded queue: 429 at once past it). Each key is a tenant for the engine's fair shares, known by a masked id.
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
    num_seqs: int
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.gateway.in_flight -= self.num_seqs


@dataclass
class KeyLimits:
    requests: TokenBucket | None
    tokens: TokenBucket | None


class Gateway:
    def __init__(self, api_keys: list[str] | None = None, rpm: int | None = None, tpm: int | None = None,
                 capacity: int = 0, weights: dict[str, float] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.api_keys = [key.encode() for key in api_keys or []]
        self.tenants = {key: Tenant(key_id(key), (weights or {}).get(key, 1.0)) for key in api_keys or []}
        self.rpm, self.tpm = rpm, tpm
        self.capacity = capacity  # sequences: the engine's max_num_seqs plus the waiting room
        self.in_flight = 0  # sequences admitted and not yet finished
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

    def admit(self, num_seqs: int) -> Admission:
        """Take num_seqs places in the bounded queue; the caller releases them when the request ends."""
        if num_seqs > self.capacity:  # no wait would help: say so instead of 429
            raise GatewayError(400, f"The request asks for {num_seqs} sequences (n times prompts); this server "
                                    f"holds at most {self.capacity}.", "invalid_request_error", "too_many_sequences")
        if self.in_flight + num_seqs > self.capacity:
            raise GatewayError(
                429, f"Server busy: {self.in_flight} sequences are running or waiting "
                     f"(limit {self.capacity}). Try again shortly.", "server_busy", "queue_full",
                retry_after=1.0)
        self.in_flight += num_seqs
        return Admission(self, num_seqs)

    def _limits_of(self, key: str) -> KeyLimits:
        if key not in self._limits:
            now = self.clock()
            self._limits[key] = KeyLimits(TokenBucket(self.rpm, now) if self.rpm else None,
                                          TokenBucket(self.tpm, now) if self.tpm else None)
        return self._limits[key]


def retry_after_header(seconds: float) -> str:
    """Retry-After carries whole seconds; round up so a client that obeys it succeeds."""
    return str(max(1, math.ceil(seconds)))
