"""Granite 4 (GraniteMoeHybrid): Mamba2 state-space layers (a state per sequence instead of KV: recurrent.py)
between attention layers, which turn q and k by RoPE only where position_embedding_type says "rope" (the
hybrids' have no position embeddings). Its MLP is routed experts (a softmax over the top k) plus a shared MLP
added as it is, or the shared MLP alone; the embedding, the attention scores, each residual branch and the
logits are scaled by its multipliers. Its checkpoints hold each layer's experts stacked, gate and up as one."""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

import torch

from zhuzi.model.families.base import LAYER_NAME
from zhuzi.model.families.sparse import SparseFamily
from zhuzi.model.gguf_header import GGUFHeader
from zhuzi.model.model_config import LayerSpec, Mamba2Shape, Mixer, ModelConfig

MAMBA_PARTS = ("in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight",
               "out_proj.weight")
# transformers' layer types (and the names of the Hub's config.json files) -> the decoder's mixers
HF_MIXERS = {"mamba": Mixer.MAMBA2, "linear_attention": Mixer.MAMBA2, "attention": Mixer.ATTENTION,
             "full_attention": Mixer.ATTENTION}
# The decoder's MLP modules (under a layer) -> the checkpoint's tensor holding them: gate and up are the first
# and second half of each input_linear's rows, the experts' stacked [experts, rows, columns]
HF_MLP = {"mlp.gate": "block_sparse_moe.router.layer", "mlp.experts.gate_proj": "block_sparse_moe.input_linear",
          "mlp.experts.up_proj": "block_sparse_moe.input_linear",
          "mlp.experts.down_proj": "block_sparse_moe.output_linear",
          "mlp.shared_expert.gate_proj": "shared_mlp.input_linear",
          "mlp.shared_expert.up_proj": "shared_mlp.input_linear",
          "mlp.shared_expert.down_proj": "shared_mlp.output_linear", "mlp.gate_proj": "shared_mlp.input_linear",
          "mlp.up_proj": "shared_mlp.input_linear", "mlp.down_proj": "shared_mlp.output_linear"}
# llama.cpp's names of a Mamba2 layer's tensors -> transformers' (under mamba.)
GGUF_MAMBA_NAMES = {"ssm_in.weight": "in_proj.weight", "ssm_conv1d.weight": "conv1d.weight",
                    "ssm_conv1d.bias": "conv1d.bias", "ssm_dt.bias": "dt_bias", "ssm_a": "A_log", "ssm_d": "D",
                    "ssm_norm.weight": "norm.weight", "ssm_out.weight": "out_proj.weight"}


