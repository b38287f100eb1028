"""What a family is (model loading): its names, how its config maps to ModelConfig from a Hugging Face
config.json and from GGUF metadata, and its checkpoint tensors. Family holds what most families share
(Llama's layer); a family file makes one, or a subclass where its mapping differs."""
from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from zhuzi.model.blocks import BlockWeight
from zhuzi.model.gguf_header import GGUFHeader
from zhuzi.model.layers import rope_attention_factor
from zhuzi.model.model_config import LayerSpec, Mixer, Mlp, ModelConfig, Rope

log = logging.getLogger(__name__)
Weight = torch.Tensor | BlockWeight
EXPERT_PARTS = ("gate", "up", "down")
# llama.cpp's tensor names -> Hugging Face's (a family overrides those it names otherwise: Family.gguf_names)
GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    # Mixture-of-Experts: the router, the stacked experts, the shared expert and its gate
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate", "ffn_gate_up_exps": "mlp.experts.gate_up_proj",
}
# The rows of each module weight a merged checkpoint tensor holds (Family.merged)
PART_ROWS = {"q_proj": lambda c: c.num_heads * c.head_dim, "k_proj": lambda c: c.num_kv_heads * c.head_dim,
             "v_proj": lambda c: c.num_kv_heads * c.head_dim, "gate_proj": lambda c: c.intermediate_size,
             "up_proj": lambda c: c.intermediate_size}
# llama.cpp's enum llama_pooling_type, for the kinds a decoder's hidden states allow (2 is BERT's CLS token)
GGUF_POOLING = {1: "mean", 3: "last"}
LAYER_NAME = re.compile(r"(model\.layers\.\d+)\.(.+)\.(\w+)")


