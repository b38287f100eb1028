"""Tensor parallelism over torch.distributed (gloo on CPU, NCCL on CUDA): each rank holds a slice of every
layer: QKV and gate/up by output rows, O and down by input columns (then an all-reduce), the LM head by
vocabulary (then a gather). Heads split by KV head (each with its query heads), contiguous ranges, the first
ranks taking the remainder. Rank 0 is the engine; it posts each pass to the ranks' store and the other ranks
follow."""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zhuzi.model.model_config import ModelConfig

# A collective waits this long for its peers (a rank that hangs mid-step).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)


def split(n: int, parts: int, index: int) -> range:
    """Part index of range(n) cut into contiguous parts; the first n % parts parts are one longer."""
    size, extra = divmod(n, parts)
    start = index * size + min(index, extra)
    return range(start, start + size + (index < extra))


@dataclass(frozen=True)
class Shard:
    """What one rank holds of the model: ranges of heads, of the MLP's width and of the vocabulary."""

    q_heads: range
    kv_heads: range
    mlp: range
    vocab: range
    expert: range = range(0)  # of each routed expert's width (every rank a slice of every expert)
    shared_expert: range = range(0)
    key_heads: range = range(0)  # a linear-attention layer's, each with its value heads
    value_heads: range = range(0)
    channels: range = range(0)  # a short-convolution layer's (LFM2): rows of B, C, x and the convolution
    mamba_heads: range = range(0)  # a Mamba2 layer's (Granite 4), with the groups of B and C they read
    mamba_groups: range = range(0)
    mamba_groups_span_ranks: bool = False  # fewer groups than ranks: a group's gated norm sums across ranks

    @classmethod
    def of(cls, c: ModelConfig, rank: int = 0, world_size: int = 1) -> Shard:
        if c.num_kv_heads < world_size:
            raise ValueError(f"tensor_parallel_size {world_size} is more than the model's {c.num_kv_heads} KV heads")
        kv = split(c.num_kv_heads, world_size, rank)
        q_per_kv = c.num_heads // c.num_kv_heads
        keys = values = range(0)
        if c.linear is not None:
            if c.linear.key_heads < world_size:
                raise ValueError(f"tensor_parallel_size {world_size} is more than the model's "
                                 f"{c.linear.key_heads} linear-attention key heads")
            keys, per_key = split(c.linear.key_heads, world_size, rank), c.linear.value_heads // c.linear.key_heads
            values = range(keys.start * per_key, keys.stop * per_key)
        heads, groups = _mamba(c, rank, world_size) if c.mamba is not None else (range(0), range(0))
        span = c.mamba is not None and c.mamba.groups < world_size
        return cls(range(kv.start * q_per_kv, kv.stop * q_per_kv), kv, split(c.intermediate_size, world_size, rank),
                   split(c.vocab_size, world_size, rank), split(c.moe_intermediate_size, world_size, rank),
                   split(c.shared_expert_intermediate_size, world_size, rank), keys, values,
                   split(c.hidden_size, world_size, rank), heads, groups, span)


def _mamba(c: ModelConfig, rank: int, world_size: int) -> tuple[range, range]:
    """A rank's Mamba2 heads and the groups of B and C they read. With at least a group per rank, the groups split
    and each takes its heads along; with fewer (Granite 4's one), the heads split and the groups they read are
    held on each rank that reads them (as vLLM holds Mamba2's one group on every rank)."""
    m = c.mamba
    assert m is not None
    per_group = m.heads // m.groups
    if m.groups >= world_size:
        groups = split(m.groups, world_size, rank)
        return range(groups.start * per_group, groups.stop * per_group), groups
    if m.heads < world_size:
        raise ValueError(f"tensor_parallel_size {world_size} is more than the model's {m.heads} Mamba2 heads")
    heads = split(m.heads, world_size, rank)
    return heads, range(heads.start // per_group, (heads.stop - 1) // per_group + 1)


def head_rows(w: torch.Tensor, heads: range, head_dim: int) -> torch.Tensor:
    """The rows (dim 0) of a projection's weight or bias that produce these heads."""
    return w[heads.start * head_dim:heads.stop * head_dim]


@dataclass
class TPRank:
    """This process as one rank of tensor parallelism."""

    rank: int
    world_size: int
    store: dist.Store  # the ranks' key-value store (the control plane posts each step there)
    device: torch.device

    @classmethod
    def join(cls, rank: int, world_size: int, master_addr: str, master_port: int, device: str,
             store_running: bool = False) -> TPRank:
        """Meet the other ranks at master_addr:master_port, where rank 0 listens (or, with store_running, a
        store already listens: torchrun's agent hosts one there)."""
        store = dist.TCPStore(master_addr, master_port, world_size, is_master=rank == 0 and not store_running,
                              timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)
        dev = torch.device(device)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=store, rank=rank,
                                world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
        return cls(rank, world_size, dist.PrefixStore("zhuzi-tp/", store), dev)

    @property
    def leads(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[rows, this rank's vocabulary] -> [rows, vocab_size] on every rank. gloo gathers equal shapes only:
        the shorter slices are padded to the longest and trimmed after."""
        sizes = [len(split(vocab_size, self.world_size, r)) for r in range(self.world_size)]
        width = max(sizes)
        padded = torch.nn.functional.pad(logits, (0, width - logits.shape[1])).contiguous()
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded)
        return torch.cat([part[:, :size] for part, size in zip(parts, sizes)], 1)

    def close(self) -> None:
        dist.destroy_process_group()
