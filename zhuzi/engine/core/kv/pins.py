"""Pinned prefixes: named runs of full KV pages (and a hybrid model's state after the last of them) that the
pool keeps, and the KV tiers never evict, until the pin is deleted or its time to live ends."""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from zhuzi.engine.core.kv.connector import KVConnector
from zhuzi.engine.core.kv.page_manager import PageManager, hash_chain
from zhuzi.engine.sequence import PinSpec, Sequence
from zhuzi.outputs import PinInfo
from zhuzi.sampling_params import InvalidRequest


@dataclass
class Pin:
    info: PinInfo
    hashes: list[bytes]
    page_ids: list[int]
    state_slot: int | None = None  # a hybrid model's: the state after its last page

    @property
    def state_hashes(self) -> list[bytes]:
        """The hash its state is kept under: its last page's, or none."""
        return self.hashes[-1:] if self.state_slot is not None else []


class PinTable:
    """The pins. A pin is computed as an inspection of its token ids is (a probe through the step loop, so the
    prefix cache and the tiers give whatever they hold); when the probe has run, the pin takes one more
    reference on each of its full pages, and for a hybrid model one on the state slot after the last of them (a
    prompt that begins with the pin resumes there). Pages and states shared by several pins are held once per
    pin but counted once against the bound (EngineConfig.kv_pinned_memory, at most half the pool's pages and
    state slots), checked when a pin is asked for and when it completes. An expired pin is released at the next
    step or listing. A new pin under a name replaces the old one."""

    def __init__(self, pages: PageManager, connector: KVConnector | None, page_bytes: int, limit_bytes: int,
                 state_bytes: int = 0, clock: Callable[[], float] = time.time):
        self.pages, self.connector, self.clock = pages, connector, clock
        # Pins may never take more than half the pool: the rest is for the requests that use them (a running
        # sequence of a hybrid model holds two state slots).
        self.page_bytes, self.limit_pages = page_bytes, min(limit_bytes // page_bytes, pages.num_pages // 2)
        slots = pages.states.num_slots if pages.states is not None else 0
        self.state_bytes, self.limit_states = state_bytes, max(0, min(slots // 2, slots - 2))
        self.limit_bytes = min(limit_bytes, self.limit_pages * page_bytes + self.limit_states * state_bytes)
        self.pins: dict[str, Pin] = {}
        self.holders: Counter[int] = Counter()  # page id -> pins holding it
        self.state_holders: Counter[bytes] = Counter()  # a pinned state's page hash -> pins holding it

    @property
    def num_pages(self) -> int:
        """Pool pages held by pins."""
        return len(self.holders)

    @property
    def bytes(self) -> int:
        """Pool memory held by pins: their pages and states."""
        return self.num_pages * self.page_bytes + len(self.state_holders) * self.state_bytes

    def check(self, spec: PinSpec, token_ids: list[int], param: str) -> None:
        """InvalidRequest unless a pin of token_ids fits: at least one full page, within the bound."""
        size = self.pages.page_size
        if not self.pages.enable_prefix_caching:
            raise InvalidRequest(None, "pins keep pages of the prefix cache, which this engine runs without")
        if len(token_ids) < size:
            raise InvalidRequest(param, f"a pin holds whole KV pages of {size} tokens; got {len(token_ids)} tokens")
        if spec.ttl is not None and not spec.ttl > 0:
            raise InvalidRequest("ttl", f"ttl must be a positive number of seconds, got {spec.ttl}")
        self._check_room(list(hash_chain(token_ids, size)), spec.name, param)

    def _check_room(self, hashes: list[bytes], name: str, param: str) -> None:
        old = self.pins.get(name)
        held = self.holders - Counter(old.page_ids if old else [])
        new = {self.pages.cached.get(h, h) for h in hashes} - set(held)  # uncached ones count as new pages
        pages = len(held) + len(new)
        states = len(set(self.state_holders - Counter(old.state_hashes if old else [])) | set(hashes[-1:])) \
            if self.pages.states is not None else 0
        need = pages * self.page_bytes + states * self.state_bytes
        if pages > self.limit_pages or states > self.limit_states or need > self.limit_bytes:
            raise InvalidRequest(param, (
                f"pinned prefixes would hold {need} bytes of KV cache, over the {self.limit_bytes} that "
                "kv_pinned_memory allows (at most half the pool); delete a pin or raise it"), "pinned_memory_exceeded")

    def complete(self, seq: Sequence) -> PinInfo:
        """The probe seq has run its token ids and published their full pages (it may have ended since: nothing
        was allocated in between): pin them (InvalidRequest if they no longer fit)."""
        spec = seq.probe.pin if seq.probe is not None else None
        assert spec is not None
        hashes = seq.page_hashes[:seq.num_tokens // self.pages.page_size]
        if missing := sum(h not in self.pages.cached for h in hashes):
            raise InvalidRequest("token_ids", f"{missing} of the pin's {len(hashes)} pages left the prefix cache")
        self._check_room(hashes, spec.name, "token_ids")
        state_slot = None
        if self.pages.states is not None and (state_slot := self.pages.hold_state(hashes[-1])) is None:
            raise InvalidRequest("token_ids", "the state after the pin's last page left the prefix cache")
        self.remove(spec.name)
        page_ids = [self.pages.cached[h] for h in hashes]
        self.pages.hold(page_ids)
        self.holders.update(page_ids)
        if self.connector is not None:
            self.connector.pin(hashes)
        now = self.clock()
        info = PinInfo(spec.name, len(hashes) * self.pages.page_size, len(hashes), len(hashes) * self.page_bytes
                       + (state_slot is not None) * self.state_bytes, now,
                       None if spec.ttl is None else now + spec.ttl, seq.num_cached_tokens)
        self.pins[spec.name] = pin = Pin(info, hashes, page_ids, state_slot)
        self.state_holders.update(pin.state_hashes)
        return info

    def remove(self, name: str) -> bool:
        pin = self.pins.pop(name, None)
        if pin is None:
            return False
        self.pages.release(pin.page_ids)
        self.holders.subtract(pin.page_ids)
        self.holders = +self.holders  # drop the pages no pin holds any more
        if pin.state_slot is not None:
            assert self.pages.states is not None
            self.pages.states.release(pin.state_slot)
            self.state_holders.subtract(pin.state_hashes)
            self.state_holders = +self.state_holders
        if self.connector is not None:
            self.connector.unpin(pin.hashes)
        return True

    def expire(self) -> None:
        now = self.clock()
        for name in [name for name, pin in self.pins.items()
                     if pin.info.expires_at is not None and pin.info.expires_at <= now]:
            self.remove(name)

    def list(self) -> list[PinInfo]:
        self.expire()
        return [pin.info for pin in self.pins.values()]
