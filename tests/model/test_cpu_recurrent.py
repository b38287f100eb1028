"""The recurrent mixers (cpu_recurrent.py) against float64 token recurrences on random data, under every CPU variant
this machine runs and in torch (the path of other devices): the short convolution and the gated delta rule, decode
over several slots and prefill, with GQA's shared key heads; a prefill split in two is one prefill (the kernels: the
same bits, and the bits decode gives each token); the torch chunked form and the kernels agree with transformers'
Qwen3-Next reference; the kernels refuse what they do not serve."""
import pytest
import torch
import torch.nn.functional as F
from conftest import VARIANTS

from zhuzi.model import cpu_recurrent, native
from zhuzi.model.cpu_recurrent import KERNELS, TORCH, RecurrentOps

pytestmark = pytest.mark.usefixtures("one_thread")

# Relative to the largest |value| compared: float32 rounding. A convolution output is K <= 4 products; the delta
# rule's state gathers a few ulps a token and does not grow them (the decay and (I - beta k k^T) never stretch it).
CONV_TOLERANCE = 1e-6
DELTA_TOLERANCE = 2e-6


@pytest.fixture(params=[*VARIANTS, "torch"])
def ops(request):
    """The kernels of each variant this CPU runs, then torch's operations."""
    if request.param == "torch":
        yield TORCH
        return
    before = native.current()
    native.select(request.param)
    try:
        if not cpu_recurrent.serves():
            pytest.skip(f"no recurrent kernels in the {request.param} build")
        yield KERNELS
    finally:
        native.select(before)


@pytest.fixture
def kernels(variant) -> RecurrentOps:
    """The kernels of each variant this CPU runs."""
    if not cpu_recurrent.serves():
        pytest.skip(f"no recurrent kernels in the {variant} build")
    return KERNELS


def assert_close(got: torch.Tensor, want: torch.Tensor, tolerance: float) -> None:
    error = (got.double() - want).abs().max().item()
    assert error <= tolerance * want.abs().max().item(), error


# ---- the short convolution


def conv_problem(C: int, K: int, slots: int, seed: int):
    """weight [C, K], bias [C] and random states [slots, C, K - 1]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(C, K, generator=g), torch.randn(C, generator=g), torch.randn(slots, C, K - 1, generator=g)


def conv_reference(history: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   silu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 outputs [L, C] of tokens x [L, C] after a channel-major history [C, K - 1], and the history left."""
    K = weight.shape[1]
    seq = torch.cat([history.double().T, x.double()])  # [K - 1 + L, C]
    out = torch.stack([(seq[t:t + K].T * weight.double()).sum(-1) for t in range(len(x))])
    out = out + bias.double() if bias is not None else out
    return (F.silu(out) if silu else out), seq[len(x):].T


@pytest.mark.parametrize("K", [2, 3, 4])
@pytest.mark.parametrize("bias,silu", [(True, True), (False, False)])
def test_short_conv_decode_matches_float64(ops: RecurrentOps, K: int, bias: bool, silu: bool):
    C, slots = 37, torch.tensor([4, 0, 2])  # 37: vectors and a tail of every variant
    weight, b, state = conv_problem(C, K, 5, seed=K)
    b = b if bias else None
    histories = state.double().clone()
    g = torch.Generator().manual_seed(1)
    for _ in range(K + 1):  # past the first history
        x = torch.randn(len(slots), C, generator=g)
        out = ops.short_conv_decode(x, state, slots, weight, b, silu)
        for row, slot in enumerate(slots.tolist()):
            want, histories[slot] = conv_reference(histories[slot], x[row:row + 1], weight, b, silu)
            assert_close(out[row:row + 1], want, CONV_TOLERANCE)
        assert_close(state, histories, CONV_TOLERANCE)  # slots 1 and 3 kept


@pytest.mark.parametrize("K", [2, 4])
@pytest.mark.parametrize("L", [1, 2, 19])  # fewer tokens than the history holds, too
def test_short_conv_prefill_matches_float64(ops: RecurrentOps, K: int, L: int):
    C = 37
    weight, b, state = conv_problem(C, K, 3, seed=L)
    before = state.clone()
    x = torch.randn(L, C, generator=torch.Generator().manual_seed(2))
    out = ops.short_conv_prefill(x, state, 1, weight, b, True)
    want, history = conv_reference(before[1], x, weight, b, True)
    assert_close(out, want, CONV_TOLERANCE)
    assert_close(state[1], history, CONV_TOLERANCE)
    assert torch.equal(state[0], before[0]) and torch.equal(state[2], before[2])


