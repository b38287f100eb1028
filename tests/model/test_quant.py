"""The quantized weight formats: int4 of a Q4_1 GGUF is its own weights, bit for bit (and the LM head's
Q8_0 likewise); elsewhere each weight moves by at most half a quantization step."""
import gguf
import numpy as np
import pytest
import torch

from zhuzi.model.quant import pack_q4, pack_q8, quantize_int8, unpack_q4, unpack_q8


def gguf_tensor(path, name: str, qtype) -> torch.Tensor:
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    assert tensor.tensor_type == qtype
    shape = tuple(int(s) for s in reversed(tensor.shape))
    return torch.from_numpy(np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type)).reshape(shape))


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.7.ffn_down.weight", "blk.29.ffn_up.weight"])
def test_smollm2_q4_1_blocks_are_kept_exactly(smollm2_path, name):
    w = gguf_tensor(smollm2_path, name, gguf.GGMLQuantizationType.Q4_1)
    assert torch.equal(unpack_q4(pack_q4(w), w.shape[0]), w)
    assert torch.equal(unpack_q4(pack_q4(w.bfloat16()), w.shape[0]), w)  # from the loader's bf16 tensors too


def test_smollm2_q8_0_embedding_is_kept_exactly(smollm2_path):
    w = gguf_tensor(smollm2_path, "token_embd.weight", gguf.GGMLQuantizationType.Q8_0)[:4096]
    assert torch.equal(unpack_q8(pack_q8(w), w.shape[0]), w)


@pytest.mark.parametrize("n", [16, 37, 100])
def test_q4_and_q8_errors_are_within_half_a_step(n):
    w = torch.randn(n, 96, generator=torch.Generator().manual_seed(n)) * 0.05
    groups = w.view(n, 3, 32)
    q4_step = (groups.amax(-1) - groups.amin(-1)) / 15
    q8_step = groups.abs().amax(-1) / 127
    fp16 = 1e-3 * w.abs().max()  # scales and minimums are stored in fp16
    assert ((unpack_q4(pack_q4(w), n) - w).abs().view(n, 3, 32) <= q4_step[..., None] / 2 + fp16).all()
    assert ((unpack_q8(pack_q8(w), n) - w).abs().view(n, 3, 32) <= q8_step[..., None] / 2 + fp16).all()


def test_int8_is_per_output_channel_within_half_a_step():
    w = torch.randn(40, 70) * torch.linspace(0.01, 1, 40)[:, None]  # rows of very different ranges
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (40,)
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7).all()


def test_shapes_the_q4_q8_packing_cannot_hold_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_q4(torch.randn(16, 40))
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_q8(torch.randn(16, 33))
