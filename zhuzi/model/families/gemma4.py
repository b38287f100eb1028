"""Gemma 4 (text): Gemma 3's layer (scaled embeddings, sandwich norms, GELU-tanh, q/k norms, local sliding
layers between global ones) with plain-weight norms, V normed without a scale, attention unscaled, each layer's
output scaled by a weight of its own; global layers with their own head size (and KV heads where V is K's
projection) and a proportional RoPE over part of each head; on the small shapes (E2B, E4B), per-layer
embeddings and last layers that attend earlier layers' K/V; on 26B-A4B, routed experts beside each layer's
MLP. A multimodal checkpoint's text part loads alone."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from zhuzi.model.families.base import Family, hf_rope
from zhuzi.model.gguf_header import GGUFHeader
from zhuzi.model.model_config import ModelConfig

PATTERN = 6  # a global layer every sixth (transformers' default)
# transformers' Gemma4TextConfig defaults, which the Hub's files may leave out
GLOBAL_HEAD_DIM = 512
PER_LAYER_INPUT_SIZE = 256
PER_LAYER_VOCAB_SIZE = 262_144
SLIDING_WINDOW = 512
ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
UNROTATED = 1e30  # llama.cpp's frequency factor of the dims proportional RoPE leaves unturned
# A GGUF file names one end of generation; Gemma 4's vocabulary ends a reply at <eos>, <turn|> or <|tool_response>
# (its generation_config.json's ids, which transformers adds to a Gemma 4 GGUF's config the same way)
END_IDS = [1, 106, 50]


def _shape(hidden: int) -> dict[str, Any]:
    """What every Gemma 4 has, whatever the file says."""
    return dict(embedding_scale=hidden ** 0.5, norm_weight_offset=0.0, sandwich_norms=True,
                hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=1.0, value_norm=True, layer_scalar=True)


# A sparse layer's tensors as transformers names them -> as the decoder does: the router, its input scale and its
# factor per expert, the experts (stacked, [experts, rows, columns]) under the layer, not its MLP
HF_EXPERTS = {"router.proj.weight": "mlp.gate.weight", "router.scale": "mlp.gate.scale",
              "router.per_expert_scale": "mlp.expert_scale", "experts.gate_up_proj": "mlp.experts.gate_up_proj.weight",
              "experts.down_proj": "mlp.experts.down_proj.weight"}
EXPERT_NORMS = ("pre_feedforward_layernorm_2", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2")


def _experts(experts: int, per_token: int, width: int, gate_up: bool = True) -> dict[str, Any]:
    """Gemma 4's experts in every layer, beside its MLP: a softmax router over the input normed, its top-k
    renormalized, then scaled per expert. gate_up: each expert's gate and up stored as one matrix."""
    return dict(num_experts=experts, num_experts_per_tok=per_token, moe_intermediate_size=width,
                norm_topk_prob=True, dense_beside_experts=True, router_input_norm=True, expert_scale=True,
                experts_gate_up=gate_up)


def _check_sharing(types: list[str], shared: int) -> None:
    """transformers' rule: every kind of layer that shares K/V has a layer of its kind before the shared ones."""
    if shared and set(types[:len(types) - shared]) != set(types):
        raise ValueError("gemma4: a kind of layer sharing K/V has no earlier layer of its kind to share")


def _hf_global_shape(raw: dict[str, Any], types: list[str], k_eq_v: bool) -> tuple[int, int | None]:
    """(head size, KV heads or None: the sliding layers') of the global layers: the Hub's global_head_dim and
    num_global_key_value_heads (the latter where V is K's), or as transformers 5 saves them, per layer."""
    if "per_layer_config" not in raw:
        return raw.get("global_head_dim", GLOBAL_HEAD_DIM), raw.get("num_global_key_value_heads") if k_eq_v else None
    overrides = {int(i): dict(o) for i, o in raw["per_layer_config"].items()}
    kinds = {t: [overrides.get(i, {}) for i, kind in enumerate(types) if kind == t] for t in set(types)}
    if any(kinds.get("sliding_attention", [])) or any(o != kinds["full_attention"][0] for o in kinds["full_attention"]):
        raise ValueError("gemma4 with per-layer shapes other than one of the global layers is not supported")
    shape = kinds["full_attention"][0]
    return shape.get("head_dim", raw["head_dim"]), shape.get("num_key_value_heads")


