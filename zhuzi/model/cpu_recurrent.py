"""The recurrent mixers' arithmetic: the causal depthwise short convolution (LFM2, Mamba2, gated DeltaNet) and the
gated delta rule (Qwen3-Next / Qwen3.5's linear attention), for decode (a token per sequence, its state slot updated
in place) and prefill (one sequence's tokens after its slot's state), through kernels/recurrent.cpp on CPU and in
torch elsewhere (the torch_* functions: same signatures, CUDA or a machine without a compiler). docs/cpu.md has
the design.

Everything is float32. Short convolution: x [B, C] (decode) or [L, C] (prefill), weight [C, K] (conv1d's [C, 1, K]
squeezed), bias [C] or None, states [slots, C, K - 1] (each channel's last K - 1 inputs, oldest first). Gated delta
rule: q, k [T, HK, DK] (q L2-normalised and scaled by DK^-1/2, k L2-normalised: the caller's), v [T, HV, DV], g (log
decay, <= 0) and beta [T, HV], states [slots, HV, DK, DV]; value head h reads key head h // (HV // HK). A decode
batch's slots are distinct (each row updates its own).
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zhuzi.model import native

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "zhuzi_conv_decode": [_P] * 6 + [_I64, _I64, _INT, _I64, _INT, _INT],
    "zhuzi_conv_prefill": [_P, _P, _I64, _P, _P, _P, _I64, _I64, _INT, _I64, _INT, _INT],
    "zhuzi_delta_decode": [_P] * 8 + [_I64] * 6 + [_INT],
    "zhuzi_delta_prefill": [_P] * 6 + [_I64, _P] + [_I64] * 6 + [_INT],
}
# A chunk of the torch prefill's gated delta rule: tokens whose updates one triangular solve folds together.
CHUNK = 64


def _entry(symbol: str):
    return native.entry("recurrent", symbol, _SIGNATURES[symbol])


def serves() -> bool:
    """Whether this process has the kernels (a variant's build, not torch; a compiler)."""
    return all(_entry(symbol) is not None for symbol in _SIGNATURES)


def _refuse(what: str, *tensors: torch.Tensor | None) -> None:
    shapes = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in tensors if t is not None)
    raise ValueError(f"the recurrent kernel does not take {what}: {shapes}")


def _check_floats(what: str, *tensors: torch.Tensor | None) -> None:
    if not all(t is None or (t.is_cpu and t.dtype == torch.float32) for t in tensors):
        _refuse(what, *tensors)


def _check_state(state: torch.Tensor, shape: tuple[int, ...]) -> None:
    """The state pool: float32 on CPU, contiguous (updated in place), of `shape` per slot."""
    if not (state.is_cpu and state.dtype == torch.float32 and state.is_contiguous() and state.shape[1:] == shape):
        raise ValueError(f"the recurrent kernel needs a contiguous float32 state of {shape} per slot, not "
                         f"{tuple(state.shape)} {state.dtype}")


def _call(symbol: str, *args) -> None:
    fn = _entry(symbol)
    if fn is None:
        raise ValueError(f"no recurrent kernels in this process (CPU kernels {native.current()})")
    status = fn(*args, torch.get_num_threads())
    if status:
        raise ValueError(f"{symbol} refused its call ({'a slot out of range' if status == 1 else 'shapes'})")


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


def _check_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> int:
    """The convolution's width K, once its tensors are checked."""
    _check_floats("convolution inputs", x, weight, bias)
    if not (x.dim() == weight.dim() == 2 and weight.shape[0] == x.shape[1] and weight.is_contiguous()
            and (bias is None or bias.shape == (x.shape[1],))):
        _refuse("these convolution shapes", x, weight, bias)
    _check_state(state, (x.shape[1], weight.shape[1] - 1))
    return weight.shape[1]


