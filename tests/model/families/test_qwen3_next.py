"""Qwen3-Next: its config.json read as transformers reads it, and its merged DeltaNet matrices (in_proj_qkvz,
in_proj_ba / ssm_ba, rows interleaved per key head) split into Qwen3.5's, a GGUF's quantized blocks too."""
import gguf
import pytest
import tiny
import torch
import transformers
from test_decoder import assert_logits_match

from zhuzi.model.blocks import BlockWeight
from zhuzi.model.decoder import Decoder
from zhuzi.model.families import family, hf_family
from zhuzi.model.loader import load_checkpoint
from zhuzi.model.model_config import LinearAttentionShape

# Qwen3-Next-80B-A3B's shape, in the keys its config.json uses: no layer_types (full_attention_interval says),
# partial_rotary_factor beside rope_theta
QWEN3_NEXT_80B = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 2048,
                  "intermediate_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 16,
                  "num_key_value_heads": 2, "head_dim": 256, "full_attention_interval": 4,
                  "partial_rotary_factor": 0.25, "rope_theta": 10000000, "linear_conv_kernel_dim": 4,
                  "linear_key_head_dim": 128,
                  "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
                  "decoder_sparse_step": 1, "mlp_only_layers": [], "num_experts": 512, "num_experts_per_tok": 10,
                  "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "norm_topk_prob": True,
                  "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "vocab_size": 151936,
                  "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645}


def test_qwen3_next_config_reads_as_transformers_reads_it():
    """Three DeltaNet layers of every four, experts in every layer with the gated shared expert, RoPE over a
    quarter of each head; the top-k renormalized where config.json leaves norm_topk_prob out (transformers'
    default, unlike Qwen3-MoE's)."""
    config = hf_family(QWEN3_NEXT_80B).hf_config(QWEN3_NEXT_80B, {})
    reference = transformers.Qwen3NextConfig.from_dict(QWEN3_NEXT_80B)
    assert config.architecture == "qwen3_next" and config.layer_types == reference.layer_types
    assert config.linear == LinearAttentionShape(16, 32, 128, 128, 4, tiled=False, merged_qkvz=True)
    assert config.rotary_dim == 64 and config.norm_weight_offset == 1.0 and config.rope_theta == 1e7
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
            config.shared_expert_intermediate_size) == (512, 10, 512, 512)
    assert config.moe_layers is None and config.shared_expert_gate and config.norm_topk_prob
    unsaid = {k: v for k, v in QWEN3_NEXT_80B.items() if k != "norm_topk_prob"}
    assert hf_family(unsaid).hf_config(unsaid, {}).norm_topk_prob == transformers.Qwen3NextConfig.from_dict(
        unsaid).norm_topk_prob is True


@pytest.mark.parametrize("ssm_in", [False, True], ids=["attn_qkv", "ssm_in"])
def test_quantized_merged_matrices_split_into_their_rows_of_the_files_blocks(ssm_in, tmp_path):
    """llama.cpp quantizes ssm_ba, and the older converter's ssm_in (in_proj_qkvz), Q8_0 here: per key head, their
    rows hold its value heads' b then a (its q, k, v and z): the parts are those rows of the file's blocks, and
    the model computes transformers' logits with the merged matrices at the blocks' values."""
    hf = tiny.build("qwen3_next", tmp_path, rope_theta=50000.0, rms_norm_eps=1e-5)
    merged = [n for n in tiny.converter_tensors(hf) if n.endswith(("in_proj_qkvz.weight", "in_proj_ba.weight"))]
    path = tiny.write_gguf(tmp_path / "q8.gguf", hf, "qwen3_next",
                           types=dict.fromkeys(merged, gguf.GGMLQuantizationType.Q8_0), ssm_in=ssm_in)
    ckpt = load_checkpoint(path, torch.float32)
    assert ckpt.config.linear.merged_qkvz == ssm_in
    layer = "model.layers.0"
    ba = ckpt.tensors[f"{layer}.linear_attn.in_proj_ba.weight"]
    parts = family("qwen3_next").split_merged(ckpt.tensors, ckpt.config, layer)
    qkv, b, a = (parts[f"{layer}.linear_attn.in_proj_{n}.weight"] for n in ("qkv", "b", "a"))
    assert isinstance(ba, BlockWeight) and isinstance(b, BlockWeight) and isinstance(a, BlockWeight)
    assert isinstance(qkv, BlockWeight) == ssm_in
    # two key heads, two value heads each: rows b0 b1 a0 a1 of key head 0, then of key head 1
    assert torch.equal(b.dequantize(), ba.dequantize()[[0, 1, 4, 5]])
    assert torch.equal(a.dequantize(), ba.dequantize()[[2, 3, 6, 7]])
    with torch.no_grad():
        for name in filter(ckpt.tensors.__contains__, merged):
            hf.get_submodule(name.removesuffix(".weight")).weight.copy_(ckpt.tensors[name].dequantize())
    assert_logits_match(hf, Decoder(ckpt.config, ckpt.tensors))
