"""gpt-oss (gpt-oss-20b, gpt-oss-120b): attention with Q/K/V/O biases and sinks (a learned logit per head in
each softmax denominator), sliding (128 tokens) and full layers in turn, YaRN RoPE; every MLP is routed experts
with biases: the top-k router logits, a softmax over them, a clamped SwiGLU. A directory stores each layer's
experts stacked, gate and up interleaved in one matrix that multiplies x from the left (transformers' layout,
MXFP4 or not); llama.cpp's converter splits them into ffn_gate_exps and ffn_up_exps rows, MXFP4 as GGUF
blocks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zhuzi.model.families.sparse import SparseFamily
from zhuzi.model.gguf_header import GGUFHeader
from zhuzi.model.model_config import ModelConfig

WINDOW = 128  # transformers' default sliding_window, and every released checkpoint's
# A directory's expert tensors as transformers stores them, under each sparse layer's mlp.experts
HF_EXPERTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def _layer_types(layers: int) -> list[str]:
    """Sliding first, then full, in turn (transformers' default; llama.cpp's swa pattern 2)."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]


def _features() -> dict[str, Any]:
    """What every gpt-oss has, whatever the file says."""
    return dict(attention_out_bias=True, attention_sinks=True, expert_bias=True, expert_gating="top_k_softmax",
                hidden_act="swiglu_clamped")


@dataclass(frozen=True)
class GptOss(SparseFamily):
    def hf_fields(self, raw: dict[str, Any], config: ModelConfig) -> dict[str, Any]:
        """transformers' GptOssConfig: its defaults where the file leaves a key out."""
        return super().hf_fields(raw, config) | _features() | dict(
            sliding_window=raw.get("sliding_window", WINDOW),
            layer_types=raw.get("layer_types") or _layer_types(config.num_layers),
            swiglu_alpha=raw.get("swiglu_alpha", 1.702), swiglu_limit=raw.get("swiglu_limit", 7.0))

    def gguf_fields(self, header: GGUFHeader, config: ModelConfig) -> dict[str, Any]:
        """As llama.cpp reads them: the layer pattern is fixed for the family (llama-model.cpp); YaRN's ramp
        (the common mapping's) has ends that are not rounded (the released config's truncate false)."""
        meta, arch = header.metadata, self.gguf_arch
        return super().gguf_fields(header, config) | _features() | dict(
            sliding_window=meta.get(f"{arch}.attention.sliding_window", WINDOW),
            layer_types=_layer_types(config.num_layers),
            rope_scaling=config.rope_scaling and config.rope_scaling | {"truncate": False})

    def tensor_names(self, config: ModelConfig, per_expert: bool = False) -> list[str]:
        """With per_expert, a directory's: each sparse layer's experts as transformers stores them."""
        names = super().tensor_names(config)
        if not per_expert:
            return names
        stacked = [n for n in names if ".mlp.experts." in n]
        layers = sorted({n.split(".mlp.")[0] for n in stacked})
        return [n for n in names if n not in stacked] + \
            [f"{layer}.mlp.experts.{part}" for layer in layers for part in HF_EXPERTS]

    def hf_tensor_name(self, stored: str) -> str:
        """The router is mlp.router there, a sink logit a parameter of its own."""
        if stored.endswith(".self_attn.sinks"):
            return stored + ".weight"
        return stored.replace(".mlp.router.", ".mlp.gate.")

    def from_hf(self, tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
        """transformers' [experts, hidden, 2 * width] gate_up (gate and up columns interleaved) and [experts, width,
        hidden] down, multiplied from the left -> the decoder's rows: gate, up and down [experts * rows, columns],
        the biases [experts, rows]."""
        for i in filter(config.is_moe_layer, range(config.num_layers)):
            mlp = f"model.layers.{i}.mlp.experts"
            gate_up, gate_up_bias = tensors.pop(f"{mlp}.gate_up_proj"), tensors.pop(f"{mlp}.gate_up_proj_bias")
            down = tensors.pop(f"{mlp}.down_proj")
            for part, columns in (("gate", slice(0, None, 2)), ("up", slice(1, None, 2))):
                tensors[f"{mlp}.{part}_proj.weight"] = gate_up[..., columns].transpose(1, 2).flatten(0, 1)
                tensors[f"{mlp}.{part}_proj.bias"] = gate_up_bias[..., columns].contiguous()
            tensors[f"{mlp}.down_proj.weight"] = down.transpose(1, 2).flatten(0, 1)
            tensors[f"{mlp}.down_proj.bias"] = tensors.pop(f"{mlp}.down_proj_bias")
        return tensors


FAMILY = GptOss("gpt_oss", "GptOssForCausalLM", "gpt-oss", qkv_bias=True, expert_width_key="intermediate_size",
                gguf_names={"attn_sinks": "self_attn.sinks", "post_attention_norm": "post_attention_layernorm"})
