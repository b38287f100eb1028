"""The registry finds each family by its names; a family's declarations (merged tensors, GGUF rules) and the
layer specs a ModelConfig gives."""
import dataclasses
import math
from pathlib import Path

import pytest
import torch

from zhuzi.model.families import FAMILIES, family, gguf_family, hf_family
from zhuzi.model.gguf_header import GGUFHeader
from zhuzi.model.model_config import Mixer, Mlp, ModelConfig

# ModelConfig(architecture, vocab, hidden, intermediate, layers, heads, kv_heads, head_dim)
SHAPE = (100, 64, 128, 2, 4, 2, 16)


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_is_found_by_its_hugging_face_class_and_its_model_type(name):
    f = family(name)
    assert f.name == name and hf_family({"architectures": [f.hf_class]}) is f
    assert hf_family({"model_type": name}) is f
    assert hf_family({"architectures": ["GPT2LMHeadModel"], "model_type": name}) is None  # a class names it


def test_a_gguf_architecture_names_the_first_family_written_so_with_experts_where_the_file_has_them():
    assert [gguf_family("llama", sparse).name for sparse in (False, True)] == ["llama", "mixtral"]
    assert gguf_family("qwen2moe", True).name == "qwen2_moe" and gguf_family("gpt2", False) is None
    assert {f.name for f in FAMILIES.values() if gguf_family(f.gguf_arch, f.sparse) is not f} == {"mistral"}


def test_merged_tensors_are_named_as_stored_and_read_as_row_views_of_their_parts():
    config = ModelConfig("phi3", *SHAPE)
    phi3 = family("phi3")
    names = phi3.tensor_names(config)
    layer = "model.layers.1"
    assert f"{layer}.self_attn.qkv_proj.weight" in names and f"{layer}.mlp.gate_up_proj.weight" in names
    assert not [n for n in names if any(f".{p}_proj." in n for p in ("q", "k", "v", "gate", "up"))]
    qkv, gate_up = torch.randn(64 + 2 * 32, 64), torch.randn(2 * 128, 64)
    parts = phi3.split_merged({f"{layer}.self_attn.qkv_proj.weight": qkv, f"{layer}.mlp.gate_up_proj.weight": gate_up},
                          config, layer)
    rows = {"self_attn.q_proj": qkv[:64], "self_attn.k_proj": qkv[64:96], "self_attn.v_proj": qkv[96:],
            "mlp.gate_proj": gate_up[:128], "mlp.up_proj": gate_up[128:]}
    for part, expected in rows.items():
        got = parts[f"{layer}.{part}.weight"]
        assert torch.equal(got, expected) and got.untyped_storage().data_ptr() == expected.untyped_storage().data_ptr()
    assert family("llama").split_merged({"x": qkv}, config, layer) == {"x": qkv}  # nothing merged


def test_layer_specs_follow_the_config():
    config = ModelConfig("gemma3", *SHAPE[:3], 6, *SHAPE[4:], sliding_window=512, rope_local_theta=10000.0,
                         rope_theta=1e6, layer_types=["sliding_attention"] * 5 + ["full_attention"])
    gemma3 = family("gemma3")
    specs = gemma3.layers(config)
    assert [s.mixer for s in specs] == [Mixer.SLIDING_ATTENTION] * 5 + [Mixer.ATTENTION]
    assert [s.window for s in specs] == [512] * 5 + [None]
    assert [s.rope.theta for s in specs] == [10000.0] * 5 + [1e6]
    sparse = dataclasses.replace(config, num_experts=4, moe_layers=[0, 2], shared_expert_intermediate_size=8)
    assert [s.mlp for s in gemma3.layers(sparse)[:3]] == [Mlp.MOE_SHARED, Mlp.DENSE, Mlp.MOE_SHARED]
    assert gemma3.layer(dataclasses.replace(sparse, shared_expert_intermediate_size=0), 0).mlp is Mlp.MOE


@pytest.mark.parametrize(("layers", "hidden", "heads", "head_dim", "scalar"),
                         [(62, 5376, 32, 128, 168.0), (34, 2560, 8, 256, 256.0)])
