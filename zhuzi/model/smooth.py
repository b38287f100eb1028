"""Activation smoothing for int8 compute (model loading, quantization="int8"): SmoothQuant's migration of
activation outliers into the weights, calibrated once at load on a short fixed chat. Input channel j is
divided by s_j = sqrt(max |x_j| / max |W_j|) and weight column j multiplied by it; the divisions are folded
into what produces each input (norm weights, up rows, V rows), so they cost nothing at run time."""
from __future__ import annotations

import torch

from zhuzi.model.attention import AttentionMetadata, PrefillChunk
from zhuzi.model.kv_pool import KVPool
from zhuzi.model.linear import Linear

ALPHA = 0.5  # how much of an input channel's range moves into the weights


class _Recorder:
    """Stands in for a layer during calibration: the largest |x| each input channel saw."""

    def __init__(self, linear: Linear):
        self.linear, self.amax = linear, None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        seen = x.reshape(-1, x.shape[-1]).float().abs().amax(0)
        self.amax = seen if self.amax is None else torch.maximum(self.amax, seen)
        return self.linear(x)


PARTS = ("qkv", "o", "gate_up", "down")


def input_maxima(decoder, ids: list[int]) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
    """Per layer and matrix, max |x_j| of each input channel over one prefill of ids; and the LM head's."""
    n = len(ids)
    recorders = [{part: _Recorder(getattr(layer, part)) for part in PARTS} for layer in decoder.layers]
    for layer, parts in zip(decoder.layers, recorders):
        for part, recorder in parts.items():
            setattr(layer, part, recorder)
    kv = KVPool.zeros(decoder.kv_shape, n, decoder.kv_dtype, decoder.embed.device)
    slots = torch.arange(n, device=decoder.embed.device)
    meta = AttentionMetadata(slots, 0, slots[:0], slots[:0], [PrefillChunk(0, n, n, slots)])
    try:
        with torch.inference_mode():
            hidden = decoder.forward(torch.tensor(ids, device=slots.device), slots, meta, kv)
    finally:
        for layer, parts in zip(decoder.layers, recorders):
            for part, recorder in parts.items():
                setattr(layer, part, recorder.linear)
    return [{part: r.amax for part, r in parts.items()} for parts in recorders], hidden.float().abs().amax(0)


def _column_maxima(weight: torch.Tensor) -> torch.Tensor:
    return weight.abs().amax(0).float()  # exact in the weight's own dtype


def _factors(amax: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return amax.clamp(min=1e-5) ** ALPHA / _column_maxima(weight).clamp(min=1e-5) ** (1 - ALPHA)


def _divided(norm: torch.Tensor, s: torch.Tensor, offset: float | None) -> torch.Tensor:
    """A norm weight whose outputs come out divided by s: Gemma's norm scales by (offset + w), not by w."""
    offset = offset or 0.0
    return ((offset + norm.float()) / s - offset).to(norm.dtype)


def smooth(decoder, ids: list[int]) -> None:
    """Fold smoothing factors calibrated on ids into the decoder's dense layers and norm weights (new
    tensors; float32 weights, to be quantized next)."""
    c = decoder.config
    maxima, head_amax = input_maxima(decoder, ids)
    q_per_kv, d = c.num_heads // c.num_kv_heads, c.head_dim
    for layer, amax in zip(decoder.layers, maxima):
        s_qkv, s_gu = _factors(amax["qkv"], layer.qkv.weight), _factors(amax["gate_up"], layer.gate_up.weight)
        s_down = _factors(amax["down"], layer.down.weight)
        # O's inputs come from V rows: a kv head's channel serves `q_per_kv` query heads, so they share a factor.
        o_amax = amax["o"].view(c.num_kv_heads, q_per_kv, d).amax(1)
        o_wmax = _column_maxima(layer.o.weight).view(c.num_kv_heads, q_per_kv, d).amax(1)
        s_v = (o_amax.clamp(min=1e-5) ** ALPHA / o_wmax.clamp(min=1e-5) ** (1 - ALPHA)).reshape(-1)
        s_o = s_v.view(c.num_kv_heads, 1, d).expand(-1, q_per_kv, -1).reshape(-1)

        qkv = layer.qkv.weight.float() * s_qkv
        qkv_bias = layer.qkv.bias.float().clone() if layer.qkv.bias is not None else None
        v_rows = slice(qkv.shape[0] - s_v.numel(), qkv.shape[0])
        qkv[v_rows] /= s_v[:, None]
        if qkv_bias is not None:
            qkv_bias[v_rows] /= s_v
        gate_up = layer.gate_up.weight.float() * s_gu
        gate_up[gate_up.shape[0] // 2:] /= s_down[:, None]  # the up rows make down's inputs

        dtype = layer.input_norm.dtype
        layer.input_norm = _divided(layer.input_norm, s_qkv, layer.spec.norm_offset)
        layer.post_norm = _divided(layer.post_norm, s_gu, layer.spec.norm_offset)
        layer.qkv = Linear(qkv, qkv_bias.to(dtype) if qkv_bias is not None else None)
        layer.o = Linear(layer.o.weight.float() * s_o)
        layer.gate_up = Linear(gate_up)
        layer.down = Linear(layer.down.weight.float() * s_down)
    s_head = _factors(head_amax, decoder.lm_head.weight)
    decoder.norm = _divided(decoder.norm, s_head, c.norm_weight_offset)
    decoder.lm_head = Linear(decoder.lm_head.weight.float() * s_head)
