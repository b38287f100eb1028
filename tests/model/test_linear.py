"""A linear layer's backend, chosen once at construction by its weights (dtype, format, device) and the CPU's
kernels, and what each gives: the rows kernels for bf16 weights, torch for float32 ones (the reference), the
block kernels for GGUF blocks (those --quantization makes at load too)."""
import gguf
import pytest
import torch

from zhuzi.model import cpu_linear, native
from zhuzi.model.linear import BlockLinear, Linear, blocks_serve
from zhuzi.model.quant import quantize

pytestmark = pytest.mark.usefixtures("variant")


def test_bf16_weights_take_the_rows_kernels_and_float32_ones_torch():
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(0))
    bias = torch.randn(24)
    dense = Linear(w.bfloat16(), bias.bfloat16())
    assert dense.backend == "rows" and Linear(w, bias).backend == "torch"
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(1))
    for rows in (1, 8, 20):  # decode rows through small_m_linear, more through the fixed-order kernel
        y = dense(x[:rows])  # float32 inputs over bf16 weights: dtype auto without native bf16
        want = cpu_linear.small_m_linear(x[:rows], dense.weight) if rows <= 8 \
            else cpu_linear.fixed_order_linear(x[:rows], dense.weight)
        assert torch.equal(y, want + dense.bias)
    assert torch.equal(Linear(w, bias)(x), torch.nn.functional.linear(x, w, bias))


def test_without_kernels_every_layer_is_torch_s():
    before = native.current()
    native.select("torch")
    try:
        assert Linear(torch.randn(16, 32).bfloat16()).backend == "torch"
        assert not blocks_serve([quantize(torch.randn(16, 32), gguf.GGMLQuantizationType.Q8_0)], "cpu")
    finally:
        native.select(before)


def test_quantized_blocks_run_as_the_block_kernels_over_their_rows():
    """A matrix of rows not in whole 16-row groups: the groups packed, the rest in the file's layout, one layer
    whose outputs are the blocks' exact values' product, bar the activations' q8 rounding."""
    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(2))
    blocks = quantize(w, gguf.GGMLQuantizationType.Q4_1)
    assert blocks_serve([blocks], "cpu") and not blocks_serve([blocks], "cuda")
    layer = BlockLinear([blocks], out_dtype=torch.float32)
    assert layer.backend == "blocks" and [p.shape[0] for p in layer.parts] == [32, 8] and layer.parts[0].packed
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    exact = x.double() @ blocks.dequantize().double().T
    assert (layer(x).double() - exact).abs().max() <= 0.02 * exact.abs().max()
