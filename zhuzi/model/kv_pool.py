"""The KV pool (worker -> model): K and V of the layers that write them, grouped by shape (KV heads, head
size) into one stacked tensor per group, [the group's layers, K/V, slots, kv_heads, head_width]. Each layer
attends one entry: its own, or the earlier layer's whose K/V it shares (Gemma 4); a layer that keeps no KV (a
mixer with a state of its own) has none. Every group has the same slots: a page is those slots of every group."""
from __future__ import annotations

import math
import mmap
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from zhuzi.model import kv_format
from zhuzi.model.families import family
from zhuzi.model.model_config import LayerSpec, ModelConfig
from zhuzi.model.placement import Placement


@dataclass(frozen=True)
class KVGroup:
    """Layers whose K/V have one shape, stacked in one tensor."""

    layers: tuple[int, ...]  # the layers writing their K/V here, in order
    kv_heads: int
    head_dim: int
    device: str | None = None  # where a layer split (placement.py) puts them; None: the pool's device

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * len(self.layers) * self.kv_heads * kv_format.head_bytes(self.head_dim, dtype)


@dataclass(frozen=True)
class KVShape:
    groups: tuple[KVGroup, ...]
    entries: tuple[tuple[int, int] | None, ...]  # per layer, (group, index in it) of the K/V it attends; None: no KV

    @classmethod
    def of(cls, specs: Sequence[LayerSpec], placement: Placement | None = None) -> KVShape:
        """With a layer split, the accelerator's layers and the CPU's are groups apart, each on its device (by
        side, not by the device's name: both sides are the CPU in a test of the split)."""
        split = placement is not None and placement.split
        kinds: dict[tuple[int, int, bool], list[int]] = {}
        for i, spec in enumerate(specs):
            if spec.mixer.keeps_kv and spec.kv_source is None:
                side = split and placement.on_accelerator(i)
                kinds.setdefault((spec.kv_heads, spec.head_dim, side), []).append(i)
        own = {layer: (g, j) for g, layers in enumerate(kinds.values()) for j, layer in enumerate(layers)}
        entries = tuple(own[i if spec.kv_source is None else spec.kv_source] if spec.mixer.keeps_kv else None
                        for i, spec in enumerate(specs))
        return cls(tuple(KVGroup(tuple(layers), heads, dim, str(placement.layer(layers[0])) if split else None)
                         for (heads, dim, _), layers in kinds.items()), entries)

    @classmethod
    def of_model(cls, config: ModelConfig) -> KVShape:
        return cls.of(family(config.architecture).layers(config))

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """What the pool stores of one token: K and V of every layer that writes them."""
        return sum(group.bytes_per_token(dtype) for group in self.groups)

    def with_kv_heads(self, kv_heads: int) -> KVShape:
        """The shape of one tensor-parallel rank's pool, which holds kv_heads of every layer."""
        return replace(self, groups=tuple(replace(group, kv_heads=kv_heads) for group in self.groups))


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A tensor of zeros for the KV pool. On the CPU an anonymous mapping, which the OS zeroes a page at a time
    as it is first written: the pool costs memory and time as its pages are used, not all of it at start
    (torch.zeros writes every memory page at once). Zeros, not garbage: attention reads the padding slots of a page
    and masks them, and garbage may hold NaN."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, math.prod(shape) * dtype.itemsize)
    return torch.frombuffer(pages, dtype=dtype).view(shape)


@dataclass
class KVPool:
    shape: KVShape
    tensors: list[torch.Tensor]  # per group: [layers, K/V, slots, kv_heads, head_width]

    @classmethod
    def zeros(cls, shape: KVShape, slots: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> KVPool:
        """q8_0 heads are wider: their scales follow their values (kv_format.py)."""
        for group in shape.groups:
            kv_format.check(group.head_dim, dtype)
        return cls(shape, [zeroed((len(g.layers), 2, slots, g.kv_heads, kv_format.head_width(g.head_dim, dtype)),
                                  dtype, g.device or device) for g in shape.groups])

    def layer(self, i: int) -> torch.Tensor | None:
        """[K/V, slots, kv_heads, head_width] of the K/V layer i attends; None for a layer that keeps no KV."""
        entry = self.shape.entries[i]
        return None if entry is None else self.tensors[entry[0]][entry[1]]

    @property
    def dtype(self) -> torch.dtype:
        return self.tensors[0].dtype

    def read(self, slots: slice) -> torch.Tensor:
        """A copy of these slots of every group, one flat row (on the CPU)."""
        return torch.cat([t[:, :, slots].reshape(-1).cpu() for t in self.tensors])

    def write(self, slots: slice, data: torch.Tensor) -> None:
        """The inverse of read."""
        start = 0
        for t in self.tensors:
            view = t[:, :, slots]
            view.copy_(data[start:start + view.numel()].view(view.shape).to(t.device))
            start += view.numel()

    def clone(self) -> KVPool:
        return KVPool(self.shape, [t.clone() for t in self.tensors])
