"""The KV connector, as vLLM's: K/V pages beyond the engine's own pool (tiers.py), each known by its
prefix hash within a KVLayout, in the step loop's own thread (steps are synchronous, so a load is done before
the prefill that needs it)."""
from __future__ import annotations

import hashlib
import logging
import math
from collections import Counter
from dataclasses import astuple, dataclass
from pathlib import Path

import torch

from zhuzi.config import EngineConfig, parse_bytes
from zhuzi.disk_cache import content_digest
from zhuzi.engine.core.kv.tiers import DiskTier, HostTier
from zhuzi.model.kv_pool import KVPool
from zhuzi.model.loader import weight_files
from zhuzi.outputs import KVTierStats

log = logging.getLogger("zhuzi")
FORMAT = 1  # bump when the bytes of a page change meaning
STATE_DTYPE = torch.float32  # a hybrid model's states (the model runner's state pool)


@dataclass(frozen=True)
class KVLayout:
    """What a page's bytes mean: K and V of which weights, computed in which dtype, stored in which dtype and
    shape (and for a hybrid model, the shapes of the states kept beside the pages). Its digest is written into
    every page and state file and every transfer, so neither is ever loaded into another model, another dtype
    or another layout."""

    model: str  # content_digest of the weights as stored
    dtype: str  # the pool's
    compute: str  # the activations' (float32 math over a bf16 pool rounds K/V apart from bf16 math)
    quantization: str | None
    groups: tuple[tuple[int, int, int], ...]  # per tensor of the pool (kv_pool.py): layers, KV heads, head width
    page_size: int
    states: tuple[tuple[int, ...], ...] = ()  # a hybrid model's state tensors: one slot's shape of each, float32

    @classmethod
    def of(cls, config: EngineConfig, pool: KVPool, path: Path, states: list[torch.Tensor]) -> KVLayout:
        """A group's head width: the pool's last dimension (a q8_0 head's values and scales: kv_format.py)."""
        pool_dtype, compute = (str(d).removeprefix("torch.") for d in (pool.dtype, config.precision.compute))
        groups = tuple((t.shape[0], t.shape[3], t.shape[4]) for t in pool.tensors)
        assert all(t.dtype == STATE_DTYPE for t in states)
        return cls(content_digest(weight_files(path)), pool_dtype, compute, config.quantization, groups,
                   config.page_size, tuple(tuple(t.shape[1:]) for t in states))

    @property
    def digest(self) -> bytes:
        return hashlib.blake2b(repr((FORMAT, *astuple(self))).encode(), digest_size=16).digest()

    @property
    def page_shape(self) -> tuple[int]:
        """A page as KVPool.read gives it: one row of each group's [layers, K/V, page_size, kv_heads, head width]."""
        return (sum(2 * self.page_size * math.prod(group) for group in self.groups),)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def page_bytes(self) -> int:
        return self.torch_dtype.itemsize * self.page_shape[0]

    @property
    def state_shape(self) -> tuple[int]:
        """The states after a page as one tensor: every state tensor's slot, flattened, one after another."""
        return (sum(math.prod(shape) for shape in self.states),)

    @property
    def state_bytes(self) -> int:
        return STATE_DTYPE.itemsize * self.state_shape[0]


