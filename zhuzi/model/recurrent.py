"""Mixers that keep a recurrent state instead of KV (decoder -> a hybrid model's linear-attention and state-space
layers): each running sequence owns a slot of every such layer's state tensors (the state pool), read and updated
in place as its tokens go through. A step's sequences are runs of rows in the flat batch; a run may also leave its state
after some of its rows in other slots (snapshots: at a page boundary, which the prefix cache keeps; after each
speculative draft, of which the verdict keeps one)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
import torch.nn.functional as F

from zhuzi.model import cpu_recurrent
from zhuzi.model.blocks import BlockWeight
from zhuzi.model.linear import Linear
from zhuzi.model.model_config import LinearAttentionShape, Mamba2Shape, Mixer, ModelConfig
from zhuzi.model.parallel import Shard

Weight = torch.Tensor | BlockWeight
MakeLinear = Callable[[list[Weight]], Linear]  # the decoder's: parts' rows one after another, blocks kept
SumRanks = Callable[[torch.Tensor], torch.Tensor]  # the decoder's: every rank's partial sums added up

L2_EPS = 1e-6  # q and k are L2-normalised as the reference kernels (fla) do


@dataclass(frozen=True)
class StateRun:
    """One sequence's rows of a step."""

    start: int  # its first row in the flat batch
    length: int  # its new tokens this step
    slot: int  # its slot in every state tensor
    snapshots: tuple[tuple[int, int], ...] = ()  # (rows, slot): its state after that many rows, copied to that slot
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


def ssm_step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of Mamba2's selective scan, in float32, for any leading dims (a decode batch's sequences):
    state [..., heads, head_dim, state_size], x [..., heads, head_dim], dt [..., heads] (after its softplus), a
    [heads] (negative), b and c [..., heads, state_size]. Returns (S exp(dt a) + dt x b^T, that state times c)."""
    state = state * (dt * a).exp()[..., None, None] + (dt[..., None] * x)[..., None] * b[..., None, :]
    return state, (state * c[..., None, :]).sum(-1)


def selective_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                   state: torch.Tensor) -> torch.Tensor:
    """One sequence's tokens (x [tokens, heads, head_dim], dt [tokens, heads], b and c [tokens, heads, state_size])
    through the scan, token by token (a kernel of the chunked SSD form would serve prompts), after its state
    [heads, head_dim, state_size], updated in place."""
    out, s = torch.empty_like(x), state
    for t in range(len(x)):
        s, out[t] = ssm_step(s, x[t], dt[t], a, b[t], c[t])
    state.copy_(s)
    return out


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
    def build(cls, t: dict[str, Weight], p: str, config: ModelConfig, linear: MakeLinear, shard: Shard,
              sum_ranks: SumRanks) -> GatedDeltaNet:
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
    def build(cls, t: dict[str, Weight], p: str, config: ModelConfig, linear: MakeLinear, shard: Shard,
              sum_ranks: SumRanks) -> ShortConv:
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
    piece by piece, prefill(rows, slot); a run's states are copied to its snapshot slots where its pieces are cut."""
    decodes = [run for run in runs if run.length == 1]
    if decodes:
        decode(torch.tensor([run.start for run in decodes], device=device),
               torch.tensor([run.slot for run in decodes], device=device))
        _copy(states, [(run.slot, slot) for run in decodes for _, slot in run.snapshots])
    for run in (run for run in runs if run.length > 1):
        for rows, snapshots in _pieces(run):
            prefill(rows, run.slot)
            _copy(states, [(run.slot, slot) for slot in snapshots])


