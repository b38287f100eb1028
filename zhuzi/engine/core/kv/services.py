"""What the engine keeps of KV beyond its pool's own prefix cache, in one place: the KV connector and its
tiers (connector.py), pinned prefixes (pins.py) and prefill/decode hand-offs (transfer.py); built
with the page manager they plug into, ticked before each step, counted in EngineStats, closed at the end.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zhuzi.config import EngineConfig, KVPlan, parse_bytes
from zhuzi.engine.core.kv.connector import KVConnector
from zhuzi.engine.core.kv.page_manager import KVEvents, PageManager
from zhuzi.engine.core.kv.pins import PinTable
from zhuzi.engine.core.kv.state_slots import StateSlots
from zhuzi.engine.core.kv.transfer import Handoffs
from zhuzi.engine.messages import Handoff
from zhuzi.engine.sequence import Sequence
from zhuzi.model.kv_pool import KVPool
from zhuzi.model.model_config import ModelConfig


@dataclass
class KVServices:
    connector: KVConnector | None  # with a tier configured, or hand-offs
    pins: PinTable
    handoffs: Handoffs | None  # on the replicas of a prefill/decode pair

    @classmethod
    def build(cls, config: EngineConfig, model: ModelConfig, path: Path, plan: KVPlan, kv_cache: KVPool,
              num_pages: int, kv_events: bool, handoffs: bool,
              states: list[torch.Tensor] | None = None) -> tuple[PageManager, KVServices]:
        """states: a hybrid model's state tensors (the model runner's), which the host tier keeps too."""
        connector = KVConnector.of(config, path, kv_cache, states) if config.kv_tiers or handoffs else None
        pages = PageManager(num_pages, config.page_size, config.enable_prefix_caching,
                              events=KVEvents() if kv_events else None, connector=connector, window=model.kv_window,
                              states=StateSlots(plan.state_slots, connector) if plan.state_slots else None,
                              draft_slots=plan.draft_slots)
        pins = PinTable(pages, connector, plan.bytes_per_token * plan.page_size,
                        parse_bytes(config.kv_pinned_memory), plan.state_bytes)
        return pages, cls(connector, pins, Handoffs(pages, connector) if handoffs and connector else None)

    def start_handoff(self, handoff: Handoff, seqs: list[Sequence]) -> None:
        if self.handoffs is None:
            raise ValueError("this engine takes no part in prefill/decode hand-offs")
        self.handoffs.start(handoff, seqs)

    def prompt_computed(self, seq: Sequence) -> None:
        """seq has sampled (its prompt is in the prefix cache): a prefill replica ships it now."""
        if self.handoffs is not None:
            self.handoffs.prompt_computed(seq)

    def tick(self) -> None:
        """Before a step: expired pins let go, hand-offs that waited too long given up."""
        self.pins.expire()
        if self.handoffs is not None:
            self.handoffs.expire()

    def stats(self) -> dict[str, Any]:
        """EngineStats' fields of what this holds."""
        pins, handoffs = self.pins, self.handoffs
        counts = {"kv_tiers": self.connector.stats() if self.connector is not None else {},
                  "num_pins": len(pins.pins), "pinned_pages": pins.num_pages,
                  "pinned_bytes": pins.bytes}
        if handoffs is not None:
            counts.update(kv_transfers_sent=handoffs.sent, kv_transfers_received=handoffs.received,
                          kv_transfers_failed=handoffs.failed, kv_transfer_pages_sent=handoffs.pages_sent,
                          kv_transfer_pages_received=handoffs.pages_received)
        return counts

    def close(self) -> None:
        """Write what the disk tier has queued."""
        if self.connector is not None:
            self.connector.close()
