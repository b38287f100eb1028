"""The CPU linear kernels against float64 matrix products, under every CPU variant this machine runs: the
small-batch kernel (float32, bf16 and int8 weights; bf16 weights against float32 inputs too), the quant kernel
(Q4/Q8, any number of rows), int8 compute, and the fixed-order form (--deterministic) that gives every
row the bits it gets alone, for any number of rows. Off AVX-512 int8 and 4-bit weights meet q8 activations
(kernels/q8.h): their bound adds that rounding (conftest.q8_bound)."""
import pytest
import torch
from conftest import q8_bound

from zhuzi.model import native
from zhuzi.model.cpu_linear import fixed_order_linear, int8_matmul, quant_linear, small_m_linear
from zhuzi.model.quant import pack_q4, pack_q8, unpack_q4, unpack_q8

pytestmark = [pytest.mark.usefixtures("variant"), pytest.mark.long]

# Relative to the largest |output|: the float32 sums of K products, plus one rounding of the output
# to bf16 (half an ulp, 2^-9) when x is bf16.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2 ** -8}


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output channel int8, as the decoder's Int8Linear stores it."""
    scale = w.float().abs().amax(dim=1).clamp(min=1e-8) / 127
    return torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8), scale.to(w.dtype)


def problem(m: int, n: int, k: int, dtype: torch.dtype, weight: str, seed: int = 0):
    """x [m, k] of dtype and weights: "same" (x's dtype), "bf16" or "int8" (with scales)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g)
    if weight == "int8":
        return (x, *quantize(w.to(dtype)))
    return x, w.to(dtype if weight == "same" else torch.bfloat16), None


def reference(x, w, scale):
    y = x.double() @ w.double().T
    return y * scale.double() if scale is not None else y


def assert_close(y, x, w, scale):
    """Within the float32 / bf16 bound, plus q8 rounding where int8 weights meet q8 activations."""
    expected = reference(x, w, scale)
    bound = TOLERANCE[y.dtype] * expected.abs().max()
    if w.dtype == torch.int8 and not native.native_bf16():
        bound = bound + q8_bound(x, w.double() * scale.double()[:, None])
    assert ((y.double() - expected).abs() <= bound).all()


CASES = [(torch.float32, "same"), (torch.bfloat16, "same"), (torch.float32, "bf16"), (torch.float32, "int8"),
         (torch.bfloat16, "int8")]


@pytest.mark.parametrize("dtype,weight", CASES)
@pytest.mark.parametrize("n,k", [(64, 576), (37, 577), (5, 15), (131, 1000)])
def test_matches_float64_reference(n, k, dtype, weight):
    for m in range(1, 9):
        x, w, scale = problem(m, n, k, dtype, weight, seed=m)
        y = small_m_linear(x, w, scale)
        assert y is not None and y.dtype == dtype and y.shape == (m, n)
        assert_close(y, x, w, scale)


def test_float32_scales_serve_bf16_inputs():
    x, w, scale = problem(3, 40, 96, torch.bfloat16, "int8")
    assert_close(small_m_linear(x, w, scale.float()), x, w, scale.float())


@pytest.mark.parametrize("dtype,weight", CASES)
def test_row_is_bitwise_the_same_alone_or_in_a_batch(dtype, weight):
    x, w, scale = problem(8, 203, 581, dtype, weight)
    batched = small_m_linear(x, w, scale)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i in (0, 3, 7):
            assert torch.equal(small_m_linear(x[i:i + 1], w, scale)[0], batched[i])
            assert torch.equal(small_m_linear(x[i:i + 3], w, scale)[0], batched[i])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype,weight", CASES)
def test_fixed_order_rows_are_the_bits_of_a_row_alone_for_any_batch(dtype, weight):
    x, w, scale = problem(300, 203, 581, dtype, weight)
    alone = torch.cat([small_m_linear(x[i:i + 1], w, scale) for i in range(len(x))])
    assert_close(alone, x, w, scale)
    threads = torch.get_num_threads()
    try:
        for m, pass_rows, num_threads in [(300, 128, 2), (300, 7, 1), (29, 128, 2), (9, 3, 1), (1, 128, 1)]:
            torch.set_num_threads(num_threads)
            assert torch.equal(fixed_order_linear(x[:m], w, scale, pass_rows), alone[:m]), (m, pass_rows)
    finally:
        torch.set_num_threads(threads)


def test_declines_what_it_does_not_serve():
    x, w, scale = problem(9, 16, 64, torch.float32, "same")
    assert small_m_linear(x, w) is None  # more rows than a decode batch: torch's GEMM
    assert small_m_linear(x[:2], w.T.contiguous().T) is None  # a transposed view of the weight
    assert small_m_linear(x[:2].half(), w.half()) is None
    assert small_m_linear(x[:2].bfloat16(), w) is None  # bf16 inputs against float32 weights
    x, w, scale = problem(2, 16, 64, torch.float32, "int8")
    assert small_m_linear(x, w) is None  # int8 needs its scales
    assert small_m_linear(x, w, scale[:8]) is None


PACKERS = {"q4": (pack_q4, unpack_q4), "q8": (pack_q8, unpack_q8)}


def quant_problem(m: int, n: int, k: int, fmt: str, dtype=torch.bfloat16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, 7] *= 20  # an outlier channel, as real activations have
    pack, unpack = PACKERS[fmt]
    packed = pack(torch.randn(n, k, generator=g) * 0.05)
    return x.to(dtype), packed, unpack(packed, n)


@pytest.mark.parametrize("fmt", ["q4", "q8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(64, 576), (37, 1536), (5, 32)])
def test_quant_matches_the_float64_product_of_its_weights(n, k, fmt, dtype):
    """With AVX-512 the inputs meet the weights unrounded (float32 inputs rounded to bf16 once); elsewhere as
    q8 blocks. Beyond that only float32 sums and the output's rounding remain."""
    for m in [1, 2, 3, 5, 8, 9, 17, 130]:
        x, packed, w = quant_problem(m, n, k, fmt, dtype, seed=m)
        y = quant_linear(x, packed, fmt, n)
        assert y is not None and y.dtype == dtype and y.shape == (m, n)
        expected = x.double() @ w.double().T
        bound = TOLERANCE[torch.bfloat16] * expected.abs().max()
        if not native.native_bf16():
            bound = bound + q8_bound(x, w)
        assert ((y.double() - expected).abs() <= bound).all(), m


