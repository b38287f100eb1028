"""The CPU linear kernels for dense weights against float64 matrix products, under every CPU variant this machine
runs: the small-batch kernel (float32 and bf16 weights; bf16 weights against float32 inputs too) and the
fixed-order form (--deterministic) that gives every row the bits it gets alone, for any number of rows. (GGUF
blocks, those made at load by --quantization included, are test_cpu_blocks.py's.)"""
import pytest
import torch

from zhuzi.model.cpu_linear import fixed_order_linear, small_m_linear

pytestmark = [pytest.mark.usefixtures("variant"), pytest.mark.long]

# Relative to the largest |output|: the float32 sums of K products, plus one rounding of the output
# to bf16 (half an ulp, 2^-9) when x is bf16.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2 ** -8}


def problem(m: int, n: int, k: int, dtype: torch.dtype, weight: str, seed: int = 0):
    """x [m, k] of dtype and weights: "same" (x's dtype) or "bf16"."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g)
    return x, w.to(dtype if weight == "same" else torch.bfloat16)


def assert_close(y, x, w):
    """Within the float32 / bf16 bound."""
    expected = x.double() @ w.double().T
    assert ((y.double() - expected).abs() <= TOLERANCE[y.dtype] * expected.abs().max()).all()


CASES = [(torch.float32, "same"), (torch.bfloat16, "same"), (torch.float32, "bf16")]


@pytest.mark.parametrize("dtype,weight", CASES)
@pytest.mark.parametrize("n,k", [(64, 576), (37, 577), (5, 15), (131, 1000)])
def test_matches_float64_reference(n, k, dtype, weight):
    for m in range(1, 9):
        x, w = problem(m, n, k, dtype, weight, seed=m)
        y = small_m_linear(x, w)
        assert y.dtype == dtype and y.shape == (m, n)
        assert_close(y, x, w)


@pytest.mark.parametrize("dtype,weight", CASES)
def test_row_is_bitwise_the_same_alone_or_in_a_batch(dtype, weight):
    x, w = problem(8, 203, 581, dtype, weight)
    batched = small_m_linear(x, w)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i in (0, 3, 7):
            assert torch.equal(small_m_linear(x[i:i + 1], w)[0], batched[i])
            assert torch.equal(small_m_linear(x[i:i + 3], w)[0], batched[i])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype,weight", CASES)
def test_fixed_order_rows_are_the_bits_of_a_row_alone_for_any_batch(dtype, weight):
    x, w = problem(300, 203, 581, dtype, weight)
    alone = torch.cat([small_m_linear(x[i:i + 1], w) for i in range(len(x))])
    assert_close(alone, x, w)
    threads = torch.get_num_threads()
    try:
        for m, pass_rows, num_threads in [(300, 128, 2), (300, 7, 1), (29, 128, 2), (9, 3, 1), (1, 128, 1)]:
            torch.set_num_threads(num_threads)
            assert torch.equal(fixed_order_linear(x[:m], w, pass_rows), alone[:m]), (m, pass_rows)
    finally:
        torch.set_num_threads(threads)


def test_refuses_what_it_does_not_serve():
    x, w = problem(9, 16, 64, torch.float32, "same")
    for args in [(x, w),  # more rows than a decode batch: the layer takes torch's GEMM or fixed_order_linear
                 (x[:2], w.T.contiguous().T),  # a transposed view of the weight
                 (x[:2].half(), w.half()),
                 (x[:2].bfloat16(), w)]:  # bf16 inputs against float32 weights
        with pytest.raises(ValueError, match="does not take"):
            small_m_linear(*args)
