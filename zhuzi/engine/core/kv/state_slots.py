"""The state pool's slots, for hybrid models (layers that keep a recurrent state instead of KV): a running
sequence's live state, its state at the last page boundary it crossed, and in the prefix cache such boundary
states by the hash of the page they end, evicted least recently used first as pages are."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from zhuzi.engine.core.kv.connector import KVConnector


@dataclass
class StateSlots:
    num_slots: int
    connector: KVConnector | None = None  # its tiers keep cached states: the disk as cached, host memory when evicted
    free: OrderedDict[int, None] = field(init=False)  # LRU order; cached states among them until taken
    cached: dict[bytes, int] = field(init=False)  # page hash -> the slot holding the state after that page
    hashes: dict[int, bytes] = field(init=False)  # slot -> its hash, while cached
    holders: dict[int, int] = field(init=False)  # taken slot -> how many hold it

    def __post_init__(self) -> None:
        self.free = OrderedDict.fromkeys(range(self.num_slots))
        self.cached, self.hashes, self.holders = {}, {}, {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    def take(self) -> int | None:
        """A slot to write (the least recently used, whatever it cached); None if every slot is held."""
        if not self.free:
            return None
        slot, _ = self.free.popitem(last=False)
        if (h := self.hashes.pop(slot, None)) is not None:
            del self.cached[h]
            if self.connector is not None:
                self.connector.state_evicted(h, slot)
        self.holders[slot] = 1
        return slot

    def hold(self, h: bytes) -> int | None:
        """The cached state after page h, held until released (it is read at the next step); None if none."""
        slot = self.cached.get(h)
        if slot is not None:
            self.free.pop(slot, None)
            self.holders[slot] = self.holders.get(slot, 0) + 1
        return slot

    def release(self, slot: int) -> None:
        self.holders[slot] -= 1
        if self.holders[slot] == 0:
            del self.holders[slot]
            self.free[slot] = None

    def publish(self, slot: int, h: bytes) -> None:
        """A held slot's state is the state after page h: the prefix cache keeps it (released here)."""
        if h in self.cached:  # another sequence's, the same bits
            self.release(slot)
            self.free.move_to_end(slot, last=False)  # nothing worth keeping: the first to reuse
            return
        self.cached[h], self.hashes[slot] = slot, h
        if self.connector is not None:
            self.connector.state_computed(h, slot)
        self.release(slot)