def test_gemma3_gguf_scales_attention_by_llama_cpps_rule_per_shape(layers, hidden, heads, head_dim, scalar):
    """The file does not say; llama.cpp scales its 27B (62 layers) by hidden / heads, the others by head_dim."""
    meta = {"general.architecture": "gemma3", "gemma3.vocab_size": 100, "gemma3.embedding_length": hidden,
            "gemma3.feed_forward_length": 4 * hidden, "gemma3.block_count": layers,
            "gemma3.attention.head_count": heads, "gemma3.attention.key_length": head_dim,
            "gemma3.attention.sliding_window": 1024}
    config = family("gemma3").gguf_config(GGUFHeader(Path("gemma3.gguf"), meta, []))
    assert config.query_pre_attn_scalar == scalar
    # every sixth layer is global
    assert [family("gemma3").layer(config, i).mixer for i in (4, 5)] == [Mixer.SLIDING_ATTENTION, Mixer.ATTENTION]


def test_gemma4_layers_have_their_kinds_shapes_and_shared_layers_attend_the_last_writer_of_their_kind():
    types = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    config = ModelConfig("gemma4", *SHAPE[:3], 6, *SHAPE[4:], sliding_window=5, layer_types=types,
                         global_head_dim=32, num_global_kv_heads=1, num_kv_shared_layers=2, rope_local_theta=1e4,
                         qk_norm=True)
    specs = family("gemma4").layers(config)
    assert [(s.head_dim, s.kv_heads) for s in specs] == [(16, 2), (16, 2), (32, 1)] * 2
    assert [s.kv_source for s in specs] == [None] * 4 + [3, 2]
    assert [s.rope.head_dim for s in specs] == [16, 16, 32] * 2
    names = family("gemma4").tensor_names(config)
    assert "model.layers.3.self_attn.k_proj.weight" in names and "model.layers.4.self_attn.q_norm.weight" in names
    assert not [n for n in names if n.startswith("model.layers.4.self_attn.") and n.split(".")[4][0] in "kv"]


def test_gemma4_sparse_layers_run_their_dense_mlp_and_the_experts_each_with_norms_of_its_own():
    config = ModelConfig("gemma4", *SHAPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         dense_beside_experts=True, router_input_norm=True, expert_scale=True, experts_gate_up=True)
    assert [s.mlp for s in family("gemma4").layers(config)] == [Mlp.DENSE_AND_MOE] * 2
    names = family("gemma4").tensor_names(config, per_expert=True)  # a directory's experts are stacked too
    layer = "model.layers.1."
    assert {layer + n for n in ("mlp.gate_proj.weight", "mlp.gate.weight", "mlp.gate.scale", "mlp.expert_scale",
                                "mlp.experts.gate_up_proj.weight", "mlp.experts.down_proj.weight",
                                "pre_feedforward_layernorm_2.weight", "post_feedforward_layernorm_1.weight",
                                "post_feedforward_layernorm_2.weight")} <= set(names)
    assert not [n for n in names if ".experts.gate_proj." in n or ".experts.0." in n]


LLAMA_GGUF = {"general.architecture": "llama", "llama.vocab_size": 100, "llama.embedding_length": 64,
              "llama.feed_forward_length": 128, "llama.block_count": 2, "llama.attention.head_count": 4,
              "llama.context_length": 32768}
YARN = {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}


@pytest.mark.parametrize(("keys", "scaling"), [
    ({}, None),
    ({"rope.scaling.type": "none", "rope.scaling.factor": 4.0}, None),  # llama.cpp never scales "none"
    ({"rope.scaling.factor": 8.0}, {"rope_type": "linear", "factor": 8.0}),  # llama.cpp's type where none is named
    (YARN, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "beta_fast": 32.0,
            "beta_slow": 1.0}),
    (YARN | {"rope.scaling.original_context_length": 8192, "rope.scaling.attn_factor": 0.5},
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192, "beta_fast": 32.0,
      "beta_slow": 1.0, "attention_factor": 0.5 * (0.1 * math.log(4.0) + 1)}),
])
def test_gguf_rope_scaling_keys_read_as_llama_cpp_applies_them(keys, scaling):
    meta = LLAMA_GGUF | {f"llama.{key}": value for key, value in keys.items()}
    assert family("llama").gguf_config(GGUFHeader(Path("llama.gguf"), meta, [])).rope_scaling == scaling


def test_a_gguf_rope_scaling_of_another_type_is_refused_by_name():
    meta = LLAMA_GGUF | {"llama.rope.scaling.type": "longrope"}
    with pytest.raises(ValueError, match="^RoPE scaling 'longrope' in a GGUF file of llama is not supported"):
        family("llama").gguf_config(GGUFHeader(Path("llama.gguf"), meta, []))
