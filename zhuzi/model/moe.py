"""A sparse layer's MLP (decoder -> Mixture-of-Experts): a router scores the experts for each token, the token
runs its top-k gated experts and sums their outputs weighted by the gate, plus a gated shared expert where
the layer has one (Gemma 4's run beside the layer's dense MLP: the decoder adds the two). Rows are grouped by
expert (each chosen expert runs one matmul, the others are not read), and a row's experts are added in expert
order, so batching changes a row's result no more than a matmul does."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zhuzi.model.layers import rms_norm_unscaled
from zhuzi.model.linear import Linear

Glu = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (gate, up) -> what the down projection takes


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def gelu_tanh_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


GLUS: dict[str, Glu] = {"silu": swiglu, "gelu_pytorch_tanh": gelu_tanh_glu}  # by the config's activation


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's experts: the gate clamped from above and up on both sides at limit, then
    (up + 1) * gate * sigmoid(alpha * gate)."""

    alpha: float
    limit: float

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def gated_mlp(gate_up: Linear, down: Linear, x: torch.Tensor, glu: Glu = swiglu) -> torch.Tensor:
    """down(glu(gate x, up x)), gate and up in one matmul: a dense layer's MLP (SwiGLU, or Gemma's GELU-tanh)
    and each expert."""
    gate, up = gate_up(x).chunk(2, -1)
    return down(glu(gate, up))


@dataclass
class Expert:
    gate_up: Linear
    down: Linear
    glu: Glu = swiglu

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return gated_mlp(self.gate_up, self.down, x, self.glu)

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes


@dataclass
class MoE:
    router: Linear  # [experts, hidden]: one logit per expert
    experts: list[Expert]
    top_k: int
    normalize: bool  # the top-k gate weights renormalized to sum to 1 (Mixtral, Qwen3-MoE; not Qwen2-MoE)
    # router logits -> scores: "softmax" over the experts, each one's "sigmoid", or "top_k_softmax": a softmax
    # over the top-k logits only (gpt-oss)
    gating: str = "softmax"
    shared: Expert | None = None
    shared_gate: Linear | None = None  # [1, hidden]: sigmoid(x . w) scales the shared expert's output (None: 1)
    selection_bias: torch.Tensor | None = None  # [experts] float32, added to the scores that pick the top-k only
    # (LFM2-MoE)
    # [hidden]: the router reads its input RMS-normed without a weight, times this and hidden ** -1/2 (Gemma 4)
    router_scale: torch.Tensor | None = None
    expert_scale: torch.Tensor | None = None  # [experts]: each expert's gate weight times its factor (Gemma 4)
    eps: float = 1e-6  # the router's RMSNorm's
    bytes_read: int = 0  # weight bytes of the last call: the router, the experts it ran, the shared expert

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """([rows, k] gate weights in x's dtype, [rows, k] expert ids) of each row's top-k experts (by score plus
        bias, weighted by score). Scores and their renormalization in float32, as transformers computes them."""
        if self.router_scale is not None:
            x = rms_norm_unscaled(x, self.eps) * self.router_scale * x.shape[-1] ** -0.5
        logits = self.router(x).float()
        if self.gating == "top_k_softmax":
            top, ids = logits.topk(self.top_k, -1)
            return top.softmax(-1).to(x.dtype), ids
        scores = logits.softmax(-1) if self.gating == "softmax" else logits.sigmoid()
        ids = (scores if self.selection_bias is None else scores + self.selection_bias).topk(self.top_k, -1).indices
        weights = scores.gather(-1, ids)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        if self.expert_scale is not None:
            weights = weights * self.expert_scale[ids]
        return weights.to(x.dtype), ids

    def __call__(self, x: torch.Tensor, routed: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output for rows x; routed: the rows the router reads where they are not x (Gemma 4's
        router reads the residual stream, its experts a norm of it)."""
        weights, ids = self.route(x if routed is None else routed)
        out = torch.zeros_like(x)
        # One stable sort groups the (row, slot) pairs by expert, rows ascending within each expert's picks.
        order = ids.flatten().argsort(stable=True)
        counts = torch.bincount(ids.flatten(), minlength=len(self.experts)).tolist()
        self.bytes_read = self.router.nbytes
        for expert, picks in zip(self.experts, order.split(counts)):
            if len(picks):
                rows = picks // self.top_k
                out.index_add_(0, rows, expert(x[rows]) * weights.flatten()[picks, None])
                self.bytes_read += expert.nbytes
        if self.shared is not None:
            shared = self.shared(x)
            out += shared if self.shared_gate is None else torch.sigmoid(self.shared_gate(x)) * shared
            self.bytes_read += self._shared_bytes
        return out

    @property
    def active_bytes(self) -> int:
        """Weight bytes one token reads: the router, its top-k experts (all experts are the same size), the
        shared expert."""
        return self.router.nbytes + self.top_k * self.experts[0].nbytes + self._shared_bytes

    @property
    def _shared_bytes(self) -> int:
        """Weight bytes of the shared expert and its gate (0 without one)."""
        return sum(m.nbytes for m in (self.shared, self.shared_gate) if m is not None)

    @property
    def mlps(self) -> list[Expert]:
        """Every SwiGLU of the layer: the routed experts, then the shared one."""
        return self.experts + ([self.shared] if self.shared is not None else [])
