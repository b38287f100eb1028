"""The GGUF block kernels against gguf's reference: random blocks of every type, dequantized by the gguf package
and multiplied in float64, within the bound of the activations' q8 rounding; for every kernel variant this
CPU runs, for decode rows and batched rows, float32 and bf16 activations; and the portable generic variant
gives each SIMD variant's bits."""
import gguf
import numpy as np
import pytest
import torch
from conftest import q8_bound
from gguf_blocks import KERNEL_TYPES, random_blocks

from zhuzi.model import cpu_blocks, native
from zhuzi.model.blocks import BlockWeight

pytestmark = pytest.mark.usefixtures("variant")


def reference(x: torch.Tensor, parts: list[BlockWeight]) -> tuple[np.ndarray, np.ndarray]:
    """x W^T in float64 from gguf's values, and each output's bound: the q8 rounding of x (conftest.q8_bound:
    per 256 inputs for the K-quants, per 32 for the rest) plus float32 sums."""
    values = [torch.from_numpy(gguf.quants.dequantize(p.data.numpy(), p.qtype)) for p in parts]
    bound = torch.cat([q8_bound(x, w, gguf.GGML_QUANT_SIZES[p.qtype][0]) for p, w in zip(parts, values)], 1)
    x64, w64 = x.double(), torch.cat(values).double()
    return (x64 @ w64.T).numpy(), (bound + 1e-5 * x64.abs() @ w64.abs().T).numpy()


def weight(qtype, rows: int, cols: int, seed: int) -> BlockWeight:
    return BlockWeight(qtype, torch.from_numpy(random_blocks(qtype, rows, cols, seed)), cols)


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, 8, 70, 270])  # decode rows, rows over several passes, two work items
def test_block_linear_equals_gguf_values(qtype, m):
    cols = 512 if gguf.GGML_QUANT_SIZES[qtype][0] == 256 else 288  # 288: 256 inputs decoded at once and a tail of 32
    parts = [weight(qtype, 40, cols, 1), weight(qtype, 16, cols, 2)]  # a partial row group, then a second part
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
    y = cpu_blocks.block_linear(x, cpu_blocks.part_table(parts), 56)
    want, bound = reference(x, parts)
    assert y is not None and y.dtype == torch.float32
    assert (np.abs(y.numpy() - want) <= bound).all()


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_a_packed_matrix_gives_the_file_values_and_the_same_bits(qtype):
    """Block matrices are repacked at load into 16-row groups for the kernels: the packed copy dequantizes to
    gguf's values, and every output is the same bits as on the file's layout, for decode rows and prefill."""
    cols = 768 if gguf.GGML_QUANT_SIZES[qtype][0] == 256 else 288
    w = weight(qtype, 48, cols, 8)
    p = w.pack()
    assert p.packed and p.shape == w.shape and p.nbytes <= 1.03 * w.nbytes
    assert torch.equal(p.dequantize(), torch.from_numpy(gguf.quants.dequantize(w.data.numpy(), qtype)))
    for m in (1, 5, 40):
        x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m)).bfloat16()
        packed = cpu_blocks.block_linear(x, cpu_blocks.part_table([p]), 48, torch.float32)
        assert torch.equal(packed, cpu_blocks.block_linear(x, cpu_blocks.part_table([w]), 48, torch.float32))


def test_only_whole_groups_of_16_rows_are_packed():
    assert not weight(gguf.GGMLQuantizationType.Q4_K, 40, 512, 9).pack().packed
    assert weight(gguf.GGMLQuantizationType.Q8_0, 32, 512, 9).pack().packed


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q8_0], ids=str)
def test_bf16_rows_give_bf16_outputs(qtype):
    parts = [weight(qtype, 32, 256, 3)]
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(5)).bfloat16()
    y = cpu_blocks.block_linear(x, cpu_blocks.part_table(parts), 32)
    want, bound = reference(x.float(), parts)
    assert y.dtype == torch.bfloat16
    assert (np.abs(y.float().numpy() - want) <= bound + np.abs(want) * 2**-8).all()


