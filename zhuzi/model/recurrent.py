"""Mixers that keep a recurrent state instead of KV (decoder -> a hybrid model's linear-attention layers): each
running sequence owns a slot of every such layer's state tensors (the state pool), read and updated in place as
its tokens go through. A step's sequences are runs of rows in the flat batch; a run may also leave its state
after some of its rows in a second slot (a snapshot at a page boundary, which the prefix cache keeps)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
import torch.nn.functional as F

from zhuzi.model import cpu_recurrent
from zhuzi.model.blocks import BlockWeight
from zhuzi.model.linear import Linear
from zhuzi.model.model_config import LinearAttentionShape, Mixer, ModelConfig
from zhuzi.model.parallel import Shard

Weight = torch.Tensor | BlockWeight
MakeLinear = Callable[[list[Weight]], Linear]  # the decoder's: parts' rows one after another, blocks kept

L2_EPS = 1e-6  # q and k are L2-normalised as the reference kernels (fla) do


@dataclass(frozen=True)
class StateRun:
    """One sequence's rows of a step."""

    start: int  # its first row in the flat batch
    length: int  # its new tokens this step
    slot: int  # its slot in every state tensor
    snapshot: tuple[int, int] | None = None  # (rows, slot): its state after that many rows, copied to that slot
    restore: int | None = None  # a slot whose state it starts from (a cached prefix's)
    fresh: bool = False  # it starts from zeros (its first tokens)


def ready(states: list[torch.Tensor], runs: list[StateRun]) -> None:
    """Before a step: each run's slot of a layer's states holds what it starts from."""
    for run in runs:
        for state in states:
            if run.restore is not None:
                state[run.slot].copy_(state[run.restore])
            elif run.fresh:
                state[run.slot].zero_()


@dataclass
class StateMetadata:
    runs: list[StateRun] = field(default_factory=list)  # in batch order


class RecurrentMixer(Protocol):
    """What the decoder needs of a mixer that keeps a state: its tensors' home in the checkpoint (prefix, under
    the layer), the shapes of its states for one sequence, its matrices (for quantization) and its pass."""

    prefix: str

    def state_shapes(self) -> list[tuple[int, ...]]: ...

    @property
    def matrices(self) -> list[tuple[object, str]]: ...

    def __call__(self, x: torch.Tensor, states: list[torch.Tensor], runs: list[StateRun]) -> torch.Tensor: ...


