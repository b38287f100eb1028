"""mxfp4.py: transformers' MXFP4 layout (quant_method mxfp4) read as transformers dequantizes it, and a file's
*_blocks / *_scales pairs found by name."""
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from zhuzi.model import mxfp4


def test_unpack_equals_transformers_dequantization():
    """Random codes (both signs of zero too) and exponents around a realistic weight scale, [experts, rows, K / 32]
    blocks: the values and layout transformers' gpt-oss experts take."""
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(117, 131, (3, 10, 4), dtype=torch.uint8, generator=g)
    ours = mxfp4.unpack(blocks, scales)
    assert ours.shape == (3, 128, 10) and ours.dtype == torch.float32
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))


def test_a_pair_of_blocks_and_scales_stands_for_its_matrix():
    names = ["a.gate_up_proj_blocks", "a.gate_up_proj_scales", "a.gate_up_proj_bias", "b.down_proj_blocks",
             "c.weight_scales"]
    assert mxfp4.stored_names(names) == {
        "a.gate_up_proj": ("a.gate_up_proj_blocks", "a.gate_up_proj_scales"),
        "a.gate_up_proj_bias": "a.gate_up_proj_bias", "b.down_proj_blocks": "b.down_proj_blocks",
        "c.weight_scales": "c.weight_scales"}