@dataclass(frozen=True)
class Family:
    name: str  # ModelConfig.architecture
    hf_class: str  # config.json's architectures
    gguf_arch: str  # general.architecture as llama.cpp's converter writes it
    qkv_bias: bool = False
    qk_norm: bool = False
    gguf_permuted_qk: bool = False  # llama.cpp's converter orders Q/K rows for interleaved RoPE
    # nano-vllm's packed_modules_mapping: a merged checkpoint tensor -> the module weights it holds, rows in order
    merged: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    gguf_names: Mapping[str, str] = field(default_factory=dict)  # where llama.cpp's layer names map otherwise
    gguf_top_names: Mapping[str, str] = field(default_factory=dict)  # its tensors outside the layers, beside these
    sparse: bool = False  # its layers have experts (a GGUF with expert_count)
    hf_multimodal_class: str | None = None  # the class of its checkpoints that carry a vision tower too

    # ------------------------------------------------------------ config

    def hf_config(self, raw: dict[str, Any], generation: dict[str, Any]) -> ModelConfig:
        """config.json (and generation_config.json) -> ModelConfig; KeyError for a missing key, ValueError
        for what the family does not run. A multimodal checkpoint's text_config is the decoder's."""
        if "text_config" in raw:
            log.info("%s carries a vision tower too: loading its text model only", self.hf_multimodal_class)
            raw = raw["text_config"] | {k: v for k, v in raw.items() if k.endswith("token_id")
                                        or k == "tie_word_embeddings"}
        if raw.get("attention_bias") and not self.qkv_bias:
            raise ValueError(f"attention_bias is not supported for {self.name}")
        rope_theta, rope_scaling = hf_rope(raw)
        sliding_window, layer_types = _hf_sliding_window(raw)
        heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
        config = ModelConfig(
            architecture=self.name,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=self.qkv_bias,
            qk_norm=self.qk_norm,
            rotary_dim=_hf_rotary_dim(raw, head_dim),
            bos_token_id=(_unique([raw.get("bos_token_id"), generation.get("bos_token_id")]) or [None])[0],
            eos_token_ids=_unique(_as_list(raw.get("eos_token_id")) + _as_list(generation.get("eos_token_id"))),
            sliding_window=sliding_window,
            layer_types=layer_types,
        )
        return replace(config, **self.hf_fields(raw, config))

    def hf_fields(self, raw: dict[str, Any], config: ModelConfig) -> dict[str, Any]:
        """The family's own ModelConfig fields from config.json, over the common mapping's."""
        return {}

    def gguf_config(self, header: GGUFHeader) -> ModelConfig:
        """GGUF metadata -> ModelConfig, as llama.cpp reads it; KeyError for a missing key, ValueError for what
        the family does not run."""
        meta, arch = header.metadata, self.gguf_arch
        hidden, heads = meta[f"{arch}.embedding_length"], meta[f"{arch}.attention.head_count"]
        config = ModelConfig(
            architecture=self.name,
            vocab_size=meta.get(f"{arch}.vocab_size") or meta["tokenizer.ggml.tokens"],
            hidden_size=hidden,
            intermediate_size=meta[f"{arch}.feed_forward_length"],
            num_layers=meta[f"{arch}.block_count"],
            num_heads=heads,
            num_kv_heads=meta.get(f"{arch}.attention.head_count_kv", heads),
            head_dim=meta.get(f"{arch}.attention.key_length", hidden // heads),
            rms_norm_eps=meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
            rope_theta=meta.get(f"{arch}.rope.freq_base", 10000.0),
            rope_scaling=gguf_rope_scaling(header, arch),
            max_position_embeddings=meta.get(f"{arch}.context_length", 2048),
            tie_word_embeddings=not header.has("output.weight"),
            rope_interleaved=self.gguf_permuted_qk,
            attention_bias=self.qkv_bias,
            qk_norm=self.qk_norm,
            rotary_dim=meta.get(f"{arch}.rope.dimension_count"),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=_unique([meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")]),
            **_gguf_sliding_window(meta, arch),
            pooling=GGUF_POOLING.get(meta.get(f"{arch}.pooling_type", 0)),
        )
        return replace(config, **self.gguf_fields(header, config))

    def gguf_fields(self, header: GGUFHeader, config: ModelConfig) -> dict[str, Any]:
        """The family's own ModelConfig fields from GGUF metadata, over the common mapping's."""
        return {}

    # ------------------------------------------------------------ layers

    def layers(self, config: ModelConfig) -> list[LayerSpec]:
        """Each layer as the decoder builds it."""
        return [self.layer(config, i) for i in range(config.num_layers)]

    def layer(self, config: ModelConfig, i: int) -> LayerSpec:
        """Layer i of the config's features: a family whose layers differ in kind (another mixer, another MLP)
        overrides it."""
        c, head_dim = config, config.layer_head_dim(i)
        mixer = Mixer.SLIDING_ATTENTION if c.window(i) is not None else Mixer.ATTENTION
        rope = Rope(c.rope_local_theta, None, c.rotary_dim, c.rope_interleaved, head_dim) if c.is_local(i) \
            else Rope(c.rope_theta, c.rope_scaling, c.rotary_dim, c.rope_interleaved, head_dim)
        shared = Mlp.MOE_SHARED if c.shared_expert_gate else Mlp.MOE_SHARED_UNGATED
        sparse = Mlp.DENSE_AND_MOE if c.dense_beside_experts else shared if c.shared_expert_intermediate_size \
            else Mlp.MOE
        mlp = sparse if c.is_moe_layer(i) else Mlp.DENSE
        return LayerSpec(mixer, c.window(i), rope if c.use_rope else None, mlp, c.attention_bias, c.qk_norm,
                         c.sandwich_norms, c.norm_weight_offset, c.hidden_act,
                         c.query_pre_attn_scalar or float(head_dim), head_dim, c.layer_kv_heads(i),
                         o_bias=c.attention_out_bias, sinks=c.attention_sinks, kv_source=c.kv_source(i),
                         values_are_keys=c.global_values_are_keys and c.is_global(i), value_norm=c.value_norm)

    # ------------------------------------------------------------ tensors

    def tensor_names(self, config: ModelConfig, per_expert: bool = False) -> list[str]:
        """The decoder's tensors as the checkpoint holds them (merged ones under their stored name). A sparse
        layer's experts are stacked, [experts * rows, columns] per matrix (as a GGUF file stores them), or with
        per_expert each expert's own (as a Hugging Face directory does)."""
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not config.tie_word_embeddings:
            names.append("lm_head.weight")
        for i, spec in enumerate(self.layers(config)):
            layer = f"model.layers.{i}."
            names += [layer + "input_layernorm.weight", layer + "post_attention_layernorm.weight"]
            projections = "q" if spec.kv_source is not None else "qk" if spec.values_are_keys else "qkv"
            names += [f"{layer}self_attn.{p}_proj.weight" for p in projections + "o"] if spec.mixer.keeps_kv \
                else self.recurrent_tensor_names(layer, spec)
            names += _mlp_names(config, spec.mlp, f"{layer}mlp.", per_expert)
            if spec.qkv_bias:
                names += [f"{layer}self_attn.{p}_proj.bias" for p in projections]
            if spec.o_bias:
                names.append(f"{layer}self_attn.o_proj.bias")
            if spec.sinks:
                names.append(f"{layer}self_attn.sinks.weight")
            if spec.qk_norm:
                names += [f"{layer}self_attn.{p}_norm.weight" for p in projections[:2]]
            if spec.sandwich_norms:
                names += [layer + "pre_feedforward_layernorm.weight", layer + "post_feedforward_layernorm.weight"]
        return merged_names(names, self.merged)

    def recurrent_tensor_names(self, layer: str, spec: LayerSpec) -> list[str]:
        """A layer's mixer tensors where the mixer keeps a state instead of KV (the family's own names)."""
        raise ValueError(f"{self.name} has no {spec.mixer.value} layers")

    def split_merged(self, tensors: dict[str, Weight], config: ModelConfig, layer: str) -> dict[str, Weight]:
        """Layer `layer`'s module weights where the checkpoint merges them: row ranges (views) of the merged
        tensors, so that a tensor-parallel rank takes its rows of each part as for any family."""
        parts = {}
        for merged, names in self.merged.items():
            weight, start = tensors[f"{layer}.{merged}.weight"], 0
            for name in names:
                rows = PART_ROWS[name.rsplit(".", 1)[1]](config)
                parts[f"{layer}.{name}.weight"] = weight[start:start + rows]
                start += rows
        return tensors | parts if parts else tensors

    def hf_tensor_name(self, stored: str) -> str:
        """A safetensors name under the decoder's name for it (the same but where a family differs; a
        multimodal checkpoint's text model under the text checkpoint's names)."""
        return stored.replace("model.language_model.", "model.", 1)

    def gguf_tensor_name(self, gguf_name: str) -> str | None:
        """llama.cpp tensor name -> Hugging Face name; None for tensors the decoder does not use."""
        base, _, kind = gguf_name.rpartition(".")
        layer = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
        if layer:
            part = self.gguf_names.get(layer[2]) or GGUF_LAYER_NAMES.get(layer[2])
            return part and f"model.layers.{layer[1]}.{part}.{kind}"
        part = self.gguf_top_names.get(base) or GGUF_TOP_NAMES.get(base)
        return part and f"{part}.{kind}"

    def from_hf(self, tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
        """A Hugging Face directory's tensors (tensor_names(per_expert=True)) in the decoder's form: each sparse
        layer's per-expert matrices stacked, one [experts * rows, columns] matrix per part."""
        for i in filter(config.is_moe_layer, range(config.num_layers)):
            mlp = f"model.layers.{i}.mlp.experts"
            for p in expert_parts(config):
                tensors[f"{mlp}.{p}_proj.weight"] = torch.cat(
                    [tensors.pop(f"{mlp}.{e}.{p}_proj.weight") for e in range(config.num_experts)])
        return tensors

    def from_gguf(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A float tensor of a GGUF file in Hugging Face's form (the same but where the converter changed it)."""
        return tensor


def expert_parts(config: ModelConfig) -> tuple[str, ...]:
    """The matrices each expert is stored as."""
    return ("gate_up", "down") if config.experts_gate_up else EXPERT_PARTS


def merged_names(names: list[str], merged: Mapping[str, tuple[str, ...]]) -> list[str]:
    """Each merged tensor (a stored tensor -> the module weights it holds) where its first part's name was; its
    other parts' names go."""
    first = {parts[0]: stored for stored, parts in merged.items()}
    rest = {part for parts in merged.values() for part in parts[1:]}
    kept = []
    for name in names:
        m = LAYER_NAME.fullmatch(name)
        if m is None or m[2] not in rest:
            kept.append(f"{m[1]}.{first[m[2]]}.{m[3]}" if m and m[2] in first else name)
    return kept


def _mlp_names(config: ModelConfig, mlp_kind: Mlp, mlp: str, per_expert: bool) -> list[str]:
    dense = [f"{mlp}{p}_proj.weight" for p in EXPERT_PARTS]
    if mlp_kind is Mlp.DENSE:
        return dense
    parts = expert_parts(config)
    experts = [f"{mlp}experts.{e}.{p}_proj.weight" for e in range(config.num_experts) for p in parts] \
        if per_expert else [f"{mlp}experts.{p}_proj.weight" for p in parts]
    shared = [f"{mlp}shared_expert.{p}_proj.weight" for p in EXPERT_PARTS] \
        if mlp_kind in (Mlp.MOE_SHARED, Mlp.MOE_SHARED_UNGATED) else []
    gate = [f"{mlp}shared_expert_gate.weight"] if mlp_kind is Mlp.MOE_SHARED else []
    biases = [f"{mlp}gate.bias"] + [f"{mlp}experts.{p}_proj.bias" for p in EXPERT_PARTS] if config.expert_bias else []
    router = [mlp + name for name, has in (("gate.weight", True), ("gate.scale", config.router_input_norm),
                                           ("expert_scale", config.expert_scale),
                                           ("expert_bias", config.selection_bias)) if has]
    return router + experts + biases + shared + gate + (dense if mlp_kind is Mlp.DENSE_AND_MOE else [])


def _unique(ids: Iterable[int | None]) -> list[int]:
    return list(dict.fromkeys(i for i in ids if i is not None))


def _as_list(value: int | list[int] | None) -> list[int | None]:
    return value if isinstance(value, list) else [value]


def hf_rope(raw: dict[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either transformers 5's rope_parameters or the older keys."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.pop("rope_theta", raw.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    return float(theta), (params if kind != "default" else None)


def gguf_rope_scaling(header: GGUFHeader, arch: str) -> dict | None:
    """RoPE scaling as llama.cpp applies a GGUF's: rope.scaling.type linear (its default where the file names
    none) or yarn, by rope.scaling.factor (YaRN over the original context, its magnitude times attn_factor); and
    each frequency divided first by its factor in rope_freqs where the file has one (how llama.cpp's converter
    writes Llama 3.1's long-context RoPE). ValueError naming any other type."""
    meta = header.metadata
    kind = meta.get(f"{arch}.rope.scaling.type", "linear")
    factor = meta.get(f"{arch}.rope.scaling.factor") or meta.get(f"{arch}.rope.scale_linear") or 1.0
    if kind not in ("none", "linear", "yarn"):
        raise ValueError(f"RoPE scaling {kind!r} in a GGUF file of {arch} is not supported; use the Hugging Face "
                         "checkpoint")
    scaling: dict[str, Any] = {"rope_type": "default"}
    if kind == "linear" and factor != 1.0:
        scaling = {"rope_type": "linear", "factor": factor}
    if kind == "yarn" and factor != 1.0:
        scaling = {"rope_type": "yarn", "factor": factor,
                   "original_max_position_embeddings": meta.get(f"{arch}.rope.scaling.original_context_length")
                   or meta.get(f"{arch}.context_length"),
                   "beta_fast": meta.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0),
                   "beta_slow": meta.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)}
        if f"{arch}.rope.scaling.attn_factor" in meta:
            scaling["attention_factor"] = rope_attention_factor(scaling) * meta[f"{arch}.rope.scaling.attn_factor"]
    if header.has("rope_freqs.weight"):
        scaling["frequency_factors"] = header.vector("rope_freqs.weight")
    return scaling if scaling != {"rope_type": "default"} else None


def _hf_sliding_window(raw: dict[str, Any]) -> tuple[int | None, list[str] | None]:
    """(sliding_window, layer_types) as transformers reads them: Mistral's window applies to every layer; Qwen2/3's
    only with use_sliding_window, to the layers from max_window_layers on."""
    window = raw.get("sliding_window")
    if not raw.get("use_sliding_window", True):
        window = None
    if not window:
        return None, None
    types = raw.get("layer_types")
    if types is None and "max_window_layers" in raw:
        types = ["sliding_attention" if i >= raw["max_window_layers"] else "full_attention"
                 for i in range(raw["num_hidden_layers"])]
    return window, types


def _hf_rotary_dim(raw: dict[str, Any], head_dim: int) -> int | None:
    """The dims RoPE turns where partial_rotary_factor (in rope_parameters or beside it) leaves some unturned."""
    factor = (raw.get("rope_parameters") or {}).get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    return int(head_dim * factor) if factor != 1.0 else None


def _gguf_sliding_window(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    """The window where the file has one (llama.cpp's converter writes none for Mistral, which it writes as
    llama: such a file attends whole contexts, as llama.cpp runs it), and which layers slide (a pattern of flags)."""
    window = meta.get(f"{arch}.attention.sliding_window") or None
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    types = ["sliding_attention" if slides else "full_attention" for slides in pattern] \
        if window and isinstance(pattern, list) else None
    return {"sliding_window": window, "layer_types": types}
