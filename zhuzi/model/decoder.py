"""The forward pass: embedding -> N x (norm, attention over paged KV, norm, SwiGLU MLP) -> norm -> LM head.

One class serves Llama, Qwen2 (QKV bias) and Qwen3 (per-head q/k RMSNorm) through
flags in ModelConfig. Q/K/V and gate/up projections are fused into one matmul each. With a
tensor-parallel group, the decoder holds this rank's slice of each layer (parallel.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from zhuzi.config import ModelConfig
from zhuzi.model.attention import AttentionMetadata, paged_attention
from zhuzi.model.cpu_linear import small_m_linear
from zhuzi.model.layers import Rotary, apply_rotary, rms_norm
from zhuzi.model.parallel import FORWARD, LOGITS, Shard, TPGroup, head_rows, pack_step


class Linear:
    """y = x W^T + b with W kept in the compute dtype."""

    scale: torch.Tensor | None = None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight.contiguous(), bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        # Decode batches of a few rows are a weight-streaming problem: the kernel reads W at close to
        # memory speed, where torch's GEMV reaches half of it. float32 stays on torch: the reference.
        y = small_m_linear(flat, self.weight, self.scale) if x.dtype != torch.float32 else None
        if y is None:
            y = self._matmul(flat)
        elif self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], -1)

    def _matmul(self, flat: torch.Tensor) -> torch.Tensor:
        return F.linear(flat, self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.weight, self.bias, self.scale) if t is not None)


class Int8Linear(Linear):
    """Weight-only int8: one scale per output channel, quantized at load (halves decode's reads)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        w = weight.float()
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127
        self.weight = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        self.scale, self.bias = scale.to(weight.dtype), bias

    def _matmul(self, flat: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int8pack_mm(flat, self.weight, self.scale)
        return y + self.bias if self.bias is not None else y


@dataclass
class LayerTap:
    """Rows of a batch whose residual stream the forward pass keeps after every layer (the logit lens)."""

    rows: torch.Tensor  # [n] row indexes into the batch's tokens
    residuals: list[torch.Tensor] = field(default_factory=list)  # per layer: [n, hidden], filled by forward


@dataclass
class Layer:
    input_norm: torch.Tensor
    qkv: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear


class Decoder:
    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor], device: str = "cpu",
                 quantization: str | None = None, max_positions: int | None = None, tp: TPGroup | None = None):
        if quantization not in (None, "int8"):
            raise ValueError(f"unknown quantization {quantization!r} (supported: int8)")
        self.config, self.tp = config, tp
        self.shard = Shard.of(config, tp.rank, tp.world_size) if tp else Shard.of(config)
        make = Int8Linear if quantization == "int8" else Linear
        t = {k: v.to(device) for k, v in tensors.items()}
        self.dtype = t["model.embed_tokens.weight"].dtype
        self.embed = t["model.embed_tokens.weight"]
        self.norm = t["model.norm.weight"]
        vocab = self.shard.vocab
        self.lm_head = make(t.get("lm_head.weight", self.embed)[vocab.start:vocab.stop])
        self.layers = [self._layer(t, f"model.layers.{i}", make) for i in range(config.num_layers)]
        self.rotary = Rotary(config.head_dim, config.rope_theta, config.rope_scaling,
                             max_positions or config.max_position_embeddings)
        self.num_heads, self.num_kv_heads = len(self.shard.q_heads), len(self.shard.kv_heads)
        self.q_size = self.num_heads * config.head_dim
        self.kv_size = self.num_kv_heads * config.head_dim

    def _qkv(self, t: dict[str, torch.Tensor], attn: str, suffix: str) -> torch.Tensor | None:
        """This rank's rows of q, k and v, fused into one matrix (or bias)."""
        parts = [t.get(f"{attn}.{name}_proj.{suffix}") for name in "qkv"]
        if any(part is None for part in parts):
            return None
        heads = [self.shard.q_heads, self.shard.kv_heads, self.shard.kv_heads]
        return torch.cat([head_rows(w, h, self.config.head_dim) for w, h in zip(parts, heads)], 0)

    def _layer(self, t: dict[str, torch.Tensor], p: str, make: type[Linear]) -> Layer:
        attn, mlp, s, d = f"{p}.self_attn", f"{p}.mlp", self.shard, self.config.head_dim
        cols = slice(s.q_heads.start * d, s.q_heads.stop * d)
        width = slice(s.mlp.start, s.mlp.stop)
        return Layer(
            input_norm=t[f"{p}.input_layernorm.weight"],
            qkv=make(self._qkv(t, attn, "weight"), self._qkv(t, attn, "bias")),
            q_norm=t.get(f"{attn}.q_norm.weight") if self.config.qk_norm else None,
            k_norm=t.get(f"{attn}.k_norm.weight") if self.config.qk_norm else None,
            o=make(t[f"{attn}.o_proj.weight"][:, cols]),
            post_norm=t[f"{p}.post_attention_layernorm.weight"],
            gate_up=make(torch.cat([t[f"{mlp}.gate_proj.weight"][width], t[f"{mlp}.up_proj.weight"][width]], 0)),
            down=make(t[f"{mlp}.down_proj.weight"][:, width]),
        )

    @property
    def weight_bytes_per_decode_step(self) -> int:
        """Bytes of weights one decode step reads: every matrix and norm, one embedding row."""
        row = self.embed.nbytes // self.embed.shape[0]
        norms = self.norm.nbytes + sum(layer.input_norm.nbytes + layer.post_norm.nbytes for layer in self.layers)
        mats = sum(m.nbytes for layer in self.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down))
        return row + norms + mats + self.lm_head.nbytes

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor, tap: LayerTap | None = None) -> torch.Tensor:
        """input_ids, positions: [tokens]; kv_cache: [layers, 2, slots, kv_heads, head_dim]. Returns hidden states.

        With a tap, the residual stream of its rows after each layer is appended to tap.residuals."""
        c, tp = self.config, self.tp
        if tp and tp.leads:
            tp.post(FORWARD, pack_step(input_ids, positions, meta))
        cos, sin = self.rotary.tables(positions, self.dtype)
        h = self.embed[input_ids]
        for layer, cache in zip(self.layers, kv_cache):
            x = rms_norm(h, layer.input_norm, c.rms_norm_eps)
            q, k, v = layer.qkv(x).split([self.q_size, self.kv_size, self.kv_size], -1)
            q = q.view(-1, self.num_heads, c.head_dim)
            k = k.view(-1, self.num_kv_heads, c.head_dim)
            v = v.view(-1, self.num_kv_heads, c.head_dim)
            if layer.q_norm is not None:
                q, k = rms_norm(q, layer.q_norm, c.rms_norm_eps), rms_norm(k, layer.k_norm, c.rms_norm_eps)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            attn = paged_attention(q, k, v, cache[0], cache[1], meta)
            h = h + self._sum(layer.o(attn.view(-1, self.q_size)))
            x = rms_norm(h, layer.post_norm, c.rms_norm_eps)
            gate, up = layer.gate_up(x).chunk(2, -1)
            h = h + self._sum(layer.down(F.silu(gate) * up))
            if tap is not None:
                tap.residuals.append(h[tap.rows])
        if tp and tp.leads:
            tp.done()
        return rms_norm(h, self.norm, c.rms_norm_eps)

    def _sum(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel layer's output: every rank's partial sum added up."""
        return self.tp.all_reduce(partial) if self.tp else partial

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        tp = self.tp
        if not tp:
            return self.lm_head(hidden).float()
        if tp.leads:
            tp.post(LOGITS, hidden)
        logits = tp.gather_vocab(self.lm_head(hidden).float(), self.config.vocab_size)
        if tp.leads:
            tp.done()
        return logits

    def lens_logits(self, residual: torch.Tensor) -> torch.Tensor:
        """The logit lens: a layer's residual stream read out as the last one's is (final norm, LM head)."""
        return self.logits(rms_norm(residual, self.norm, self.config.rms_norm_eps))
