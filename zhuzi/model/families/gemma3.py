"""Gemma 3 (text): embeddings scaled by sqrt(hidden), (1 + w) RMSNorms also on attention's and the MLP's
outputs, GELU-tanh, q/k norms, query_pre_attn_scalar, local sliding layers with a RoPE base of their own
between global ones, final logit soft-capping when configured."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zhuzi.model.families.base import Family, hf_rope
from zhuzi.model.gguf_header import GGUFHeader
from zhuzi.model.model_config import ModelConfig

PATTERN = 6  # a global layer every sixth (transformers' and llama.cpp's default)
# A GGUF file does not say how attention scales. llama.cpp's rule, per shape: its 27B (the Gemma 3 of 62
# layers) scales scores by (hidden / heads) ** -1/2, every other size by head_dim ** -1/2.
HIDDEN_PER_HEAD_SCALE_LAYERS = 62


def _shape(hidden: int) -> dict[str, Any]:
    """What every Gemma 3 has, whatever the file says."""
    return dict(embedding_scale=hidden ** 0.5, norm_weight_offset=1.0, sandwich_norms=True,
                hidden_act="gelu_pytorch_tanh")


def _layer_types(layers: int, pattern: int) -> list[str]:
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]


@dataclass(frozen=True)
class Gemma3(Family):
    def hf_fields(self, raw: dict[str, Any], config: ModelConfig) -> dict[str, Any]:
        """From transformers' Gemma3TextConfig (its defaults where the file leaves a key out, as the Hub's
        files do)."""
        activation = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
        refused = {"attn_logit_softcapping": raw.get("attn_logit_softcapping"),
                   "use_bidirectional_attention": raw.get("use_bidirectional_attention"),
                   "hidden_activation": None if activation == "gelu_pytorch_tanh" else activation}
        if clash := [f"{key}={value}" for key, value in refused.items() if value]:
            raise ValueError(f"gemma3 with {', '.join(clash)} is not supported")
        params = raw.get("rope_parameters") or {}
        if "full_attention" in params:  # transformers 5: a RoPE per layer type
            theta, scaling = hf_rope({"rope_parameters": params["full_attention"]})
            local_theta = (params.get("sliding_attention") or {}).get("rope_theta", 10000.0)
        else:  # the Hub's files: rope_scaling applies to the global layers only
            theta, scaling = hf_rope({"rope_theta": 1e6} | raw)
            local_theta = raw.get("rope_local_base_freq", 10000.0)
        types = raw.get("layer_types") or _layer_types(config.num_layers, raw.get("sliding_window_pattern", PATTERN))
        return dict(rope_theta=theta, rope_scaling=scaling, rope_local_theta=float(local_theta),
                    sliding_window=raw.get("sliding_window", 4096), layer_types=types,
                    tie_word_embeddings=raw.get("tie_word_embeddings", True),
                    query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
                    final_logit_softcapping=raw.get("final_logit_softcapping"), **_shape(raw["hidden_size"]))

    def gguf_fields(self, header: GGUFHeader, config: ModelConfig) -> dict[str, Any]:
        """As llama.cpp reads them: what the file does not say (the layer pattern, the local RoPE base, the
        attention scale) is fixed for the family there (llama-model.cpp), and so here."""
        meta = header.metadata
        scalar = config.hidden_size // config.num_heads if config.num_layers == HIDDEN_PER_HEAD_SCALE_LAYERS \
            else config.head_dim
        return dict(rope_local_theta=meta.get("gemma3.rope.freq_base_swa", 10000.0),
                    sliding_window=meta.get("gemma3.attention.sliding_window"),
                    layer_types=_layer_types(config.num_layers, PATTERN),
                    query_pre_attn_scalar=float(scalar),
                    final_logit_softcapping=meta.get("gemma3.final_logit_softcapping"),
                    **_shape(config.hidden_size))

    def from_gguf(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """llama.cpp's converter stores each norm as (1 + w); the decoder takes w and adds the 1 in float32,
        as transformers does."""
        return tensor.float() - 1.0 if name.endswith("norm.weight") else tensor


FAMILY = Gemma3("gemma3", "Gemma3ForCausalLM", "gemma3", qk_norm=True,
                gguf_names={"ffn_norm": "pre_feedforward_layernorm",
                            "post_attention_norm": "post_attention_layernorm",
                            "post_ffw_norm": "post_feedforward_layernorm"})