class KVConnector:
    """The pool's pages in and out: the tiers, pins' protection there, and page copies for transfers. The
    page manager calls it at three moments:

      evicted(h, b)   the pool is about to reuse page b, which held h: it goes to the host-memory tier;
      computed(h, b)  page b was just computed: with a disk tier it is also written there (in the
                      background), so a restart, even after kill -9, finds it;
      lookup / load   at admission: how many leading pages of a prompt the tiers hold beyond the pool's own
                      prefix cache, then each one copied into a free pool page (a refused one ends the run).

    Pinned hashes (pins.py) are never evicted from a tier. A hybrid model's cached states (state_slots.py) go to
    the tiers too, as pages do (state_evicted, state_computed), and come back at admission (has_state,
    load_state): states take half of each tier's bound, pages the other half. On disk the states after a page
    are a file beside the page's, deleted with it."""

    def __init__(self, layout: KVLayout, kv_cache: KVPool, host_bytes: int = 0,
                 disk_folder: Path | None = None, disk_bytes: int = 0, states: list[torch.Tensor] | None = None):
        self.layout, self.kv_cache = layout, kv_cache
        self.pinned: Counter[bytes] = Counter()  # hash -> pins holding it
        self.states = states or []  # a hybrid model's state tensors, [slots, ...] each
        if self.states:
            host_bytes, disk_bytes = host_bytes // 2, disk_bytes // 2
        self.host = HostTier(host_bytes, layout.page_bytes, self.pinned) if host_bytes else None
        self.state_host = HostTier(host_bytes, layout.state_bytes, self.pinned) if host_bytes and self.states else None
        self.disk = self.state_disk = None
        if disk_folder is not None:
            folder = disk_folder / f"{layout.model[:16]}-{layout.digest.hex()[:16]}"
            if self.states:
                self.state_disk = DiskTier(folder, disk_bytes, layout.digest, layout.state_shape, STATE_DTYPE,
                                           self.pinned, suffix=".state")
            self.disk = DiskTier(folder, disk_bytes, layout.digest, layout.page_shape, layout.torch_dtype, self.pinned,
                                 on_evict=self.state_disk.discard if self.state_disk is not None else None)
            log.info("KV disk tier %s: %d pages found", folder, len(self.disk.index))

    @classmethod
    def of(cls, config: EngineConfig, path: Path, kv_cache: KVPool,
           states: list[torch.Tensor] | None = None) -> KVConnector:
        host = parse_bytes(config.kv_offload_memory)
        folder = Path(config.kv_offload_dir) if config.kv_offload_dir else None
        return cls(KVLayout.of(config, kv_cache, path, states or []), kv_cache, host, folder,
                   parse_bytes(config.kv_offload_disk), states)

    @property
    def has_tiers(self) -> bool:
        return self.host is not None or self.disk is not None

    # -- the pool's pages as tensors

    def _slots(self, page_id: int) -> slice:
        size = self.layout.page_size
        return slice(page_id * size, (page_id + 1) * size)

    def read(self, page_id: int) -> torch.Tensor:
        """A copy of the page in host memory (KVLayout.page_shape)."""
        return self.kv_cache.read(self._slots(page_id))

    def write(self, page_id: int, data: torch.Tensor) -> None:
        self.kv_cache.write(self._slots(page_id), data)

    # -- what the page manager calls

    def evicted(self, h: bytes, page_id: int) -> None:
        """The pool is about to overwrite page_id, which held h."""
        if self.host is not None:  # the disk tier has it already: it was written when computed
            self.host.put(h, self.read(page_id))

    def computed(self, h: bytes, page_id: int) -> None:
        """Page_id now holds h: the disk tier keeps a copy that outlives the process."""
        if self.disk is not None:
            self.disk.put(h, self.read(page_id))

    def lookup(self, hashes: list[bytes]) -> int:
        """How many of the leading hashes the tiers hold."""
        for n, h in enumerate(hashes):
            if not ((self.host is not None and h in self.host) or (self.disk is not None and h in self.disk)):
                return n
        return len(hashes)

    def load(self, h: bytes, page_id: int) -> bool:
        """Copy the page known by h into page_id; False if no tier can give it (missing or refused)."""
        for tier in (self.host, self.disk):
            if tier is not None and (data := tier.get(h)) is not None:
                self.write(page_id, data)
                tier.counts.hit_tokens += self.layout.page_size
                return True
        return False

    def read_state(self, slot: int) -> torch.Tensor:
        """A copy of a slot's states (KVLayout.state_shape)."""
        return torch.cat([t[slot].flatten() for t in self.states])

    def write_state(self, slot: int, data: torch.Tensor) -> None:
        for t, part in zip(self.states, data.split([t[0].numel() for t in self.states])):
            t[slot].copy_(part.view(t[slot].shape))

    def state_evicted(self, h: bytes, slot: int) -> None:
        """The state pool is about to reuse slot, which held the state after page h."""
        if self.state_host is not None:
            self.state_host.put(h, self.read_state(slot))

    def state_computed(self, h: bytes, slot: int) -> None:
        """Slot now holds the state after page h: the disk tier keeps a copy beside the page's."""
        if self.state_disk is not None:
            self.state_disk.put(h, self.read_state(slot))

    def has_state(self, h: bytes) -> bool:
        return any(tier is not None and h in tier for tier in (self.state_host, self.state_disk))

    def load_state(self, h: bytes, slot: int) -> bool:
        """Copy the state after page h into slot; False if no tier can give it (missing or refused)."""
        for tier in (self.state_host, self.state_disk):
            if tier is not None and (data := tier.get(h)) is not None:
                self.write_state(slot, data)
                tier.counts.hit_tokens += self.layout.page_size
                return True
        return False

    def pin(self, hashes: list[bytes]) -> None:
        self.pinned.update(hashes)

    def unpin(self, hashes: list[bytes]) -> None:
        self.pinned.subtract(hashes)
        for h in hashes:
            if self.pinned[h] <= 0:
                self.pinned.pop(h, None)

    def stats(self) -> dict[str, KVTierStats]:
        tiers = (("host", self.host), ("disk", self.disk), ("host_states", self.state_host),
                 ("disk_states", self.state_disk))
        return {name: tier.snapshot() for name, tier in tiers if tier is not None}

    @property
    def writing(self) -> bool:
        """The disk tier's writers have pages or states to write: their counts move without a step."""
        return any(tier is not None and tier.writing for tier in (self.disk, self.state_disk))

    def flush(self) -> None:
        """Wait for the disk writes queued so far."""
        for tier in (self.disk, self.state_disk):
            if tier is not None:
                tier.flush()

    def close(self) -> None:
        """Write what is queued for the disk tier, then stop its writers."""
        for tier in (self.disk, self.state_disk):
            if tier is not None:
                tier.close()
