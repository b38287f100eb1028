"""RoPE's tables (layers.Rotary) against transformers' rotary embeddings."""
import pytest
import torch
import transformers

from zhuzi.model.layers import Rotary, rope_attention_factor

LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0],
            "long_factor": [1.0, 1.5, 3.0, 5.0, 8.0, 12.0, 16.0, 24.0]}  # head_dim 16: 8 frequencies


def test_longrope_turns_the_original_context_short_and_beyond_it_long():
    """Phi-3's LongRoPE: positions within the original context as transformers turns a sequence that fits
    in it (short factors), positions past it as transformers turns a longer one (long factors); both scaled
    by the attention factor of the context's stretch."""
    config = transformers.Phi3Config(hidden_size=64, num_attention_heads=4, max_position_embeddings=4096,
                                     original_max_position_embeddings=128, rope_scaling=dict(LONGROPE),
                                     pad_token_id=None)
    reference = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(config)
    scaling = LONGROPE | {"original_max_position_embeddings": 128, "factor": 4096 / 128}
    rotary = Rotary(16, 10000.0, scaling, 300)
    x = torch.zeros(1, dtype=torch.float32)
    for positions in (torch.arange(128), torch.arange(300)):  # the second reaches past the original context
        cos, sin = reference(x, positions[None])
        ours_cos, ours_sin = rotary.tables(positions, torch.float32)
        tail = slice(128 if len(positions) > 128 else 0, None)  # transformers turns a longer sequence all long
        assert torch.allclose(ours_cos[tail, 0], cos[0, tail], atol=1e-5)
        assert torch.allclose(ours_sin[tail, 0], sin[0, tail], atol=1e-5)


@pytest.mark.parametrize("truncate", [False, True])
@pytest.mark.parametrize("extra", [{}, {"mscale": 1.0, "mscale_all_dim": 0.5}, {"attention_factor": 1.3}])
def test_yarn_equals_transformers(truncate, extra):
    """gpt-oss's YaRN (truncate false), the default form (truncate true), DeepSeek's mscale keys and a given
    attention factor: the same frequencies and cos/sin scale as transformers' _compute_yarn_parameters."""
    yarn = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": truncate,
            "original_max_position_embeddings": 4096} | extra
    config = transformers.GptOssConfig(hidden_size=64, num_attention_heads=4, head_dim=16, num_hidden_layers=2,
                                       rope_parameters=yarn | {"rope_theta": 150000.0})
    reference = transformers.models.gpt_oss.modeling_gpt_oss.GptOssRotaryEmbedding(config)
    rotary = Rotary(16, 150000.0, yarn, 300)
    positions = torch.arange(300)
    cos, sin = reference(torch.zeros(1), positions[None])
    ours_cos, ours_sin = rotary.tables(positions, torch.float32)
    assert torch.allclose(ours_cos[:, 0, :8], cos[0], atol=1e-5)
    assert torch.allclose(ours_sin[:, 0, :8], sin[0], atol=1e-5)
    assert rope_attention_factor(yarn) == pytest.approx(reference.attention_scaling)


def test_a_partial_rotary_turns_only_the_first_dims():
    rotary = Rotary(16, 10000.0, None, 8, rotary_dim=8)
    x = torch.randn(8, 2, 16)
    cos, sin = rotary.tables(torch.arange(8), torch.float32)
    turned = rotary.apply(x, cos, sin)
    assert torch.equal(turned[..., 8:], x[..., 8:])
    full = Rotary(8, 10000.0, None, 8)
    assert torch.allclose(turned[..., :8], full.apply(x[..., :8], *full.tables(torch.arange(8), torch.float32)))
