"""The model's own description: its parameter count and the weight bytes a decode step reads."""
import dataclasses

from zhuzi.model.loader import gguf_weights, load_model_config
from zhuzi.model.model_config import ModelConfig


def test_the_parameter_count_is_the_checkpoints():
    config = load_model_config(None)
    assert config.num_parameters == sum(values for _, _, values in gguf_weights(None).values())


def test_a_decode_step_reads_one_embedding_row_and_the_rest_once():
    tied = load_model_config(None)
    assert tied.tie_word_embeddings and tied.decode_weight_bytes(2) == 2 * tied.num_parameters
    untied = dataclasses.replace(tied, tie_word_embeddings=False)
    unread = (untied.vocab_size - 1) * untied.hidden_size
    assert untied.decode_weight_bytes(1) == untied.num_parameters - unread
    head = untied.vocab_size * untied.hidden_size
    assert untied.decode_weight_bytes(1, 0.5) == untied.num_parameters - unread - head // 2


def test_gemma4_counts_each_layers_shape_and_a_step_reads_one_row_of_the_per_layer_table():
    """Heads of 16 (sliding) and 32 (global); layers 4 and 5 attend layers 3's and 2's K/V (Q and O only); a
    per-layer embedding of 8 a layer over a vocabulary of 100; tied embeddings."""
    config = ModelConfig("gemma4", 100, 64, 128, 6, 4, 2, 16, tie_word_embeddings=True,
                         layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
                         global_head_dim=32, num_kv_shared_layers=2, per_layer_input_size=8, per_layer_vocab_size=100)
    attention = 3 * (64 * (64 + 2 * 32) + 64 * 64) + (64 * (128 + 2 * 64) + 128 * 64) + 2 * 64 * 64 + 2 * 64 * 128
    per_layer_inputs = 100 * 6 * 8 + 64 * 6 * 8 + 8 + 6 * (2 * 64 * 8 + 64)
    norms, embedding, mlps = 6 * 2 * 64 + 64, 100 * 64, 6 * 3 * 64 * 128
    assert config.num_parameters == attention + per_layer_inputs + norms + embedding + mlps
    assert config.decode_weight_bytes(1) == config.num_parameters - 99 * 6 * 8


def test_gemma4_counts_the_dense_mlp_beside_the_experts_and_a_step_reads_the_top_k():
    """A sparse layer of 26B-A4B's kind: its dense MLP (width 128), the router with its input scale and a factor
    per expert, 4 experts of width 32 of which a token runs 2."""
    dense = ModelConfig("gemma4", 100, 64, 128, 2, 4, 2, 16, tie_word_embeddings=True)
    sparse = dataclasses.replace(dense, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                 dense_beside_experts=True, router_input_norm=True, expert_scale=True)
    router, expert = 4 * 64 + 64 + 4, 3 * 64 * 32
    assert sparse.num_parameters == dense.num_parameters + 2 * (router + 4 * expert)
    assert sparse.active_parameters == dense.num_parameters + 2 * (router + 2 * expert)
