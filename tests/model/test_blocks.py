"""GGUF blocks kept as the file stores them: their values are gguf's reference values, bit for bit, whether
a whole matrix is dequantized or a step's embedding rows are taken."""
import gguf
import numpy as np
import pytest
import torch
from gguf_blocks import KERNEL_TYPES, random_blocks

from zhuzi.model import cpu_blocks
from zhuzi.model.blocks import BlockWeight


def weight(qtype, rows=12, cols=512) -> BlockWeight:
    return BlockWeight(qtype, torch.from_numpy(random_blocks(qtype, rows, cols)), cols)


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_values_equal_gguf_reference_bit_for_bit(qtype):
    w = weight(qtype)
    assert cpu_blocks.dequantize_serves(qtype)
    reference = gguf.quants.dequantize(w.data.numpy(), qtype)
    assert np.array_equal(w.dequantize().numpy(), reference)
    assert torch.equal(w.dequantize(torch.bfloat16), torch.from_numpy(reference).bfloat16())


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_0], ids=str)
def test_taken_rows_are_the_rows_values(qtype):
    w = weight(qtype)
    ids = torch.tensor([[3, 0], [11, 3]])
    assert torch.equal(w.take(ids, torch.float32), w.dequantize()[ids])
    assert torch.equal(w[2:5].dequantize(), w.dequantize()[2:5])


def test_an_id_outside_the_matrix_is_an_error():
    with pytest.raises(IndexError, match="outside 0..11"):
        weight(gguf.GGMLQuantizationType.Q8_0).take(torch.tensor([12]), torch.float32)


def test_a_type_without_a_kernel_gets_gguf_values():
    qtype = gguf.GGMLQuantizationType.Q2_K  # no kernel: the gguf package dequantizes it
    data = random_blocks(gguf.GGMLQuantizationType.Q6_K, 4, 256)[:, :84]  # any bytes make Q2_K values
    w = BlockWeight(qtype, torch.from_numpy(np.ascontiguousarray(data)), 256)
    assert not cpu_blocks.dequantize_serves(qtype)
    assert np.array_equal(w.dequantize().numpy(), gguf.quants.dequantize(data, qtype), equal_nan=True)
