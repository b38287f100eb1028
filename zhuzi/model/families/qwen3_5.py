"""Qwen3.5 / Qwen3.6, dense and MoE: three of every four layers are gated DeltaNet linear attention (a state per
sequence instead of KV: recurrent.py), the fourth full attention with q/k norms, partial RoPE and its output
gated by a sigmoid of a second half of q_proj; every RMSNorm but the DeltaNet's own scales by (1 + w). The MoE
layers route top-k experts plus a gated shared expert, as Qwen2-MoE's."""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

import torch

from zhuzi.model.families.sparse import SparseFamily
from zhuzi.model.gguf_header import GGUFHeader
from zhuzi.model.model_config import LayerSpec, LinearAttentionShape, Mixer, ModelConfig

LINEAR = "linear_attention"
PARTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
# llama.cpp's names of a DeltaNet layer's tensors -> transformers' (under linear_attn.)
GGUF_LINEAR_NAMES = {"attn_qkv": "in_proj_qkv.weight", "attn_gate": "in_proj_z.weight",
                     "ssm_beta": "in_proj_b.weight", "ssm_alpha": "in_proj_a.weight", "ssm_a": "A_log",
                     "ssm_dt": "dt_bias", "ssm_conv1d": "conv1d.weight", "ssm_norm": "norm.weight",
                     "ssm_out": "out_proj.weight"}


def _layer_types(layers: int, interval: int) -> list[str]:
    return ["full_attention" if (i + 1) % interval == 0 else LINEAR for i in range(layers)]


@dataclass(frozen=True)
class Qwen3_5(SparseFamily):
    sparse: bool = False
    gguf_tiles_values: bool = True  # llama.cpp's converter tiles the DeltaNet's value heads by key head

    def hf_fields(self, raw: dict[str, Any], config: ModelConfig) -> dict[str, Any]:
        linear = LinearAttentionShape(raw["linear_num_key_heads"], raw["linear_num_value_heads"],
                                      raw["linear_key_head_dim"], raw["linear_value_head_dim"],
                                      raw.get("linear_conv_kernel_dim", 4), tiled=False)
        types = raw.get("layer_types") or _layer_types(config.num_layers, raw.get("full_attention_interval", 4))
        rotary = config.rotary_dim or int(config.head_dim * 0.25)  # transformers' default partial_rotary_factor
        return super().hf_fields(raw, config) | self._hybrid(linear, types, rotary)

    def gguf_fields(self, header: GGUFHeader, config: ModelConfig) -> dict[str, Any]:
        """As llama.cpp's converter writes them: the DeltaNet's heads as ssm.* keys, its value heads tiled (as the
        family says), which layers are DeltaNet as flags (recurrent_layers) or else as an interval. The converter
        appends the multi-token-prediction block(s) to the layers (nextn_predict_layers): the model is those
        before them."""
        meta, arch = header.metadata, self.gguf_arch
        key_heads, value_heads = meta[f"{arch}.ssm.group_count"], meta[f"{arch}.ssm.time_step_rank"]
        linear = LinearAttentionShape(key_heads, value_heads, meta[f"{arch}.ssm.state_size"],
                                      meta[f"{arch}.ssm.inner_size"] // value_heads, meta[f"{arch}.ssm.conv_kernel"],
                                      tiled=self.gguf_tiles_values)
        layers = config.num_layers - meta.get(f"{arch}.nextn_predict_layers", 0)
        recurrent = meta.get(f"{arch}.attention.recurrent_layers")
        types = [LINEAR if r else "full_attention" for r in recurrent[:layers]] if isinstance(recurrent, list) else \
            _layer_types(layers, meta.get(f"{arch}.full_attention_interval", 4))
        return super().gguf_fields(header, config) | self._hybrid(linear, types, config.rotary_dim) | \
            dict(num_layers=layers)

    @staticmethod
    def _hybrid(linear: LinearAttentionShape, types: list[str], rotary: int | None) -> dict[str, Any]:
        return dict(linear=linear, layer_types=types, sliding_window=None, rotary_dim=rotary,
                    norm_weight_offset=1.0, qk_norm=True, attention_output_gate=True)

    def layer(self, config: ModelConfig, i: int) -> LayerSpec:
        spec = replace(super().layer(config, i), output_gate=True)
        if config.layer_types and config.layer_types[i] == LINEAR:
            return replace(spec, mixer=Mixer.LINEAR_ATTENTION, qk_norm=False, output_gate=False)
        return spec

    def recurrent_tensor_names(self, layer: str, spec: LayerSpec) -> list[str]:
        linear = f"{layer}linear_attn."
        return [f"{linear}{p}.weight" for p in PARTS] + \
            [f"{linear}{p}" for p in ("A_log", "dt_bias", "conv1d.weight", "norm.weight")]

    def gguf_tensor_name(self, gguf_name: str) -> str | None:
        """A DeltaNet tensor's name (ssm_a and ssm_dt's bias are parameters of their own in transformers)."""
        m = re.fullmatch(r"blk\.(\d+)\.(\w+?)(\.weight|\.bias)?", gguf_name)
        if m and m[2] in GGUF_LINEAR_NAMES:
            return f"model.layers.{m[1]}.linear_attn.{GGUF_LINEAR_NAMES[m[2]]}"
        return super().gguf_tensor_name(gguf_name)

    def from_gguf(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """llama.cpp's converter stores each (1 + w) norm as 1 + w, A_log as -exp(A_log) and the convolution
        squeezed: back to transformers' form."""
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            return tensor.float() - 1.0
        if name.endswith("A_log"):
            return torch.log(-tensor.float())
        if name.endswith("conv1d.weight"):
            return tensor[:, None, :]
        return tensor


GGUF_NAMES = {"post_attention_norm": "post_attention_layernorm"}  # the norm before the MLP
FAMILY = Qwen3_5("qwen3_5", "Qwen3_5ForCausalLM", "qwen35", hf_multimodal_class="Qwen3_5ForConditionalGeneration",
                 gguf_names=GGUF_NAMES)
MOE_FAMILY = Qwen3_5("qwen3_5_moe", "Qwen3_5MoeForCausalLM", "qwen35moe", sparse=True, normalizes_top_k=True,
                     hf_multimodal_class="Qwen3_5MoeForConditionalGeneration", gguf_names=GGUF_NAMES)
