"""What the Mixture-of-Experts families share: their experts' config, from config.json and from GGUF
metadata (a sparse family's file, or a dense one's when it names no experts, runs dense layers)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from zhuzi.model.families.base import Family
from zhuzi.model.gguf_header import GGUFHeader
from zhuzi.model.model_config import ModelConfig

GGUF_GATING = {1: "softmax", 2: "sigmoid", 3: "top_k_softmax"}  # llama.cpp's expert_gating_func


@dataclass(frozen=True)
class SparseFamily(Family):
    sparse: bool = True
    expert_width_key: str = "moe_intermediate_size"  # config.json's key for an expert's width
    normalizes_top_k: bool | None = None  # True: always; None: as config.json's norm_topk_prob says
    gguf_normalizes_top_k: bool = True  # llama.cpp's rule where the file has no expert_weights_norm

    def hf_fields(self, raw: dict[str, Any], config: ModelConfig) -> dict[str, Any]:
        """Qwen's sparse layers are those decoder_sparse_step picks, less mlp_only_layers (transformers'
        rule); Mixtral's are all."""
        experts = raw.get("num_local_experts") or raw.get("num_experts") or 0
        if not experts:
            return {}
        n, step, dense = raw["num_hidden_layers"], raw.get("decoder_sparse_step") or 1, raw.get("mlp_only_layers") or []
        sparse = [i for i in range(n) if i not in dense and (i + 1) % step == 0]
        return dict(num_experts=experts, num_experts_per_tok=raw["num_experts_per_tok"],
                    moe_intermediate_size=raw[self.expert_width_key],
                    shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size") or 0,
                    norm_topk_prob=self.normalizes_top_k or bool(raw.get("norm_topk_prob")),
                    moe_layers=None if len(sparse) == n else sparse)

    def gguf_fields(self, header: GGUFHeader, config: ModelConfig) -> dict[str, Any]:
        """As llama.cpp runs them: the sparse layers are those with a router."""
        meta, arch = header.metadata, self.gguf_arch
        if not meta.get(f"{arch}.expert_count"):
            return {}
        routed = [int(m[1]) for t in header.tensors if (m := re.fullmatch(r"blk\.(\d+)\.ffn_gate_inp\.weight", t.name))]
        gating = GGUF_GATING.get(meta.get(f"{arch}.expert_gating_func", 1))
        if gating is None:
            raise ValueError(f"unknown expert_gating_func {meta[f'{arch}.expert_gating_func']}")
        return dict(num_experts=meta[f"{arch}.expert_count"], num_experts_per_tok=meta[f"{arch}.expert_used_count"],
                    moe_intermediate_size=meta.get(f"{arch}.expert_feed_forward_length",
                                                   meta[f"{arch}.feed_forward_length"]),
                    shared_expert_intermediate_size=meta.get(f"{arch}.expert_shared_feed_forward_length", 0),
                    norm_topk_prob=meta.get(f"{arch}.expert_weights_norm", self.gguf_normalizes_top_k),
                    expert_gating=gating, moe_layers=None if len(routed) == config.num_layers else sorted(routed))
