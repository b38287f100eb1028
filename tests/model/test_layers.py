"""RoPE's tables (layers.Rotary) against transformers' rotary embeddings."""
import torch
import transformers

from zhuzi.model.layers import Rotary

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


def test_a_partial_rotary_turns_only_the_first_dims():
    rotary = Rotary(16, 10000.0, None, 8, rotary_dim=8)
    x = torch.randn(8, 2, 16)
    cos, sin = rotary.tables(torch.arange(8), torch.float32)
    turned = rotary.apply(x, cos, sin)
    assert torch.equal(turned[..., 8:], x[..., 8:])
    full = Rotary(8, 10000.0, None, 8)
    assert torch.allclose(turned[..., :8], full.apply(x[..., :8], *full.tables(torch.arange(8), torch.float32)))