@dataclass(frozen=True)
class GraniteHybrid(SparseFamily):
    def hf_fields(self, raw: dict[str, Any], config: ModelConfig) -> dict[str, Any]:
        """From transformers' GraniteMoeHybridConfig (its defaults where the file leaves a key out)."""
        if raw.get("mamba_proj_bias") or not raw.get("mamba_conv_bias", True):
            raise ValueError("granitemoehybrid with a bias on the Mamba projections, or none on its convolution, "
                             "is not supported")
        heads, inner = raw.get("mamba_n_heads", 128), raw.get("mamba_expand", 2) * raw["hidden_size"]
        head_dim = raw.get("mamba_d_head", "auto")
        mamba = Mamba2Shape(heads, inner // heads if head_dim == "auto" else head_dim, raw.get("mamba_n_groups", 1),
                            raw.get("mamba_d_state", 256), raw.get("mamba_d_conv", 4))
        types = raw.get("layer_types") or raw.get("layers_block_type") or ["mamba"] * config.num_layers
        shared = raw.get("shared_intermediate_size", 1024)
        return super().hf_fields(raw, config) | self._granite(
            mamba, [HF_MIXERS[kind].value for kind in types], shared,
            use_rope=raw.get("position_embedding_type") == "rope",
            scales=[raw.get(f"{n}_multiplier", 1.0) for n in ("embedding", "attention", "residual")],
            logit_scale=raw.get("logits_scaling", 1.0))

    def gguf_fields(self, header: GGUFHeader, config: ModelConfig) -> dict[str, Any]:
        """As llama.cpp's converter writes them: the Mamba2 heads as ssm.* keys, the multipliers as scales, RoPE
        only where rope.scaling.finetuned is set. Its KV head count is a value per layer (0 for a Mamba2 layer),
        which the header reads as a length: a layer's kind is read off its tensors, the KV heads off attn_k's."""
        meta, arch = header.metadata, self.gguf_arch
        heads = meta[f"{arch}.ssm.time_step_rank"]
        mamba = Mamba2Shape(heads, meta[f"{arch}.ssm.inner_size"] // heads, meta[f"{arch}.ssm.group_count"],
                            meta[f"{arch}.ssm.state_size"], meta[f"{arch}.ssm.conv_kernel"])
        types = [(Mixer.MAMBA2 if header.has(f"blk.{i}.ssm_in.weight") else Mixer.ATTENTION).value
                 for i in range(config.num_layers)]
        keys = next((t for t in header.tensors if re.fullmatch(r"blk\.\d+\.attn_k\.weight", t.name)), None)
        kv_heads = keys.shape[0] // config.head_dim if keys else config.num_heads
        shared = meta.get(f"{arch}.expert_shared_feed_forward_length", config.intermediate_size)
        return super().gguf_fields(header, config) | dict(num_kv_heads=kv_heads) | self._granite(
            mamba, types, shared, use_rope=bool(meta.get(f"{arch}.rope.scaling.finetuned", False)),
            scales=[meta.get(f"{arch}.{key}", 1.0) for key in ("embedding_scale", "attention.scale", "residual_scale")],
            logit_scale=meta.get(f"{arch}.logit_scale", 1.0))

    @staticmethod
    def _granite(mamba: Mamba2Shape, types: list[str], shared: int, use_rope: bool, scales: list[float],
                 logit_scale: float) -> dict[str, Any]:
        """The fields both mappings set: the shared MLP is the dense MLP (intermediate_size) of a model without
        experts and the shared expert of one with them; attention scores scale by attention_multiplier."""
        embedding, attention, residual = scales
        return dict(mamba=mamba, layer_types=types, sliding_window=None, use_rope=use_rope, intermediate_size=shared,
                    shared_expert_intermediate_size=shared, shared_expert_gate=False, embedding_scale=embedding,
                    query_pre_attn_scalar=attention ** -2, residual_scale=residual, logit_scale=logit_scale)

    def layer(self, config: ModelConfig, i: int) -> LayerSpec:
        return replace(super().layer(config, i), mixer=Mixer(config.layer_types[i]))

    def recurrent_tensor_names(self, layer: str, spec: LayerSpec) -> list[str]:
        return [f"{layer}mamba.{p}" for p in MAMBA_PARTS]

    def tensor_names(self, config: ModelConfig, per_expert: bool = False) -> list[str]:
        """The decoder's names (as a GGUF file holds them); with per_expert, the Hugging Face directory's, whose
        MLP tensors hold several of the decoder's (HF_MLP)."""
        names = super().tensor_names(config)
        return list(dict.fromkeys(map(_hf_name, names))) if per_expert else names

    def from_hf(self, tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
        """Each MLP module's matrix of its checkpoint tensor: gate and up its halves, experts one after another."""
        out = {}
        for name in super().tensor_names(config):
            w = tensors[_hf_name(name)]
            if name.endswith(("gate_proj.weight", "up_proj.weight")):
                w = w.chunk(2, -2)[0 if name.endswith("gate_proj.weight") else 1]
            out[name] = w.reshape(-1, w.shape[-1]) if ".experts." in name else w
        return out

    def gguf_tensor_name(self, gguf_name: str) -> str | None:
        m = re.fullmatch(r"blk\.(\d+)\.(ssm_\w+(?:\.weight|\.bias)?)", gguf_name)
        if m and m[2] in GGUF_MAMBA_NAMES:
            return f"model.layers.{m[1]}.mamba.{GGUF_MAMBA_NAMES[m[2]]}"
        return super().gguf_tensor_name(gguf_name)

    def from_gguf(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """llama.cpp's converter stores A_log as -exp(A_log), A and D as columns, the norm's weight as a row per
        group and the convolution squeezed: back to transformers' form."""
        if name.endswith("A_log"):
            return torch.log(-tensor.float()).flatten()
        if name.endswith((".D", "mamba.norm.weight")):
            return tensor.flatten()
        if name.endswith("mamba.conv1d.weight"):
            return tensor[:, None, :]
        return tensor


def _hf_name(name: str) -> str:
    """A decoder tensor's name -> the name of the Hugging Face checkpoint's tensor that holds it."""
    m = LAYER_NAME.fullmatch(name)
    return f"{m[1]}.{HF_MLP[m[2]]}.{m[3]}" if m and m[2] in HF_MLP else name


FAMILY = GraniteHybrid("granitemoehybrid", "GraniteMoeHybridForCausalLM", "granitehybrid", gguf_permuted_qk=True,
                       expert_width_key="intermediate_size", normalizes_top_k=True)