@dataclass
class Mamba2:
    """Granite 4's state-space layer (Mamba2): in_proj makes a gate z, the convolution's channels (x, B, C) and
    dt; x, B and C go through a short causal convolution (with its bias) and SiLU, then the selective scan (a
    head_dim x state_size state per head) plus D x; the result times SiLU(z) is RMS-normed per group and projected
    out. States: the convolution's last inputs [slots, channels, kernel - 1] and the scan's [slots, heads,
    head_dim, state_size], float32. The convolution runs on the recurrent kernels, the scan in torch."""

    shape: Mamba2Shape  # this rank's heads and the groups they read
    in_proj: Linear  # rows: z, x B C (the convolution's channels), dt
    conv: torch.Tensor  # [channels, kernel]
    conv_bias: torch.Tensor  # [channels]
    dt_bias: torch.Tensor  # [heads]
    decay_rate: torch.Tensor  # A = -exp(A_log) [heads]
    skip: torch.Tensor  # D [heads]
    norm: torch.Tensor  # [heads * head_dim]: the gated RMSNorm's weight
    out_proj: Linear
    eps: float
    whole: Mamba2Shape  # the model's (shape is this rank's)
    head_groups: torch.Tensor  # [heads]: each head's group among the model's
    sum_ranks: SumRanks | None  # where a group's heads lie on several ranks: its norm's squares summed across them
    prefix = "mamba"

    @classmethod
    def build(cls, t: dict[str, Weight], p: str, config: ModelConfig, linear: MakeLinear, shard: Shard,
              sum_ranks: SumRanks) -> Mamba2:
        """From its tensors under p (transformers' names), its parameters in float32. Under tensor parallelism,
        this rank's heads (their rows of z, x, dt and the convolution, their per-head parameters and norm weights,
        their columns of out_proj, whose partial sums the decoder adds up) and the rows of B and C of the groups
        they read."""
        m = config.mamba
        assert m is not None
        heads, groups = shard.mamba_heads, shard.mamba_groups
        inner = range(heads.start * m.head_dim, heads.stop * m.head_dim)  # of z, of x, of the norm, out's columns
        b = range(m.inner + groups.start * m.state_size, m.inner + groups.stop * m.state_size)
        channels = [inner, b, _shifted(b, m.groups * m.state_size)]  # of the convolution: x, B, C
        rows = [inner] + [_shifted(r, m.inner) for r in channels] + [_shifted(heads, m.inner + m.conv_channels)]
        in_proj, conv, bias = t[f"{p}.in_proj.weight"], t[f"{p}.conv1d.weight"].float()[:, 0], t[f"{p}.conv1d.bias"]
        out = t[f"{p}.out_proj.weight"]
        out = out if len(inner) == m.inner else out[:, inner.start:inner.stop]

        def per_head(name: str) -> torch.Tensor:
            return t[f"{p}.{name}"].float()[heads.start:heads.stop]

        return cls(replace(m, heads=len(heads), groups=len(groups)), linear([in_proj[r.start:r.stop] for r in rows]),
                   torch.cat([conv[r.start:r.stop] for r in channels]),
                   torch.cat([bias.float()[r.start:r.stop] for r in channels]), per_head("dt_bias"),
                   -per_head("A_log").exp(), per_head("D"), t[f"{p}.norm.weight"][inner.start:inner.stop],
                   linear([out]), config.rms_norm_eps, m,
                   torch.tensor([h // (m.heads // m.groups) for h in heads], device=conv.device),
                   sum_ranks if shard.mamba_groups_span_ranks else None)

    def state_shapes(self) -> list[tuple[int, ...]]:
        s = self.shape
        return [(s.conv_channels, s.conv_kernel - 1), (s.heads, s.head_dim, s.state_size)]

    @property
    def matrices(self) -> list[tuple[object, str]]:
        return [(self, "in_proj"), (self, "out_proj")]

    def __call__(self, x: torch.Tensor, states: list[torch.Tensor], runs: list[StateRun]) -> torch.Tensor:
        s = self.shape
        z, mixed, dt = self.in_proj(x).split([s.inner, s.conv_channels, s.heads], -1)
        dt = F.softplus(dt.float() + self.dt_bias)
        y = torch.empty(x.shape[0], s.heads, s.head_dim, dtype=torch.float32, device=x.device)
        conv_state, scan_state = states
        ops = cpu_recurrent.ops(x.device)
        decodes = [run for run in runs if run.length == 1]  # one token each: one batch
        if decodes:
            rows = torch.tensor([run.start for run in decodes], device=x.device)
            slots = torch.tensor([run.slot for run in decodes], device=x.device)
            xs, b, c = self._xbc(ops.short_conv_decode(mixed[rows].float(), conv_state, slots, self.conv,
                                                       self.conv_bias, silu=True))
            scan_state[slots], out = ssm_step(scan_state[slots], xs, dt[rows], self.decay_rate, b, c)
            y[rows] = out + self.skip[:, None] * xs
            _copy(states, [(run.slot, slot) for run in decodes for _, slot in run.snapshots])
        for run in (run for run in runs if run.length > 1):
            for rows, snapshots in _pieces(run):
                xs, b, c = self._xbc(ops.short_conv_prefill(mixed[rows].float(), conv_state, run.slot, self.conv,
                                                            self.conv_bias, silu=True))
                y[rows] = selective_scan(xs, dt[rows], self.decay_rate, b, c, scan_state[run.slot]) + \
                    self.skip[:, None] * xs
                _copy(states, [(run.slot, slot) for slot in snapshots])
        gated = y * F.silu(z.float().view(-1, s.heads, s.head_dim))
        return self.out_proj(self.norm * self._group_norm(gated).view(-1, s.inner).to(x.dtype))

    def _group_norm(self, gated: torch.Tensor) -> torch.Tensor:
        """gated [tokens, heads, head_dim] RMS-normed over each group's channels (its heads' on every rank)."""
        squares = torch.zeros(len(gated), self.whole.groups, dtype=gated.dtype, device=gated.device)
        squares.index_add_(1, self.head_groups, gated.pow(2).sum(-1))
        if self.sum_ranks is not None:
            squares = self.sum_ranks(squares)
        variance = squares[:, self.head_groups] / (self.whole.inner // self.whole.groups)
        return gated * torch.rsqrt(variance + self.eps)[..., None]

    def _xbc(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolution's output rows as the scan takes them: x per head, and B and C repeated from their group
        to each of its heads (a group serves heads / groups consecutive heads)."""
        s = self.shape
        xs, b, c = mixed.split([s.inner, s.groups * s.state_size, s.groups * s.state_size], -1)
        local = self.head_groups - self.head_groups[0]  # this rank's first group is its first head's
        b, c = (t.reshape(len(t), s.groups, s.state_size)[:, local] for t in (b, c))
        return xs.reshape(len(xs), s.heads, s.head_dim), b, c


def _shifted(r: range, by: int) -> range:
    return range(r.start + by, r.stop + by)


def _copy(states: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
    """For each (slot, snapshot): the slot's state, as the rows so far leave it, copied to the snapshot slot."""
    for slot, snapshot in pairs:
        for state in states:
            state[snapshot].copy_(state[slot])


def _pieces(run: StateRun) -> list[tuple[slice, list[int]]]:
    """A run's rows cut where its snapshots are taken: (rows, the snapshot slots after them)."""
    cuts: dict[int, list[int]] = {}
    for rows, slot in run.snapshots:
        cuts.setdefault(rows, []).append(slot)
    pieces, start = [], 0
    for rows in sorted(cuts.keys() | {run.length}):
        pieces.append((slice(run.start + start, run.start + rows), cuts.get(rows, [])))
        start = rows
    return pieces


# each recurrent kind's class
MIXERS: dict[Mixer, type] = {Mixer.LINEAR_ATTENTION: GatedDeltaNet, Mixer.SHORT_CONV: ShortConv, Mixer.MAMBA2: Mamba2}
