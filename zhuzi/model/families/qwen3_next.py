"""Qwen3-Next (Qwen3-Next-80B-A3B): Qwen3.5's architecture (qwen3_5.py) a generation earlier, experts in every
layer. Only its storage differs: each DeltaNet layer holds q, k, v and z as one matrix (in_proj_qkvz) and b and a
as another (in_proj_ba), their rows interleaved per key head (each head's q, k, v, z rows, then the next head's).
llama.cpp's converter splits in_proj_qkvz into attn_qkv and attn_gate (its older one kept it, as ssm_in), keeps
in_proj_ba as ssm_ba, and leaves the value heads grouped by key head as transformers has them (it tiles
Qwen3.5's)."""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

import torch

from zhuzi.model.blocks import BlockWeight
from zhuzi.model.families.base import Weight, merged_names
from zhuzi.model.families.qwen3_5 import GGUF_NAMES, Qwen3_5
from zhuzi.model.gguf_header import GGUFHeader
from zhuzi.model.model_config import ModelConfig

QKVZ, BA = "linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba"
# The merged matrices -> Qwen3.5's matrices their rows make (in_proj_qkv: q, k, v); q, k, v, z where the
# checkpoint keeps them merged (LinearAttentionShape.merged_qkvz)
MERGED_BA = {BA: ("linear_attn.in_proj_b", "linear_attn.in_proj_a")}
MERGED_ALL = MERGED_BA | {QKVZ: ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z")}
GGUF_MERGED_NAMES = {"ssm_ba": BA, "ssm_in": QKVZ}  # llama.cpp's names of the merged matrices


@dataclass(frozen=True)
class Qwen3Next(Qwen3_5):
    sparse: bool = True
    gguf_tiles_values: bool = False

    def hf_fields(self, raw: dict[str, Any], config: ModelConfig) -> dict[str, Any]:
        """Qwen3.5's mapping; the top-k renormalized unless config.json says not (transformers' default)."""
        fields = super().hf_fields(raw, config)
        fields["linear"] = replace(fields["linear"], merged_qkvz=True)
        if fields.get("num_experts"):
            fields["norm_topk_prob"] = raw.get("norm_topk_prob", True)
        return fields

    def gguf_fields(self, header: GGUFHeader, config: ModelConfig) -> dict[str, Any]:
        """Qwen3.5's mapping; q, k, v and z merged where the older converter kept them so (ssm_in)."""
        fields = super().gguf_fields(header, config)
        merged = any(re.fullmatch(r"blk\.\d+\.ssm_in\.weight", t.name) for t in header.tensors)
        return fields | dict(linear=replace(fields["linear"], merged_qkvz=merged))

    def tensor_names(self, config: ModelConfig, per_expert: bool = False) -> list[str]:
        """b and a as one stored matrix; q, k, v and z too where the checkpoint merges them."""
        merged = MERGED_ALL if config.linear and config.linear.merged_qkvz else MERGED_BA
        return merged_names(super().tensor_names(config, per_expert), merged)

    def gguf_tensor_name(self, gguf_name: str) -> str | None:
        m = re.fullmatch(r"blk\.(\d+)\.(ssm_ba|ssm_in)\.weight", gguf_name)
        return f"model.layers.{m[1]}.{GGUF_MERGED_NAMES[m[2]]}.weight" if m else super().gguf_tensor_name(gguf_name)

    def split_merged(self, tensors: dict[str, Weight], config: ModelConfig, layer: str) -> dict[str, Weight]:
        """A DeltaNet layer's Qwen3.5 matrices of the merged ones: each part's rows of every key head, q, k and v
        one after another (copies, not views: a part's rows are not contiguous)."""
        s = config.linear
        if s is None or f"{layer}.{BA}.weight" not in tensors:  # not a DeltaNet layer
            return tensors
        per_key = s.value_heads // s.key_heads  # the value heads each key head serves
        parts = {}
        if s.merged_qkvz:
            qkvz = tensors[f"{layer}.{QKVZ}.weight"]
            q, k, v, z = _head_rows(qkvz, s.key_heads, [s.key_dim, s.key_dim] + [per_key * s.value_dim] * 2)
            parts |= {"in_proj_qkv": _take(qkvz, torch.cat([q, k, v])), "in_proj_z": _take(qkvz, z)}
        ba = tensors[f"{layer}.{BA}.weight"]
        b, a = _head_rows(ba, s.key_heads, [per_key, per_key])
        parts |= {"in_proj_b": _take(ba, b), "in_proj_a": _take(ba, a)}
        return tensors | {f"{layer}.linear_attn.{name}.weight": w for name, w in parts.items()}


def _head_rows(w: Weight, heads: int, widths: list[int]) -> list[torch.Tensor]:
    """The row indices of each part of a matrix whose rows are, per head, the parts' rows in turn."""
    return [rows.flatten() for rows in torch.arange(w.shape[0]).view(heads, -1).split(widths, 1)]


def _take(w: Weight, rows: torch.Tensor) -> Weight:
    """Those rows of a matrix (a GGUF's quantized blocks too: a row's blocks are its bytes)."""
    return BlockWeight(w.qtype, w.data[rows], w.in_features) if isinstance(w, BlockWeight) else w[rows]


FAMILY = Qwen3Next("qwen3_next", "Qwen3NextForCausalLM", "qwen3next", gguf_names=GGUF_NAMES)