@dataclass
class GatedDeltaNet:
    """Qwen3.5's linear attention: q, k, v through a short causal convolution and SiLU, then the gated delta
    rule (a key_dim x value_dim state per value head), normed per head and gated by SiLU(z), projected out.
    States: the convolution's last inputs [slots, channels, kernel - 1] and the rule's [slots, heads, key_dim,
    value_dim], float32."""

    shape: LinearAttentionShape
    in_proj: Linear  # rows: q, k, v (the convolution's channels), z, b, a
    conv: torch.Tensor  # [channels, kernel]
    dt_bias: torch.Tensor  # [value_heads]
    decay_rate: torch.Tensor  # -exp(A_log) [value_heads]: g = decay_rate * softplus(a + dt_bias)
    norm: torch.Tensor  # [value_dim]: the gated RMSNorm's weight
    out_proj: Linear
    eps: float
    prefix = "linear_attn"

    @classmethod
    def build(cls, t: dict[str, Weight], p: str, config: ModelConfig, linear: MakeLinear,
              shard: Shard) -> GatedDeltaNet:
        """From its tensors under p (transformers' names): its input projections as one matmul, its parameters
        in float32. Under tensor parallelism, this rank's key heads and their value heads (rows of the input
        projections and of the convolution, columns of out_proj, whose partial sums the decoder adds up)."""
        s = config.linear
        assert s is not None
        keys, values, width = shard.key_heads, shard.value_heads, s.key_heads * s.key_dim
        if (keys.start, keys.stop) != (0, s.key_heads) and s.tiled:
            raise ValueError("a GGUF's linear-attention value heads (tiled by key head) do not split across "
                             "tensor-parallel ranks")
        qkv_rows = [range(keys.start * s.key_dim, keys.stop * s.key_dim),
                    range(width + keys.start * s.key_dim, width + keys.stop * s.key_dim),
                    range(2 * width + values.start * s.value_dim, 2 * width + values.stop * s.value_dim)]
        value_rows = range(values.start * s.value_dim, values.stop * s.value_dim)
        qkv, conv = t[f"{p}.in_proj_qkv.weight"], t[f"{p}.conv1d.weight"].float()[:, 0]
        projections = [qkv[r.start:r.stop] for r in qkv_rows] + [t[f"{p}.in_proj_z.weight"][value_rows.start:
                                                                                             value_rows.stop]]
        projections += [t[f"{p}.in_proj_{n}.weight"][values.start:values.stop] for n in ("b", "a")]
        out = t[f"{p}.out_proj.weight"]
        if len(value_rows) != out.shape[1]:
            out = out[:, value_rows.start:value_rows.stop]
        local = replace(s, key_heads=len(keys), value_heads=len(values))
        return cls(local, linear(projections), torch.cat([conv[r.start:r.stop] for r in qkv_rows]),
                   t[f"{p}.dt_bias"].float()[values.start:values.stop],
                   -t[f"{p}.A_log"].float()[values.start:values.stop].exp(), t[f"{p}.norm.weight"],
                   linear([out]), config.rms_norm_eps)

    def state_shapes(self) -> list[tuple[int, ...]]:
        s = self.shape
        return [(s.conv_channels, s.conv_kernel - 1), (s.value_heads, s.key_dim, s.value_dim)]

    @property
    def matrices(self) -> list[tuple[object, str]]:
        return [(self, "in_proj"), (self, "out_proj")]

    def __call__(self, x: torch.Tensor, states: list[torch.Tensor], runs: list[StateRun]) -> torch.Tensor:
        s = self.shape
        value_width = s.value_heads * s.value_dim
        mixed, z, b, a = self.in_proj(x).split([s.conv_channels, value_width, s.value_heads, s.value_heads], -1)
        beta = b.float().sigmoid()
        g = self.decay_rate * F.softplus(a.float() + self.dt_bias)
        core = torch.empty(x.shape[0], s.value_heads, s.value_dim, dtype=torch.float32, device=x.device)
        conv_state, rule_state = states
        ops = cpu_recurrent.ops(x.device)

        def decode(rows: torch.Tensor, slots: torch.Tensor) -> None:
            qkv = ops.short_conv_decode(mixed[rows].float(), conv_state, slots, self.conv, silu=True)
            core[rows] = ops.gated_delta_decode(*self._qkv(qkv), g[rows], beta[rows], rule_state, slots)

        def prefill(rows: slice, slot: int) -> None:
            qkv = ops.short_conv_prefill(mixed[rows].float(), conv_state, slot, self.conv, silu=True)
            core[rows] = ops.gated_delta_prefill(*self._qkv(qkv), g[rows], beta[rows], rule_state, slot)

        walk(runs, states, x.device, decode, prefill)
        core = core.to(x.dtype).float()  # rounded to the activations' dtype first, as the reference does
        normed = core * torch.rsqrt(core.pow(2).mean(-1, keepdim=True) + self.eps)
        gated = (self.norm * normed.to(x.dtype)) * F.silu(z.float().view(-1, s.value_heads, s.value_dim))
        return self.out_proj(gated.to(x.dtype).view(-1, value_width))

    def _qkv(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolution's output rows as the delta rule takes them: q and k per head, L2-normalised (q scaled
        by key_dim^-1/2), and v per head. A GGUF's value heads are tiled by key head: q and k are repeated to one
        per value head, the kernels' layout for them (value head h reads key head h // (value / key heads))."""
        s = self.shape
        key_width = s.key_heads * s.key_dim
        q, k, v = mixed.split([key_width, key_width, s.value_heads * s.value_dim], -1)
        q, k = (t.reshape(len(t), s.key_heads, s.key_dim) for t in (q, k))
        if s.tiled and s.value_heads != s.key_heads:
            q, k = (t.repeat(1, s.value_heads // s.key_heads, 1) for t in (q, k))
        q = F.normalize(q, dim=-1, eps=L2_EPS) * s.key_dim ** -0.5
        return q, F.normalize(k, dim=-1, eps=L2_EPS), v.reshape(len(v), s.value_heads, s.value_dim)

@dataclass
class ShortConv:
    """LFM2's short convolution: in_proj makes B, C and x; B * x runs through a causal depthwise convolution of
    width L_cache, its output times C goes through out_proj. State: the convolution's last inputs [slots,
    channels, kernel - 1], float32."""

    in_proj: Linear  # rows: B, C, x (this rank's channels of each)
    conv: torch.Tensor  # [channels, kernel]
    out_proj: Linear
    prefix = "conv"

    @classmethod
    def build(cls, t: dict[str, Weight], p: str, config: ModelConfig, linear: MakeLinear,
              shard: Shard) -> ShortConv:
        """From its tensors under p (transformers' names), the convolution in float32. Under tensor parallelism,
        this rank's channels (rows of B, C and x and of the convolution, columns of out_proj, whose partial sums
        the decoder adds up)."""
        h, ch = config.hidden_size, shard.channels
        in_proj, out = t[f"{p}.in_proj.weight"], t[f"{p}.out_proj.weight"]
        if len(ch) != h:
            out = out[:, ch.start:ch.stop]
        return cls(linear([in_proj[part * h + ch.start:part * h + ch.stop] for part in range(3)]),
                   t[f"{p}.conv.weight"].float()[ch.start:ch.stop, 0], linear([out]))

    def state_shapes(self) -> list[tuple[int, ...]]:
        return [(self.conv.shape[0], self.conv.shape[1] - 1)]

    @property
    def matrices(self) -> list[tuple[object, str]]:
        return [(self, "in_proj"), (self, "out_proj")]

    def __call__(self, x: torch.Tensor, states: list[torch.Tensor], runs: list[StateRun]) -> torch.Tensor:
        b, c, v = self.in_proj(x).chunk(3, -1)
        bx, (state,) = (b * v).float(), states
        conv = torch.empty_like(bx)
        ops = cpu_recurrent.ops(x.device)

        def decode(rows: torch.Tensor, slots: torch.Tensor) -> None:
            conv[rows] = ops.short_conv_decode(bx[rows], state, slots, self.conv)

        def prefill(rows: slice, slot: int) -> None:
            conv[rows] = ops.short_conv_prefill(bx[rows], state, slot, self.conv)

        walk(runs, states, x.device, decode, prefill)
        return self.out_proj(c * conv.to(x.dtype))


def walk(runs: list[StateRun], states: list[torch.Tensor], device: torch.device,
         decode: Callable[[torch.Tensor, torch.Tensor], None], prefill: Callable[[slice, int], None]) -> None:
    """A step's runs through a mixer: the one-token runs as one batch, decode(rows, slots), then each longer run
    piece by piece, prefill(rows, slot); a run's states are copied to its snapshot slot where its pieces are cut."""
    decodes = [run for run in runs if run.length == 1]
    if decodes:
        decode(torch.tensor([run.start for run in decodes], device=device),
               torch.tensor([run.slot for run in decodes], device=device))
        _copy(states, [(run.slot, run.snapshot[1]) for run in decodes if run.snapshot is not None])
    for run in (run for run in runs if run.length > 1):
        for rows, snapshot in _pieces(run):
            prefill(rows, run.slot)
            if snapshot is not None:
                _copy(states, [(run.slot, snapshot)])


def _copy(states: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
    """For each (slot, snapshot): the slot's state, as the rows so far leave it, copied to the snapshot slot."""
    for slot, snapshot in pairs:
        for state in states:
            state[snapshot].copy_(state[slot])


def _pieces(run: StateRun) -> list[tuple[slice, int | None]]:
    """A run's rows cut where its snapshot is taken: (rows, the snapshot slot after them or None)."""
    end = run.start + run.length
    if run.snapshot is None:
        return [(slice(run.start, end), None)]
    rows, slot = run.snapshot
    cut = run.start + rows
    return [(slice(run.start, cut), slot)] + ([(slice(cut, end), None)] if cut < end else [])


# each recurrent kind's class
MIXERS: dict[Mixer, type] = {Mixer.LINEAR_ATTENTION: GatedDeltaNet, Mixer.SHORT_CONV: ShortConv}