def test_short_conv_prefill_split_in_two_is_one_prefill(ops: RecurrentOps):
    C, K, L = 45, 4, 23
    weight, b, state = conv_problem(C, K, 2, seed=3)
    split = state.clone()
    x = torch.randn(L, C, generator=torch.Generator().manual_seed(4))
    whole = ops.short_conv_prefill(x, state, 1, weight, b, True)
    parts = torch.cat([ops.short_conv_prefill(x[:2], split, 1, weight, b, True),
                       ops.short_conv_prefill(x[2:], split, 1, weight, b, True)])
    assert_close(parts, whole.double(), CONV_TOLERANCE)
    assert_close(split, state.double(), CONV_TOLERANCE)
    if ops is KERNELS:  # every token by decode's operations: the same bits
        assert torch.equal(parts, whole) and torch.equal(split, state)


def test_short_conv_kernels_decode_a_token_as_prefill_does(kernels: RecurrentOps):
    C, K, L = 45, 4, 6
    weight, b, state = conv_problem(C, K, 2, seed=5)
    decoded = state.clone()
    x = torch.randn(L, C, generator=torch.Generator().manual_seed(6))
    prefilled = kernels.short_conv_prefill(x, state, 1, weight, b, True)
    slot = torch.tensor([1])
    steps = torch.cat([kernels.short_conv_decode(x[t:t + 1], decoded, slot, weight, b, True) for t in range(L)])
    assert torch.equal(steps, prefilled) and torch.equal(decoded, state)


# ---- the gated delta rule


def delta_inputs(T: int, HK: int, HV: int, DK: int, DV: int, seed: int):
    """q (scaled), k (unit rows), v, g <= 0 and beta in (0, 1), as the layer hands them over."""
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(T, HK, DK, generator=g), dim=-1) * DK ** -0.5
    k = F.normalize(torch.randn(T, HK, DK, generator=g), dim=-1)
    v = torch.randn(T, HV, DV, generator=g)
    log_decay = -F.softplus(torch.randn(T, HV, generator=g)) * 0.5
    return q, k, v, log_decay, torch.sigmoid(torch.randn(T, HV, generator=g))


def delta_states(slots: int, HV: int, DK: int, DV: int, seed: int) -> torch.Tensor:
    return torch.randn(slots, HV, DK, DV, generator=torch.Generator().manual_seed(seed)) * 0.3


