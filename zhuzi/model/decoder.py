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
from zhuzi.model import cpu_attention
from zhuzi.model.attention import AttentionMetadata, paged_attention
from zhuzi.model.cpu_linear import fixed_order_available
from zhuzi.model.fused import FusedDecode
from zhuzi.model.layers import Rotary, apply_rotary, rms_norm
from zhuzi.model.linear import FORMATS, QUANTIZATIONS, Linear, make_linear
from zhuzi.model.parallel import Shard, TPGroup, head_rows
from zhuzi.model.smooth import smooth


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
                 quantization: str | None = None, max_positions: int | None = None, tp: TPGroup | None = None,
                 fused_decode: bool = True, calibration: list[int] | None = None, deterministic: bool = False):
        """calibration: token ids of a short real text; with int8, smoothing factors are calibrated on it
        (smooth.py). tp: this rank holds its slice of every layer; the fused step and the smoothing, both
        whole-model, are then off. deterministic: see _make_deterministic."""
        if quantization is not None and quantization not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {quantization!r} (supported: {', '.join(QUANTIZATIONS)})")
        if tp and quantization == "int4":  # its 32-wide blocks do not follow a rank's column split
            raise ValueError("quantization int4 does not split across tensor-parallel ranks: use int8 or none")
        self.config, self.quantization, self.tp = config, quantization, tp
        self.shard = Shard.of(config, tp.rank, tp.world_size) if tp else Shard.of(config)
        t = {k: v.to(device) for k, v in tensors.items()}
        self.dtype = t["model.embed_tokens.weight"].dtype
        self.embed = t["model.embed_tokens.weight"]
        self.norm = t["model.norm.weight"]
        vocab = self.shard.vocab
        self.lm_head = Linear(t.get("lm_head.weight", self.embed)[vocab.start:vocab.stop])
        self.layers = [self._layer(t, f"model.layers.{i}") for i in range(config.num_layers)]
        self.rotary = Rotary(config.head_dim, config.rope_theta, config.rope_scaling,
                             max_positions or config.max_position_embeddings)
        self.num_heads, self.num_kv_heads = len(self.shard.q_heads), len(self.shard.kv_heads)
        self.q_size = self.num_heads * config.head_dim
        self.kv_size = self.num_kv_heads * config.head_dim
        if quantization == "int8" and calibration and not tp:
            smooth(self, calibration)
        if quantization:
            self._quantize(*FORMATS[quantization])
        self.fused = FusedDecode.build(self) if fused_decode and not tp and not deterministic else None
        if deterministic:
            self._make_deterministic(device)

    def _make_deterministic(self, device: str) -> None:
        """Every linear through the fixed-order kernel and attention through the CPU kernel, whose per-row
        arithmetic never depends on the rows around it (batch, chunk, cached prefix); no fused step."""
        if torch.device(device).type != "cpu" or self.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"deterministic mode runs on CPU in bfloat16 or float32, not {self.dtype} on {device}")
        if self.tp is not None or self.quantization is not None:
            raise ValueError("deterministic mode runs without tensor parallelism and quantization (an all-reduce "
                             "and int8 compute sum in orders of their own)")
        if not fixed_order_available() or cpu_attention._kernel() is None:
            raise ValueError("deterministic mode needs zhuzi's CPU kernels, which could not be built here "
                             "(is a C++ compiler installed? see the log)")
        for linear in [self.lm_head] + [m for layer in self.layers for m in (layer.qkv, layer.o, layer.gate_up,
                                                                            layer.down)]:
            linear.fixed_order = True

    def _qkv(self, t: dict[str, torch.Tensor], attn: str, suffix: str) -> torch.Tensor | None:
        """This rank's rows of q, k and v, fused into one matrix (or bias)."""
        parts = [t.get(f"{attn}.{name}_proj.{suffix}") for name in "qkv"]
        if any(part is None for part in parts):
            return None
        heads = [self.shard.q_heads, self.shard.kv_heads, self.shard.kv_heads]
        return torch.cat([head_rows(w, h, self.config.head_dim) for w, h in zip(parts, heads)], 0)

    def _layer(self, t: dict[str, torch.Tensor], p: str) -> Layer:
        attn, mlp, s, d = f"{p}.self_attn", f"{p}.mlp", self.shard, self.config.head_dim
        cols = slice(s.q_heads.start * d, s.q_heads.stop * d)
        width = slice(s.mlp.start, s.mlp.stop)
        return Layer(
            input_norm=t[f"{p}.input_layernorm.weight"],
            qkv=Linear(self._qkv(t, attn, "weight"), self._qkv(t, attn, "bias")),
            q_norm=t.get(f"{attn}.q_norm.weight") if self.config.qk_norm else None,
            k_norm=t.get(f"{attn}.k_norm.weight") if self.config.qk_norm else None,
            o=Linear(t[f"{attn}.o_proj.weight"][:, cols]),
            post_norm=t[f"{p}.post_attention_layernorm.weight"],
            gate_up=Linear(torch.cat([t[f"{mlp}.gate_proj.weight"][width], t[f"{mlp}.up_proj.weight"][width]], 0)),
            down=Linear(t[f"{mlp}.down_proj.weight"][:, width]),
        )

    def _quantize(self, layer_format: str, head_format: str) -> None:
        """Store every matrix in its quantized format (linear.py picks the path that runs it)."""
        for layer in self.layers:
            for part in ("qkv", "o", "gate_up", "down"):
                dense = getattr(layer, part)
                bias = dense.bias.to(self.dtype) if dense.bias is not None else None
                setattr(layer, part, make_linear(dense.weight, bias, layer_format, self.dtype))
        self.lm_head = make_linear(self.lm_head.weight, None, head_format, self.dtype)

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
        c = self.config
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
        return self.final_norm(h)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The norm before the LM head (the logit lens reads any layer's residual stream through it)."""
        return rms_norm(h, self.norm, self.config.rms_norm_eps)

    def _sum(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel layer's output: every rank's partial sum added up."""
        return self.tp.all_reduce(partial) if self.tp else partial

    def decode_step(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                    kv_cache: torch.Tensor) -> torch.Tensor | None:
        """The logits of a step of decodes only, in one fused call (fused.py); None where that path does
        not serve the step (then forward + logits run)."""
        if self.fused is None or meta.prefills or meta.num_decode_tokens != len(input_ids):
            return None
        return self.fused(input_ids, positions, meta.decode_slots, meta.decode_lengths, kv_cache)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] float32 (with tensor parallelism every rank's vocabulary slice, gathered)."""
        logits = self.lm_head(hidden).float()
        return self.tp.gather_vocab(logits, self.config.vocab_size) if self.tp else logits
