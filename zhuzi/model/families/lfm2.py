"""LFM2 and LFM2-MoE (Liquid AI): most layers are gated short convolutions (a few inputs of state per sequence
instead of KV: recurrent.ShortConv), the rest attention with q/k norms; the norm transformers calls
embedding_norm is the final one. LFM2-MoE's first layers are dense, the others route top-k experts by sigmoid
scores plus a bias per expert that only picks them."""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

import torch

from zhuzi.model.families.sparse import SparseFamily
from zhuzi.model.gguf_header import GGUFHeader
from zhuzi.model.model_config import LayerSpec, Mixer, ModelConfig

# transformers' names (stored -> the decoder's), replaced in order
HF_NAMES = (("model.embedding_norm.", "model.norm."), (".operator_norm.", ".input_layernorm."),
            (".ffn_norm.", ".post_attention_layernorm."), (".self_attn.out_proj.", ".self_attn.o_proj."),
            (".q_layernorm.", ".q_norm."), (".k_layernorm.", ".k_norm."), (".feed_forward.", ".mlp."),
            (".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."))
GGUF_LAYER_NAMES = {"shortconv.conv": "conv.conv", "shortconv.in_proj": "conv.in_proj",
                    "shortconv.out_proj": "conv.out_proj"}  # llama.cpp's -> transformers' (their .weight kept)


def _mlp_width(raw: dict[str, Any]) -> int:
    """The dense MLP's width as LFM2's MLP makes it of block_ff_dim (unless block_auto_adjust_ff_dim is off): two
    thirds of it, then times block_ffn_dim_multiplier rounded up to a multiple of block_multiple_of."""
    width = raw.get("block_ff_dim", raw.get("intermediate_size"))
    if not raw.get("block_auto_adjust_ff_dim", True):
        return width
    width, multiplier = int(2 * width / 3), raw.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is None:
        return width
    multiple = raw.get("block_multiple_of", 256)
    return multiple * -(-int(multiplier * width) // multiple)


@dataclass(frozen=True)
class Lfm2(SparseFamily):
    sparse: bool = False
    qk_norm: bool = True

    def hf_config(self, raw: dict[str, Any], generation: dict[str, Any]) -> ModelConfig:
        """LFM2's keys under the common ones (its older config.json's names too, as transformers reads them)."""
        n = raw["num_hidden_layers"]
        common = dict(rms_norm_eps=raw.get("norm_eps", 1e-5),
                      tie_word_embeddings=raw.get("tie_embedding", raw.get("tie_word_embeddings", True)),
                      intermediate_size=raw["intermediate_size"] if self.sparse else _mlp_width(raw))
        if self.sparse:  # transformers' defaults; its first num_dense_layers are dense
            common |= dict(mlp_only_layers=list(range(raw.get("num_dense_layers", 2))),
                           norm_topk_prob=raw.get("norm_topk_prob", True))
        if "rope_parameters" not in raw and "rope_theta" not in raw:
            common["rope_theta"] = 1e6  # transformers' default for LFM2
        if not raw.get("layer_types"):
            attention = raw.get("full_attn_idxs", range(n))
            common["layer_types"] = ["full_attention" if i in attention else Mixer.SHORT_CONV.value for i in range(n)]
        return super().hf_config(raw | common, generation)

    def hf_fields(self, raw: dict[str, Any], config: ModelConfig) -> dict[str, Any]:
        if raw.get("conv_bias"):
            raise ValueError("conv_bias is not supported for LFM2 (its released models have none)")
        if raw.get("routed_scaling_factor", 1.0) != 1.0:
            raise ValueError("routed_scaling_factor other than 1 is not supported for LFM2-MoE")
        experts = dict(expert_gating="sigmoid", selection_bias=raw.get("use_expert_bias", True)) if self.sparse else {}
        return super().hf_fields(raw, config) | experts | dict(
            layer_types=raw["layer_types"], sliding_window=None, short_conv_kernel=raw.get("conv_L_cache", 3))

    def gguf_fields(self, header: GGUFHeader, config: ModelConfig) -> dict[str, Any]:
        """As llama.cpp's converter writes them: a layer is a short convolution where the file has its
        shortconv tensors (its KV head count, a per-layer array, is 0 there); the KV heads are attn_k's rows."""
        conv = {int(m[1]) for t in header.tensors if (m := re.fullmatch(r"blk\.(\d+)\.shortconv\.in_proj\.weight",
                                                                          t.name))}
        k_rows = next((t.shape[0] for t in header.tensors if re.fullmatch(r"blk\.\d+\.attn_k\.weight", t.name)),
                      config.num_heads * config.head_dim)
        types = [Mixer.SHORT_CONV.value if i in conv else "full_attention" for i in range(config.num_layers)]
        return super().gguf_fields(header, config) | dict(
            layer_types=types, num_kv_heads=k_rows // config.head_dim,
            short_conv_kernel=header.metadata[f"{self.gguf_arch}.shortconv.l_cache"],
            selection_bias=self.sparse)

    def layer(self, config: ModelConfig, i: int) -> LayerSpec:
        spec = super().layer(config, i)
        if config.layer_types and config.layer_types[i] == Mixer.SHORT_CONV.value:
            return replace(spec, mixer=Mixer.SHORT_CONV, qk_norm=False)
        return spec

    def recurrent_tensor_names(self, layer: str, spec: LayerSpec) -> list[str]:
        return [f"{layer}conv.{p}.weight" for p in ("in_proj", "conv", "out_proj")]

    def hf_tensor_name(self, stored: str) -> str:
        for old, new in HF_NAMES:
            stored = stored.replace(old, new)
        return stored

    def gguf_tensor_name(self, gguf_name: str) -> str | None:
        """The final norm (token_embd_norm, as llama.cpp's converter names it), the convolutions, the expert
        bias (exp_probs_b.bias, a parameter of its own in transformers)."""
        if gguf_name == "token_embd_norm.weight":
            return "model.norm.weight"
        m = re.fullmatch(r"blk\.(\d+)\.(shortconv\.\w+|exp_probs_b)\.(weight|bias)", gguf_name)
        if m:
            part = f"{GGUF_LAYER_NAMES[m[2]]}.weight" if m[2] in GGUF_LAYER_NAMES else "mlp.expert_bias"
            return f"model.layers.{m[1]}.{part}"
        return super().gguf_tensor_name(gguf_name)

    def from_gguf(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The convolution as transformers holds it ([hidden, 1, kernel]; the converter squeezes it)."""
        return tensor[:, None, :] if name.endswith("conv.conv.weight") else tensor


FAMILY = Lfm2("lfm2", "Lfm2ForCausalLM", "lfm2")
MOE_FAMILY = Lfm2("lfm2_moe", "Lfm2MoeForCausalLM", "lfm2moe", sparse=True)
