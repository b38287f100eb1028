"""The model's own description: its parameter count and the weight bytes a decode step reads."""
import dataclasses

from zhuzi.model.loader import gguf_weights, load_model_config


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