def test_parts_of_mixed_types_and_a_row_alone_or_in_a_batch():
    """q, k and v of a Q4_K_M file are Q5_0, Q5_0 and Q8_0, or Q4_K and Q6_K: one layer; and a row's outputs
    are the same bits whatever the rows around it (--deterministic, speculative verification)."""
    parts = [weight(gguf.GGMLQuantizationType.Q4_K, 48, 1536, 4), weight(gguf.GGMLQuantizationType.Q6_K, 16, 1536, 5),
             weight(gguf.GGMLQuantizationType.Q8_0, 16, 1536, 6)]
    table = cpu_blocks.part_table(parts)
    x = torch.randn(77, 1536, generator=torch.Generator().manual_seed(7))
    whole = cpu_blocks.block_linear(x, table, 80)
    want, bound = reference(x, parts)
    assert (np.abs(whole.numpy() - want) <= bound).all()
    for row in (0, 9, 76):
        assert torch.equal(cpu_blocks.block_linear(x[row:row + 1], table, 80), whole[row:row + 1])


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_a_row_is_the_same_bits_alone_or_in_a_batch(qtype):
    """Up to 8 rows take the decode loops (block_decode.h: scales over a row group's rows, Q8_0's codes biased where
    the dot product allows), more the batched ones (block_prefill.h): a row's outputs are the same bits either
    way, in a partial row group too, and for 32-blocks over an odd count of them."""
    cols = 512 if gguf.GGML_QUANT_SIZES[qtype][0] == 256 else 288
    parts = [weight(qtype, 40, cols, 8)]  # alive while the table points at its blocks
    table = cpu_blocks.part_table(parts)
    x = torch.randn(270, cols, generator=torch.Generator().manual_seed(8))  # two work items: 256 rows, 14
    whole = cpu_blocks.block_linear(x, table, 40)
    for rows in (slice(5, 6), slice(3, 6), slice(0, 8), slice(262, 264)):
        assert torch.equal(cpu_blocks.block_linear(x[rows], table, 40), whole[rows])


def test_rows_of_another_length_are_refused():
    parts = [weight(gguf.GGMLQuantizationType.Q4_0, 16, 256, 6)]
    with pytest.raises(ValueError, match="does not take these parts"):
        cpu_blocks.block_linear(torch.randn(2, 288), cpu_blocks.part_table(parts), 16)


def test_the_type_table_is_gguf_s():
    """Each block type the kernels serve has the inputs and bytes a GGUF file gives it (its packed bytes are the
    file's, bar the 6-bit scales of Q4_K, Q5_K and IQ4_XS, unpacked to a byte each), and the types are the tests'
    own."""
    Q = gguf.GGMLQuantizationType
    assert sorted(cpu_blocks.TYPES) == sorted(KERNEL_TYPES)
    for qtype, t in cpu_blocks.TYPES.items():
        assert (t.inputs, t.nbytes) == gguf.GGML_QUANT_SIZES[qtype]
        assert t.packed_bytes == t.nbytes + {Q.Q4_K: 4, Q.Q5_K: 4, Q.IQ4_XS: 2}.get(qtype, 0)


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_the_generic_variant_gives_the_same_bits(variant, qtype):
    """The portable build (native.py's generic, for CPUs no SIMD variant runs on) computes the same integers and
    float operations as the SIMD ones (kernels/block_dot.h): the same bits for decode rows and batched ones, on
    the file's layout and packed."""
    if variant == "generic":
        pytest.skip("no SIMD variant runs here to compare with")
    cols = 512 if gguf.GGML_QUANT_SIZES[qtype][0] == 256 else 288
    w = weight(qtype, 48, cols, 3)
    parts = [w, w.pack()]  # alive while the tables point at their blocks
    tables = [cpu_blocks.part_table([p]) for p in parts]
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(3))

    def outputs() -> list[torch.Tensor]:
        return [cpu_blocks.block_linear(x[:m], table, 48) for table in tables for m in (1, 5, 40)]

    simd = outputs()
    native.select("generic")  # the fixture selects its variant back
    generic = outputs()
    assert all(a is not None and b is not None and torch.equal(a, b) for a, b in zip(simd, generic, strict=True))