def short_conv_decode(x: torch.Tensor, state: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None = None, silu: bool = False) -> torch.Tensor:
    """One token per sequence: out [B, C], row b's history state[slots[b]] shifted by its token in place."""
    K = _check_conv(x, state, weight, bias)
    if not (slots.dtype == torch.int64 and slots.shape == (x.shape[0],)):
        _refuse("these slots", slots)
    x, slots = x.contiguous(), slots.contiguous()
    out = torch.empty_like(x)
    _call("zhuzi_conv_decode", x.data_ptr(), state.data_ptr(), slots.data_ptr(), weight.data_ptr(), _ptr(bias),
          out.data_ptr(), x.shape[0], x.shape[1], K, state.shape[0], int(silu))
    return out


def short_conv_prefill(x: torch.Tensor, state: torch.Tensor, slot: int, weight: torch.Tensor,
                       bias: torch.Tensor | None = None, silu: bool = False) -> torch.Tensor:
    """A sequence's tokens x [L, C] after the history in state[slot], which is left holding its last inputs."""
    K = _check_conv(x, state, weight, bias)
    x = x.contiguous()
    out = torch.empty_like(x)
    _call("zhuzi_conv_prefill", x.data_ptr(), state.data_ptr(), slot, weight.data_ptr(), _ptr(bias), out.data_ptr(),
          x.shape[0], x.shape[1], K, state.shape[0], int(silu))
    return out


def _check_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 state: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The inputs, contiguous, once checked."""
    _check_floats("delta rule inputs", q, k, v, g, beta)
    if not (q.dim() == k.dim() == v.dim() == 3 and q.shape == k.shape and v.shape[0] == k.shape[0]
            and k.shape[1] > 0 and v.shape[1] % k.shape[1] == 0 and g.shape == beta.shape == v.shape[:2]):
        _refuse("these delta rule shapes", q, k, v, g, beta)
    HV, DK, DV = v.shape[1], k.shape[2], v.shape[2]
    _check_state(state, (HV, DK, DV))
    return tuple(t.contiguous() for t in (q, k, v, g, beta))


def gated_delta_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One token per sequence (T = B rows): out [B, HV, DV], row b's state[slots[b]] updated in place."""
    q, k, v, g, beta = _check_delta(q, k, v, g, beta, state)
    if not (slots.dtype == torch.int64 and slots.shape == (q.shape[0],)):
        _refuse("these slots", slots)
    slots = slots.contiguous()
    out = torch.empty_like(v)
    _call("zhuzi_delta_decode", q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
          state.data_ptr(), slots.data_ptr(), out.data_ptr(), v.shape[0], k.shape[1], v.shape[1], k.shape[2],
          v.shape[2], state.shape[0])
    return out


def gated_delta_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        state: torch.Tensor, slot: int) -> torch.Tensor:
    """A sequence's L tokens after state[slot], which is left as the last token leaves it: out [L, HV, DV]. Each
    token by the operations gated_delta_decode gives it: the same bits, in one call or in chunks of any size."""
    q, k, v, g, beta = _check_delta(q, k, v, g, beta, state)
    out = torch.empty_like(v)
    _call("zhuzi_delta_prefill", q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
          state.data_ptr(), slot, out.data_ptr(), v.shape[0], k.shape[1], v.shape[1], k.shape[2], v.shape[2],
          state.shape[0])
    return out


# ---- the same operations in torch, for any device


def torch_short_conv_decode(x: torch.Tensor, state: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor | None = None, silu: bool = False) -> torch.Tensor:
    window = torch.cat([state[slots], x.unsqueeze(-1)], -1)  # [B, C, K]
    out = (window * weight).sum(-1)
    out = out + bias if bias is not None else out
    state[slots] = window[..., 1:]
    return F.silu(out) if silu else out


def torch_short_conv_prefill(x: torch.Tensor, state: torch.Tensor, slot: int, weight: torch.Tensor,
                             bias: torch.Tensor | None = None, silu: bool = False) -> torch.Tensor:
    window = torch.cat([state[slot], x.T], -1)  # [C, K - 1 + L]: the history, then the tokens
    out = F.conv1d(window.unsqueeze(0), weight.unsqueeze(1), bias, groups=x.shape[1])[0].T
    state[slot] = window[:, x.shape[0]:]
    return F.silu(out) if silu else out


