"""Phi-3 (Phi-3, Phi-3.5-mini, Phi-4-mini): Q/K/V and gate/up stored merged (GGUF: attn_qkv, and ffn_up
holding gate and up), RoPE over part of each head, LongRoPE scaling, a sliding window."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zhuzi.model.families.base import Family
from zhuzi.model.gguf_header import GGUFHeader
from zhuzi.model.model_config import ModelConfig

LONG, SHORT = "rope_factors_long.weight", "rope_factors_short.weight"


@dataclass(frozen=True)
class Phi3(Family):
    def hf_fields(self, raw: dict[str, Any], config: ModelConfig) -> dict[str, Any]:
        """LongRoPE as transformers reads it: "su" and "yarn" are its older names, the original context may sit
        beside rope_scaling, and without a factor the context's stretch is the factor."""
        scaling = config.rope_scaling
        if scaling is None:
            return {}
        if not (scaling.get("short_factor") and scaling.get("long_factor")):
            raise ValueError("Phi-3's rope_scaling (LongRoPE) needs short_factor and long_factor")
        original = scaling.get("original_max_position_embeddings", raw.get("original_max_position_embeddings", 4096))
        factor = scaling.get("factor") or raw.get("max_position_embeddings", 2048) / original
        return {"rope_scaling": scaling | {"rope_type": "longrope", "original_max_position_embeddings": original,
                                           "factor": factor}}

    def gguf_fields(self, header: GGUFHeader, config: ModelConfig) -> dict[str, Any]:
        """LongRoPE as llama.cpp's converter writes it: the factors as tensors, the attention factor and the
        original context as metadata."""
        meta, arch = header.metadata, self.gguf_arch
        if not (header.has(LONG) and header.has(SHORT)):
            return {}
        original = meta[f"{arch}.rope.scaling.original_context_length"]
        return {"rope_scaling": {
            "rope_type": "longrope", "long_factor": header.vector(LONG), "short_factor": header.vector(SHORT),
            "original_max_position_embeddings": original,
            "factor": meta.get(f"{arch}.context_length", original) / original,
            "attention_factor": meta.get(f"{arch}.rope.scaling.attn_factor")}}


FAMILY = Phi3("phi3", "Phi3ForCausalLM", "phi3",
              merged={"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                      "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")},
              gguf_names={"ffn_up": "mlp.gate_up_proj"})