def delta_reference(q, k, v, g, beta, S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The token recurrence in float64 for one sequence: outputs [T, HV, DV] and the state [HV, DK, DV] left."""
    rep = v.shape[1] // k.shape[1]
    q, k = (t.double().repeat_interleave(rep, dim=1) for t in (q, k))
    v, g, beta, S = v.double(), g.double(), beta.double(), S.double().clone()
    out = []
    for t in range(len(v)):
        S = S * g[t].exp()[:, None, None]
        delta = (v[t] - torch.einsum("hkv,hk->hv", S, k[t])) * beta[t][:, None]
        S = S + k[t][:, :, None] * delta[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", S, q[t]))
    return torch.stack(out), S


SHAPES = [(2, 4, 40, 36), (1, 2, 128, 128)]  # HK, HV, DK, DV: tails of every variant; the size models use


@pytest.mark.parametrize("HK,HV,DK,DV", SHAPES)
def test_gated_delta_decode_matches_float64(ops: RecurrentOps, HK: int, HV: int, DK: int, DV: int):
    slots = torch.tensor([3, 1, 0])
    state = delta_states(4, HV, DK, DV, seed=DK)
    want = state.double().clone()
    for step in range(3):
        q, k, v, g, beta = delta_inputs(len(slots), HK, HV, DK, DV, seed=step)
        out = ops.gated_delta_decode(q, k, v, g, beta, state, slots)
        for row, slot in enumerate(slots.tolist()):
            one = [t[row:row + 1] for t in (q, k, v, g, beta)]
            expected, want[slot] = delta_reference(*one, want[slot])
            assert_close(out[row:row + 1], expected, DELTA_TOLERANCE)
        assert_close(state, want, DELTA_TOLERANCE)  # slot 2 kept


@pytest.mark.parametrize("HK,HV,DK,DV", SHAPES)
def test_gated_delta_prefill_matches_float64(ops: RecurrentOps, HK: int, HV: int, DK: int, DV: int):
    L = 150  # two whole chunks of torch's form and a padded one
    state = delta_states(3, HV, DK, DV, seed=1)
    before = state.clone()
    inputs = delta_inputs(L, HK, HV, DK, DV, seed=2)
    out = ops.gated_delta_prefill(*inputs, state, 1)
    expected, left = delta_reference(*inputs, before[1])
    assert_close(out, expected, DELTA_TOLERANCE)
    assert_close(state[1], left, DELTA_TOLERANCE)
    assert torch.equal(state[0], before[0]) and torch.equal(state[2], before[2])


def test_gated_delta_prefill_split_in_two_is_one_prefill(ops: RecurrentOps):
    HK, HV, DK, DV, L = 2, 4, 40, 36, 97
    state = delta_states(2, HV, DK, DV, seed=3)
    split = state.clone()
    inputs = delta_inputs(L, HK, HV, DK, DV, seed=4)
    whole = ops.gated_delta_prefill(*inputs, state, 1)
    parts = torch.cat([ops.gated_delta_prefill(*(t[:70] for t in inputs), split, 1),
                       ops.gated_delta_prefill(*(t[70:] for t in inputs), split, 1)])
    assert_close(parts, whole.double(), DELTA_TOLERANCE)
    assert_close(split, state.double(), DELTA_TOLERANCE)
    if ops is KERNELS:
        assert torch.equal(parts, whole) and torch.equal(split, state)


def test_gated_delta_kernels_decode_a_token_as_prefill_does(kernels: RecurrentOps):
    HK, HV, DK, DV, L = 1, 2, 64, 48, 5
    state = delta_states(2, HV, DK, DV, seed=5)
    decoded = state.clone()
    inputs = delta_inputs(L, HK, HV, DK, DV, seed=6)
    prefilled = kernels.gated_delta_prefill(*inputs, state, 0)
    slot = torch.tensor([0])
    steps = torch.cat([kernels.gated_delta_decode(*(x[t:t + 1] for x in inputs), decoded, slot) for t in range(L)])
    assert torch.equal(steps, prefilled) and torch.equal(decoded, state)


def test_gated_delta_rule_is_transformers_qwen3_next(ops: RecurrentOps):
    # transformers scales the queries itself (by DK^-1/2) and takes [batch, T, heads, D].
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    HK, HV, DK, DV, L = 2, 4, 32, 24, 80
    state = delta_states(1, HV, DK, DV, seed=7)
    q, k, v, g, beta = delta_inputs(L, HK, HV, DK, DV, seed=8)
    hf = [q * DK ** 0.5, k, v, g, beta]
    hf = [t[None] for t in hf]
    for rule in (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule):
        want, left = rule(*hf, initial_state=state.clone(), output_final_state=True)
        ours = state.clone()
        out = ops.gated_delta_prefill(q, k, v, g, beta, ours, 0)
        assert_close(out, want[0].double(), DELTA_TOLERANCE)
        assert_close(ours, left.double(), DELTA_TOLERANCE)


@pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler")
def test_every_variant_gives_the_same_bits():
    # The same operations in every build (fused multiply-adds, prelude.h's exp): the generic build, the plain
    # reference, included.
    HK, HV, DK, DV, C, K, L = 1, 2, 24, 40, 37, 4, 9
    conv, delta = conv_problem(C, K, 1, seed=12), delta_inputs(L, HK, HV, DK, DV, seed=13)
    x = torch.randn(L, C, generator=torch.Generator().manual_seed(14))
    results = []
    before = native.current()
    try:
        for variant in native.runnable():
            native.select(variant.name)
            conv_state, delta_state = conv[2].clone(), delta_states(1, HV, DK, DV, seed=15)
            results.append([KERNELS.short_conv_prefill(x, conv_state, 0, *conv[:2], True), conv_state,
                            KERNELS.gated_delta_prefill(*delta, delta_state, 0), delta_state])
    finally:
        native.select(before)
    assert all(torch.equal(a, b) for result in results[1:] for a, b in zip(result, results[0], strict=True))


# ---- what the kernels serve


def test_kernels_refuse_what_they_do_not_serve(kernels: RecurrentOps):
    weight, b, state = conv_problem(8, 4, 2, seed=9)
    x = torch.randn(2, 8)
    slots = torch.tensor([0, 1])
    for args in [(x.bfloat16(), state, slots, weight),  # float32 only
                 (x, state.transpose(1, 2).contiguous().transpose(1, 2), slots, weight),  # a state not in place
                 (x, state, slots.int(), weight),
                 (x, state, slots, weight[:, :3])]:  # a width the state does not hold
        with pytest.raises(ValueError, match="recurrent kernel"):
            kernels.short_conv_decode(*args)
    with pytest.raises(ValueError, match="slot out of range"):
        kernels.short_conv_prefill(x, state, 2, weight)
    q, k, v, g, beta = delta_inputs(2, 2, 4, 16, 8, seed=10)
    S = delta_states(2, 4, 16, 8, seed=11)
    with pytest.raises(ValueError, match="slot out of range"):
        kernels.gated_delta_decode(q, k, v, g, beta, S, torch.tensor([0, 2]))
    for args in [(q, k, v[:, :3], g[:, :3], beta[:, :3], S[:, :3]),  # value heads not a multiple of key heads
                 (q, k, v, g, beta, S.double()),
                 (q, k[:, :, :8], v, g, beta, S)]:
        with pytest.raises(ValueError, match="recurrent kernel"):
            kernels.gated_delta_prefill(*args, 0)


def test_the_kernels_run_where_they_serve_and_torch_elsewhere(kernels: RecurrentOps):
    assert cpu_recurrent.ops(torch.device("cpu")) is kernels
    assert cpu_recurrent.ops(torch.device("cuda")) is TORCH
    before = native.current()
    native.select("torch")  # --cpu-kernels torch: no kernels in the process
    try:
        assert cpu_recurrent.ops(torch.device("cpu")) is TORCH
    finally:
        native.select(before)
