"""LFM2's config.json in the keys its released checkpoints use (block_ff_dim, full_attn_idxs, tie_embedding,
norm_eps) reads as transformers reads it."""
import torch
import transformers
from transformers.models.lfm2.modeling_lfm2 import Lfm2MLP

from zhuzi.model.families import hf_family

# LFM2-1.2B's shape, in the older keys
LFM2_1_2B = {"architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "block_auto_adjust_ff_dim": True,
             "block_ff_dim": 12288, "block_ffn_dim_multiplier": 1.0, "block_multiple_of": 256, "conv_L_cache": 3,
             "conv_bias": False, "full_attn_idxs": [2, 5, 8, 10, 12, 14], "hidden_size": 2048, "norm_eps": 1e-05,
             "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "rope_theta": 1000000.0,
             "tie_embedding": True, "vocab_size": 65536, "bos_token_id": 1, "eos_token_id": 7}


def test_lfm2_older_config_keys_read_as_transformers_reads_them():
    config = hf_family(LFM2_1_2B).hf_config(LFM2_1_2B, {})
    reference = transformers.Lfm2Config.from_dict(LFM2_1_2B)
    with torch.device("meta"):
        mlp = Lfm2MLP(reference)
    assert config.intermediate_size == mlp.w1.out_features == 8192  # two thirds of 12288, in multiples of 256
    assert config.layer_types == reference.layer_types and (config.kv_layers, config.state_layers) == (6, 10)
    assert config.tie_word_embeddings and config.rms_norm_eps == 1e-5 and config.rope_theta == 1e6
    assert config.state_bytes == 4 * 10 * 2048 * 2  # float32, the last two inputs of every channel, per layer
