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


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A depthwise causal convolution over sequences' rows x [sequences, tokens, channels], state [sequences,
    channels, kernel - 1] holding the inputs before them (updated in place to hold the last ones); returns
    [sequences, tokens, channels]."""
    kernel = weight.shape[1]
    history = torch.cat([state, x.transpose(1, 2).to(state.dtype)], dim=2)  # [sequences, channels, k - 1 + tokens]
    out = F.conv1d(history, weight[:, None], groups=weight.shape[0])
    state.copy_(history[:, :, history.shape[2] - (kernel - 1):])
    return out.transpose(1, 2)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> torch.Tensor:
    """Sequences' tokens through the gated delta rule, in float32: q, k [sequences, tokens, heads, key_dim]
    (normalised, q scaled), v [..., value_dim], g (log decay) and beta [sequences, tokens, heads]; state
    [sequences, heads, key_dim, value_dim] updated in place. Per token: S = S exp(g); S += k (beta (v - S^T k))^T;
    out = S^T q."""
    out = torch.empty_like(v)
    s = state
    for t in range(q.shape[1]):
        s = s * g[:, t].exp()[..., None, None]
        delta = (v[:, t] - (s * k[:, t, ..., None]).sum(-2)) * beta[:, t, :, None]
        s = s + k[:, t, ..., None] * delta[..., None, :]
        out[:, t] = (s * q[:, t, ..., None]).sum(-2)
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
        key_width, value_width = s.key_heads * s.key_dim, s.value_heads * s.value_dim
        mixed, z, b, a = self.in_proj(x).split([s.conv_channels, value_width, s.value_heads, s.value_heads], -1)
        beta = b.float().sigmoid()
        g = self.decay_rate * F.softplus(a.float() + self.dt_bias)
        core = torch.empty(x.shape[0], s.value_heads, s.value_dim, dtype=torch.float32, device=x.device)
        conv_state, rule_state = states
        decodes = [run for run in runs if run.length == 1]  # one token each: one batch
        pieces = [([run.start for run in decodes], [run.slot for run in decodes],
                   [run.snapshot[1] if run.snapshot else None for run in decodes])] if decodes else []
        pieces += [([*range(rows.start, rows.stop)], [run.slot], [snapshot])
                   for run in runs if run.length > 1 for rows, snapshot in _pieces(run)]
        for rows, slots, snapshots in pieces:
            # a decode batch: [sequences, 1 token]; a prompt's piece: [1 sequence, tokens]
            shape = (len(slots), len(rows) // len(slots))
            index, at = torch.tensor(rows, device=x.device), torch.tensor(slots, device=x.device)
            conv, rule = conv_state[at], rule_state[at]
            mixed_rows = F.silu(causal_conv(mixed[index].view(*shape, -1), conv, self.conv))
            q, k, v = mixed_rows.split([key_width, key_width, value_width], -1)
            q, k = (self._heads(t.reshape(*shape, s.key_heads, s.key_dim)) for t in (q, k))
            q = F.normalize(q, dim=-1, eps=L2_EPS) * s.key_dim ** -0.5
            k = F.normalize(k, dim=-1, eps=L2_EPS)
            out = gated_delta_rule(q, k, v.reshape(*shape, s.value_heads, s.value_dim), g[index].view(*shape, -1),
                                   beta[index].view(*shape, -1), rule)
            core[index] = out.reshape(len(rows), s.value_heads, s.value_dim)
            conv_state[at], rule_state[at] = conv, rule
            for slot, snapshot in zip(slots, snapshots):
                if snapshot is not None:
                    conv_state[snapshot].copy_(conv_state[slot])
                    rule_state[snapshot].copy_(rule_state[slot])
        core = core.to(x.dtype).float()  # rounded to the activations' dtype first, as the reference does
        normed = core * torch.rsqrt(core.pow(2).mean(-1, keepdim=True) + self.eps)
        gated = (self.norm * normed.to(x.dtype)) * F.silu(z.float().view(-1, s.value_heads, s.value_dim))
        return self.out_proj(gated.to(x.dtype).view(-1, value_width))

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        """q or k heads, one per value head (each serves value_heads / key_heads of them)."""
        r = self.shape.value_heads // self.shape.key_heads
        return t if r == 1 else t.repeat(1, 1, r, 1) if self.shape.tiled else t.repeat_interleave(r, dim=2)


def _pieces(run: StateRun) -> list[tuple[slice, int | None]]:
    """A run's rows cut where its snapshot is taken: (rows, the snapshot slot after them or None)."""
    end = run.start + run.length
    if run.snapshot is None:
        return [(slice(run.start, end), None)]
    rows, slot = run.snapshot
    cut = run.start + rows
    return [(slice(run.start, cut), slot)] + ([(slice(cut, end), None)] if cut < end else [])


MIXERS: dict[Mixer, type] = {Mixer.LINEAR_ATTENTION: GatedDeltaNet}  # each recurrent kind's class