@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_quant_row_is_bitwise_the_same_alone_in_any_batch_and_thread_count(fmt):
    x, packed, _ = quant_problem(40, 203, 576, fmt)
    batched = quant_linear(x, packed, fmt, 203)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i in (0, 9, 39):
            assert torch.equal(quant_linear(x[i:i + 1], packed, fmt, 203)[0], batched[i])
            assert torch.equal(quant_linear(x[i:i + 3], packed, fmt, 203)[0], batched[i])
    finally:
        torch.set_num_threads(threads)


def test_quant_kernel_declines_what_it_does_not_serve():
    x, packed, _ = quant_problem(2, 16, 64, "q4")
    assert quant_linear(x.half(), packed, "q4", 16) is None
    assert quant_linear(x[:, :32], packed, "q4", 16) is None  # inputs of another width


def emulated_int8(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 compute in float64: each row over its range (widened to hold 0) onto -128..127, x = s (q - z)."""
    xf = x.float()
    lo, hi = xf.amin(1, keepdim=True).clamp(max=0), xf.amax(1, keepdim=True).clamp(min=0)
    inv = torch.where(hi > lo, 255 / (hi - lo), 0)
    zero = torch.round(-lo * inv) - 128
    q = torch.clamp(torch.round(xf * inv) + zero, -128, 127)
    s = ((hi - lo) / 255).double()
    return (q.double() - zero.double()) @ w.double().T * s * scale.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(9, 64, 576), (33, 37, 1536), (200, 130, 96)])
def test_int8_compute_matches_its_arithmetic_and_stays_near_the_exact_product(m, n, k, dtype):
    """With AVX-512: per-row asymmetric int8 inputs and torch._int_mm; elsewhere each row through the decode
    rows' own arithmetic (q8 blocks, int8 dot products)."""
    g = torch.Generator().manual_seed(m)
    x = (torch.randn(m, k, generator=g) + 0.3).to(dtype)
    x[:, 3] *= 20
    w, scale = quantize(torch.randn(n, k, generator=g))
    y = int8_matmul(x, w, scale.float(), w.sum(1, dtype=torch.int32))
    assert y is not None and y.dtype == dtype and y.shape == (m, n)
    weights = w.double() * scale.double()[:, None]
    exact = x.double() @ weights.T
    if native.native_bf16():
        expected = emulated_int8(x, w, scale.float())
        assert (y.double() - expected).abs().max() <= TOLERANCE[dtype] * expected.abs().max()
        # each input moves by at most half a step (1/255 of its row's range, widened to hold 0)
        xf = x.double()
        step = (xf.amax(1).clamp(min=0) - xf.amin(1).clamp(max=0)) / 255
        bound = step[:, None] / 2 * weights.abs().sum(1)[None, :]
    else:
        for i in (0, m // 2, m - 1):
            assert torch.equal(y[i], small_m_linear(x[i:i + 1], w, scale.float())[0])
        bound = q8_bound(x, weights)
    assert ((y.double() - exact).abs() <= bound + TOLERANCE[dtype] * exact.abs().max()).all()


def test_int8_compute_adds_the_bias_and_is_row_by_row():
    x, w, scale = problem(40, 50, 96, torch.bfloat16, "int8")
    bias = torch.randn(50).bfloat16()
    sums = w.sum(1, dtype=torch.int32)
    batched = int8_matmul(x, w, scale.float(), sums, bias)
    unbiased = int8_matmul(x, w, scale.float(), sums).float() + bias.float()
    assert (batched.float() - unbiased).abs().max() <= 2 ** -7 * unbiased.abs().max()  # two roundings to bf16
    for i in (0, 17, 39):
        assert torch.equal(int8_matmul(x[i:i + 1], w, scale.float(), sums, bias)[0], batched[i])