def _by_value_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """q or k [T, HK, D] as [T, heads, D]: each key head serves heads // HK value heads in a row."""
    return t.repeat_interleave(heads // t.shape[1], dim=1)


def torch_gated_delta_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                             state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    q, k = _by_value_head(q, v.shape[1]), _by_value_head(k, v.shape[1])
    S = state[slots] * g.exp()[..., None, None]  # [B, HV, DK, DV]
    delta = (v - (S * k[..., None]).sum(-2)) * beta[..., None]
    S = S + k[..., None] * delta[..., None, :]
    state[slots] = S
    return (S * q[..., None]).sum(-2)


def torch_gated_delta_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                              state: torch.Tensor, slot: int) -> torch.Tensor:
    """The chunked form: within a chunk of CHUNK tokens, with G_i the decay summed from the chunk's start to token
    i and S0 the state before it, token i's update u_i (delta_i) solves (I + A) U = beta (V - e^G K S0), A[i, j] =
    beta_i e^(G_i - G_j) k_i.k_j for j < i (the earlier updates of the chunk its key reads); then o_i = e^G_i S0^T
    q_i + sum_{j <= i} e^(G_i - G_j) (q_i.k_j) u_j and the chunk leaves e^G_last S0 + sum_j e^(G_last - G_j) k_j u_j^T.
    Padding tokens (g = 0, beta = 0, k = 0) change nothing."""
    L, HV = g.shape
    pad = -L % CHUNK
    q, k = _by_value_head(q, HV), _by_value_head(k, HV)

    def chunked(t: torch.Tensor) -> torch.Tensor:  # [L, HV, ...] -> [HV, chunks, CHUNK, ...]
        t = F.pad(t.float(), (0, 0) * (t.dim() - 2) + (0, 0, 0, pad))
        return t.movedim(0, 1).unflatten(1, (-1, CHUNK))

    q, k, v = chunked(q), chunked(k), chunked(v)
    g, beta = chunked(g), chunked(beta)[..., None]  # [HV, chunks, CHUNK], [HV, chunks, CHUNK, 1]
    G = g.cumsum(-1)
    later = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=g.device).triu(1)
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(later, float("-inf")).exp()  # e^(G_i - G_j), j <= i
    A = (beta * k @ k.transpose(-1, -2) * decay).tril(-1)
    eye = torch.eye(CHUNK, dtype=A.dtype, device=A.device)
    rhs = torch.cat([beta * v, beta * G.exp()[..., None] * k], -1)
    solved = torch.linalg.solve_triangular(A + eye, rhs, upper=False, unitriangular=True)
    values, keys = solved.split([v.shape[-1], k.shape[-1]], -1)  # U = values - keys S0
    scores = q @ k.transpose(-1, -2) * decay
    q_decayed = q * G.exp()[..., None]
    k_to_end = k * (G[..., -1:] - G).exp()[..., None]
    S = state[slot]
    out = torch.empty_like(v)
    for c in range(g.shape[1]):
        u = values[:, c] - keys[:, c] @ S
        out[:, c] = q_decayed[:, c] @ S + scores[:, c] @ u
        S = S * G[:, c, -1, None, None].exp() + k_to_end[:, c].transpose(-1, -2) @ u
    state[slot] = S
    return out.flatten(1, 2)[:, :L].movedim(0, 1)


@dataclass(frozen=True)
class RecurrentOps:
    """The four operations one device runs, chosen once (ops())."""
    short_conv_decode: Callable[..., torch.Tensor]
    short_conv_prefill: Callable[..., torch.Tensor]
    gated_delta_decode: Callable[..., torch.Tensor]
    gated_delta_prefill: Callable[..., torch.Tensor]


KERNELS = RecurrentOps(short_conv_decode, short_conv_prefill, gated_delta_decode, gated_delta_prefill)
TORCH = RecurrentOps(torch_short_conv_decode, torch_short_conv_prefill, torch_gated_delta_decode,
                     torch_gated_delta_prefill)


def ops(device: torch.device) -> RecurrentOps:
    """The kernels on a CPU this process has them for, torch's operations elsewhere."""
    return KERNELS if device.type == "cpu" and serves() else TORCH
