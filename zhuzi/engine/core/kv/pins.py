"""Pinned prefixes: named runs of full KV blocks that the pool keeps, and the KV tiers never evict, until the
pin is deleted or its time to live ends."""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from zhuzi.engine.core.kv.block_manager import BlockManager, hash_chain
from zhuzi.engine.core.kv.connector import KVConnector
from zhuzi.engine.sequence import PinSpec, Sequence
from zhuzi.outputs import PinInfo
from zhuzi.sampling_params import InvalidRequest


@dataclass
class Pin:
    info: PinInfo
    hashes: list[bytes]
    block_ids: list[int]


class PinTable:
    """The pins. A pin is computed as an inspection of its token ids is (a probe through the step loop, so the
    prefix cache and the tiers give whatever they hold); when the probe has run, the pin takes one more
    reference on each of its full blocks. Blocks shared by several pins are held once per pin but counted once
    against the bound (EngineConfig.kv_pinned_memory, at most half the pool), checked when a pin is asked for
    and when it completes. An expired pin is released at the next step or listing. A new pin under a name
    replaces the old one."""

    def __init__(self, blocks: BlockManager, connector: KVConnector | None, block_bytes: int, limit_bytes: int,
                 clock: Callable[[], float] = time.time):
        self.blocks, self.connector, self.clock = blocks, connector, clock
        # Pins may never take more than half the pool: the rest is for the requests that use them.
        self.block_bytes, self.limit_blocks = block_bytes, min(limit_bytes // block_bytes, blocks.num_blocks // 2)
        self.limit_bytes = self.limit_blocks * block_bytes
        self.pins: dict[str, Pin] = {}
        self.holders: Counter[int] = Counter()  # block id -> pins holding it

    @property
    def num_blocks(self) -> int:
        """Pool blocks held by pins."""
        return len(self.holders)

    def check(self, spec: PinSpec, token_ids: list[int], param: str) -> None:
        """InvalidRequest unless a pin of token_ids fits: at least one full block, within the bound."""
        size = self.blocks.block_size
        if not self.blocks.enable_prefix_caching:
            raise InvalidRequest(None, "pins keep blocks of the prefix cache, which this engine runs without")
        if len(token_ids) < size:
            raise InvalidRequest(param, f"a pin holds whole KV blocks of {size} tokens; got {len(token_ids)} tokens")
        if spec.ttl is not None and not spec.ttl > 0:
            raise InvalidRequest("ttl", f"ttl must be a positive number of seconds, got {spec.ttl}")
        self._check_room(list(hash_chain(token_ids, size)), spec.name, param)

    def _check_room(self, hashes: list[bytes], name: str, param: str) -> None:
        old = self.pins.get(name)
        held = self.holders - Counter(old.block_ids if old else [])
        new = {self.blocks.cached.get(h, h) for h in hashes} - set(held)  # uncached ones count as new blocks
        if (need := len(held) + len(new)) > self.limit_blocks:
            raise InvalidRequest(param, (
                f"pinned prefixes would hold {need * self.block_bytes} bytes of KV cache, over the "
                f"{self.limit_bytes} that kv_pinned_memory allows; delete a pin or raise it"),
                "pinned_memory_exceeded")

    def complete(self, seq: Sequence) -> PinInfo:
        """The probe seq has run its token ids and published their full blocks (it may have ended since: nothing
        was allocated in between): pin them (InvalidRequest if they no longer fit)."""
        spec = seq.probe.pin if seq.probe is not None else None
        assert spec is not None
        hashes = seq.block_hashes[:seq.num_tokens // self.blocks.block_size]
        if missing := sum(h not in self.blocks.cached for h in hashes):
            raise InvalidRequest("token_ids", f"{missing} of the pin's {len(hashes)} blocks left the prefix cache")
        self._check_room(hashes, spec.name, "token_ids")
        self.remove(spec.name)
        block_ids = [self.blocks.cached[h] for h in hashes]
        self.blocks.hold(block_ids)
        self.holders.update(block_ids)
        if self.connector is not None:
            self.connector.pin(hashes)
        now = self.clock()
        info = PinInfo(spec.name, len(hashes) * self.blocks.block_size, len(hashes), len(hashes) * self.block_bytes,
                       now, None if spec.ttl is None else now + spec.ttl, seq.num_cached_tokens)
        self.pins[spec.name] = Pin(info, hashes, block_ids)
        return info

    def remove(self, name: str) -> bool:
        pin = self.pins.pop(name, None)
        if pin is None:
            return False
        self.blocks.release(pin.block_ids)
        self.holders.subtract(pin.block_ids)
        self.holders = +self.holders  # drop the blocks no pin holds any more
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
