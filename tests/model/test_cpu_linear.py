"""The small-batch CPU linear kernel against a float64 matrix product."""
import pytest
import torch

from zhuzi.model.cpu_linear import _kernel, small_m_linear

pytestmark = pytest.mark.skipif(_kernel() is None, reason="no C++ compiler to build the kernel")

# Relative to the largest |output|: the float32 sums of K products, plus one rounding of the output
# to bf16 (half an ulp, 2^-9) when x is bf16.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2 ** -8}


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output channel int8, as the decoder's Int8Linear stores it."""
    scale = w.float().abs().amax(dim=1).clamp(min=1e-8) / 127
    return torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8), scale.to(w.dtype)


def problem(m: int, n: int, k: int, dtype: torch.dtype, int8: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    return (x, *quantize(w)) if int8 else (x, w, None)


def reference(x, w, scale):
    y = x.double() @ w.double().T
    return y * scale.double() if scale is not None else y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("n,k", [(64, 576), (37, 577), (5, 15), (131, 1000)])
@pytest.mark.parametrize("m", range(1, 9))
def test_matches_float64_reference(m, n, k, dtype, int8):
    x, w, scale = problem(m, n, k, dtype, int8)
    y = small_m_linear(x, w, scale)
    assert y is not None and y.dtype == dtype and y.shape == (m, n)
    expected = reference(x, w, scale)
    assert (y.double() - expected).abs().max() <= TOLERANCE[dtype] * expected.abs().max()


def test_float32_scales_serve_bf16_inputs():
    x, w, scale = problem(3, 40, 96, torch.bfloat16, int8=True)
    y = small_m_linear(x, w, scale.float())
    expected = reference(x, w, scale.float())
    assert (y.double() - expected).abs().max() <= TOLERANCE[torch.bfloat16] * expected.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("int8", [False, True])
def test_row_is_bitwise_the_same_alone_or_in_a_batch(dtype, int8):
    x, w, scale = problem(8, 203, 581, dtype, int8)
    batched = small_m_linear(x, w, scale)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i in (0, 3, 7):
            assert torch.equal(small_m_linear(x[i:i + 1], w, scale)[0], batched[i])
            assert torch.equal(small_m_linear(x[i:i + 3], w, scale)[0], batched[i])
    finally:
        torch.set_num_threads(threads)


def test_declines_what_it_does_not_serve():
    x, w, scale = problem(9, 16, 64, torch.float32, int8=False)
    assert small_m_linear(x, w) is None  # more rows than a decode batch: torch's GEMM
    assert small_m_linear(x[:2], w.T.contiguous().T) is None  # a transposed view of the weight
    assert small_m_linear(x[:2].half(), w.half()) is None
    assert small_m_linear(x[:2], w.bfloat16()) is None  # mixed float dtypes
    x, w, scale = problem(2, 16, 64, torch.float32, int8=True)
    assert small_m_linear(x, w) is None  # int8 needs its scales
    assert small_m_linear(x, w, scale[:8]) is None