@dataclass(frozen=True)
class Gemma4(Family):
    def hf_fields(self, raw: dict[str, Any], config: ModelConfig) -> dict[str, Any]:
        """From transformers' Gemma4TextConfig (its defaults where the file leaves a key out)."""
        activation = raw.get("hidden_activation") or "gelu_pytorch_tanh"
        # "vision": image tokens attend each other both ways; text alone is causal, as here
        bidirectional = raw.get("use_bidirectional_attention")
        refused = {"use_bidirectional_attention": None if bidirectional in (None, "vision") else bidirectional,
                   "hidden_activation": None if activation == "gelu_pytorch_tanh" else activation}
        if clash := [f"{key}={value}" for key, value in refused.items() if value]:
            raise ValueError(f"gemma4 with {', '.join(clash)} is not supported")
        params = raw.get("rope_parameters") or ROPE
        theta, scaling = hf_rope({"rope_parameters": params["full_attention"]})
        local_theta, local_scaling = hf_rope({"rope_parameters": params["sliding_attention"]})
        if local_scaling is not None:
            raise ValueError(f"gemma4 with sliding layers' RoPE {local_scaling} is not supported")
        types = list(raw.get("layer_types") or [
            "sliding_attention" if (i + 1) % PATTERN else "full_attention" for i in range(config.num_layers)])
        types[-1] = "full_attention"  # transformers forces it
        shared = raw.get("num_kv_shared_layers", 0)
        _check_sharing(types, shared)
        k_eq_v = bool(raw.get("attention_k_eq_v"))
        global_head_dim, global_kv_heads = _hf_global_shape(raw, types, k_eq_v)
        per_layer = raw.get("hidden_size_per_layer_input", PER_LAYER_INPUT_SIZE) or 0
        per_layer_vocab = raw.get("vocab_size_per_layer_input", PER_LAYER_VOCAB_SIZE) if per_layer else 0
        experts = _experts(raw["num_experts"], raw["top_k_experts"], raw["moe_intermediate_size"]) \
            if raw.get("enable_moe_block") else {}
        return dict(rope_theta=theta, rope_scaling=scaling, rope_local_theta=local_theta,
                    sliding_window=raw.get("sliding_window", SLIDING_WINDOW), layer_types=types,
                    tie_word_embeddings=raw.get("tie_word_embeddings", True),
                    max_position_embeddings=raw.get("max_position_embeddings", 131_072),
                    final_logit_softcapping=raw.get("final_logit_softcapping"),
                    global_head_dim=global_head_dim, num_global_kv_heads=global_kv_heads,
                    global_values_are_keys=k_eq_v, num_kv_shared_layers=shared,
                    per_layer_input_size=per_layer, per_layer_vocab_size=per_layer_vocab,
                    **_shape(raw["hidden_size"]), **experts)

    def gguf_fields(self, header: GGUFHeader, config: ModelConfig) -> dict[str, Any]:
        """As llama.cpp's converter writes them: the global layers' head size as key_length (the sliding
        layers' as key_length_swa), KV heads and MLP widths per layer where they differ, and proportional RoPE
        as frequency factors (rope_freqs: 1 for the dims that turn, 1e30 for the others). The experts' gate and
        up are one matrix (ffn_gate_up_exps) as today's converter writes them, or two (ffn_gate_exps,
        ffn_up_exps) as other writers do: llama.cpp reads both."""
        meta, arch = header.metadata, self.gguf_arch
        types = config.layer_types or []
        head_dim, global_head_dim = meta[f"{arch}.attention.key_length_swa"], meta[f"{arch}.attention.key_length"]
        if meta.get(f"{arch}.rope.dimension_count_swa", head_dim) != head_dim:
            raise ValueError("gemma4 with RoPE over part of the sliding layers' heads is not supported")
        kv_heads = meta.get(f"{arch}.attention.head_count_kv", config.num_heads)
        per_type = dict(zip(types, kv_heads)) if isinstance(kv_heads, list) else {}
        widths = meta[f"{arch}.feed_forward_length"]
        shared = meta.get(f"{arch}.attention.shared_kv_layers", 0)
        _check_sharing(types, shared)
        # V is K's projection where the global layers (those writing K/V) have no V weights
        writing = [i for i, t in enumerate(types[:len(types) - shared]) if t == "full_attention"]
        k_eq_v = bool(writing) and not any(header.has(f"blk.{i}.attn_v.weight") for i in writing)
        per_layer = meta.get(f"{arch}.embedding_length_per_layer_input", 0)
        embed = next((t for t in header.tensors if t.name == "per_layer_token_embd.weight"), None)
        gate_up = any(re.fullmatch(r"blk\.\d+\.ffn_gate_up_exps\.weight", t.name) for t in header.tensors)
        experts = _experts(meta[f"{arch}.expert_count"], meta[f"{arch}.expert_used_count"],
                           meta[f"{arch}.expert_feed_forward_length"], gate_up) \
            if meta.get(f"{arch}.expert_count") else {}
        return dict(head_dim=head_dim, global_head_dim=global_head_dim, rotary_dim=None,
                    num_kv_heads=per_type.get("sliding_attention", kv_heads),
                    num_global_kv_heads=per_type.get("full_attention") if k_eq_v else None,
                    global_values_are_keys=k_eq_v,
                    intermediate_size=widths[0] if isinstance(widths, list) else widths,
                    rope_local_theta=meta.get(f"{arch}.rope.freq_base_swa", 10_000.0),
                    rope_scaling=_proportional(header.vector("rope_freqs.weight")) if header.has("rope_freqs.weight")
                    else None,
                    num_kv_shared_layers=shared, per_layer_input_size=per_layer,
                    per_layer_vocab_size=embed.shape[0] if embed and per_layer else 0,
                    final_logit_softcapping=meta.get(f"{arch}.final_logit_softcapping"),
                    eos_token_ids=list(dict.fromkeys(config.eos_token_ids + END_IDS)), **_shape(config.hidden_size),
                    **experts)

    def tensor_names(self, config: ModelConfig, per_expert: bool = False) -> list[str]:
        """A directory's experts are stacked, as a GGUF file's."""
        names = super().tensor_names(config)
        if config.per_layer_input_size:
            names += ["model.embed_tokens_per_layer.weight", "model.per_layer_model_projection.weight",
                      "model.per_layer_projection_norm.weight"]
            names += [f"model.layers.{i}.{part}.weight" for i in range(config.num_layers)
                      for part in ("per_layer_input_gate", "per_layer_projection", "post_per_layer_input_norm")]
        names += [f"model.layers.{i}.{norm}.weight" for i in filter(config.is_moe_layer, range(config.num_layers))
                  for norm in EXPERT_NORMS]
        return names + [f"model.layers.{i}.layer_scalar" for i in range(config.num_layers)]

    def hf_tensor_name(self, stored: str) -> str:
        """A sparse layer's router and experts under its MLP's names (HF_EXPERTS)."""
        name = super().hf_tensor_name(stored)
        m = re.fullmatch(r"(model\.layers\.\d+)\.(.+)", name)
        return f"{m[1]}.{HF_EXPERTS[m[2]]}" if m and m[2] in HF_EXPERTS else name

    def from_hf(self, tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
        """Each sparse layer's experts stacked as one [experts * rows, columns] matrix per part."""
        return {name: t.flatten(0, 1) if ".mlp.experts." in name else t for name, t in tensors.items()}

    def gguf_tensor_name(self, gguf_name: str) -> str | None:
        """The layer's output scale is a buffer in transformers, without '.weight'; the router's factor per expert
        is the experts' down scale there (llama.cpp scales each expert's output by it: the same)."""
        if m := re.fullmatch(r"blk\.(\d+)\.layer_output_scale\.weight", gguf_name):
            return f"model.layers.{m[1]}.layer_scalar"
        if m := re.fullmatch(r"blk\.(\d+)\.ffn_down_exps\.scale", gguf_name):
            return f"model.layers.{m[1]}.mlp.expert_scale"
        return super().gguf_tensor_name(gguf_name)


def _proportional(factors: list[float]) -> dict[str, Any]:
    """transformers' proportional RoPE of llama.cpp's frequency factors: the first dims turn, the rest not."""
    turning = sum(f == 1.0 for f in factors)
    if factors[:turning] != [1.0] * turning or min(factors[turning:], default=UNROTATED) < UNROTATED / 2:
        raise ValueError("gemma4 with RoPE frequency factors other than proportional RoPE's is not supported")
    return {"rope_type": "proportional", "partial_rotary_factor": turning / len(factors)}


FAMILY = Gemma4("gemma4", "Gemma4ForCausalLM", "gemma4", qk_norm=True,
                hf_multimodal_class="Gemma4ForConditionalGeneration",
                gguf_names={"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                            "post_ffw_norm": "post_feedforward_layernorm", "pre_ffw_norm_2": EXPERT_NORMS[0],
                            "post_ffw_norm_1": EXPERT_NORMS[1], "post_ffw_norm_2": EXPERT_NORMS[2],
                            "inp_gate": "per_layer_input_gate",
                            "proj": "per_layer_projection", "post_norm": "post_per_layer_input_norm"},
                gguf_top_names={"per_layer_token_embd": "model.embed_tokens_per_layer",
                                "per_layer_model_proj": "model.per_layer_model_projection",
                                "per_layer_proj_norm": "model.per_layer_projection_norm"})
