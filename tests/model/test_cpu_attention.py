"""The CPU attention kernels against a float64 softmax over the gathered rows, under every CPU variant this
machine runs: decode rows, and the prefill kernel for prompt chunks; float32 queries over bf16 pools too (dtype
auto without native bf16); attention sinks (gpt-oss) in both."""
import pytest
import torch

from zhuzi.model.cpu_attention import (
    decode_serves,
    paged_decode_attention,
    paged_prefill_attention,
    prefill_serves,
)
from zhuzi.model.kv_format import dequantize_q8_0, quantize_q8_0

pytestmark = [pytest.mark.usefixtures("variant"), pytest.mark.long]

TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5),
             # the output is rounded to bf16 once: half an ulp (2^-9) plus float32 noise
             torch.bfloat16: dict(rtol=2 ** -8, atol=1e-5)}
# (queries, pools): the same dtype, or float32 queries over a bf16 pool
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)]


def with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """[heads, ..., keys] probabilities of a softmax whose denominator has each head's sink logit too."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.double().view(-1, *[1] * (scores.dim() - 1)).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], -1), dim=-1)[..., :-1]


def reference(q, k_cache, v_cache, slots, lengths, scale, window=None, sinks=None):
    group = q.shape[1] // k_cache.shape[1]
    valid = torch.arange(slots.shape[1])[None, :] < lengths[:, None]  # [B, W]
    if window:
        valid &= torch.arange(slots.shape[1])[None, :] >= lengths[:, None] - window
    rows = valid[:, :, None, None]
    k = torch.where(rows, k_cache[slots].double(), 0).repeat_interleave(group, dim=2)  # [B, W, heads, dim]
    v = torch.where(rows, v_cache[slots].double(), 0).repeat_interleave(group, dim=2)
    scores = torch.einsum("bhd,bwhd->hbw", q.double(), k) * scale
    p = with_sinks(scores.masked_fill(~valid[None], float("-inf")), sinks)
    return torch.einsum("hbw,bwhd->bhd", p, v)


def make_batch(batch, width, heads, kv_heads, dim, dtype, seed=0, kv_dtype=None):
    """A pool whose live slots are scattered and shared between rows; padding points at NaN slots."""
    g = torch.Generator().manual_seed(seed)
    live, poison = 3 * width, 16
    k_cache = torch.randn(live + poison, kv_heads, dim, generator=g).to(kv_dtype or dtype)
    v_cache = torch.randn(live + poison, kv_heads, dim, generator=g).to(kv_dtype or dtype)
    k_cache[live:], v_cache[live:] = float("nan"), float("nan")
    q = (3 * torch.randn(batch, heads, dim, generator=g)).to(dtype)  # peaked softmaxes too
    lengths = torch.randint(1, width + 1, (batch,), generator=g)
    lengths[: min(batch, 4)] = torch.tensor([1, width, 32, 33])[: min(batch, 4)]  # ends and a tile edge
    slots = torch.randint(0, live, (batch, width), generator=g)
    pad = torch.arange(width)[None, :] >= lengths[:, None]
    slots[pad] = torch.randint(live, live + poison, (int(pad.sum()),), generator=g)
    return q, k_cache, v_cache, slots, lengths


@pytest.mark.parametrize("dtype,kv_dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 64), (9, 3, 64), (8, 2, 128), (4, 1, 32)])
@pytest.mark.parametrize("batch", [1, 70])
def test_matches_float64_reference(dtype, kv_dtype, heads, kv_heads, dim, batch):
    args = make_batch(batch, 75, heads, kv_heads, dim, dtype, kv_dtype=kv_dtype)
    out = paged_decode_attention(*args, scale=dim ** -0.5)
    assert out.dtype == dtype and out.shape == (batch, heads, dim)
    torch.testing.assert_close(out.double(), reference(*args, scale=dim ** -0.5), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype,kv_dtype", DTYPES)
def test_long_context(dtype, kv_dtype):
    args = make_batch(3, 3000, 9, 3, 64, dtype, kv_dtype=kv_dtype)
    torch.testing.assert_close(paged_decode_attention(*args, scale=0.125).double(),
                               reference(*args, scale=0.125), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype,kv_dtype", DTYPES)
def test_row_is_bitwise_the_same_alone_or_in_any_batch(dtype, kv_dtype):
    q, k_cache, v_cache, slots, lengths = make_batch(70, 300, 9, 3, 64, dtype, kv_dtype=kv_dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the batch split between threads (make test runs torch on one thread a worker)
    try:
        batched = paged_decode_attention(q, k_cache, v_cache, slots, lengths, 0.125)
        torch.set_num_threads(1)
        for b in (0, 1, 5, 69):
            n = int(lengths[b])
            alone = paged_decode_attention(q[b:b + 1], k_cache, v_cache, slots[b:b + 1, :n], lengths[b:b + 1], 0.125)
            assert torch.equal(alone[0], batched[b])
    finally:
        torch.set_num_threads(threads)


def test_declines_what_it_was_not_built_for():
    assert decode_serves(torch.float32, torch.float32, 4, 2, 64)
    for dtype, kv_dtype, dim in [(torch.float16, torch.float16, 64), (torch.bfloat16, torch.float32, 64),
                                 (torch.float32, torch.float32, 48)]:
        assert not decode_serves(dtype, kv_dtype, 4, 2, dim)
        q, k_cache, v_cache, slots, lengths = make_batch(2, 10, 4, 2, dim, dtype, kv_dtype=kv_dtype)
        with pytest.raises(ValueError):
            paged_decode_attention(q, k_cache, v_cache, slots, lengths, 0.125)


def test_rejects_slots_outside_the_pool():
    q, k_cache, v_cache, slots, lengths = make_batch(2, 10, 4, 2, 64, torch.float32)
    slots[1, 0] = k_cache.shape[0]
    with pytest.raises(IndexError):
        paged_decode_attention(q, k_cache, v_cache, slots, lengths, 0.125)


def causal_reference(q, k_cache, v_cache, slots, scale, window=None, sinks=None):
    """q: [L, heads, dim] at positions context - L ..; slots: [context]."""
    length, context, group = q.shape[0], slots.shape[0], q.shape[1] // k_cache.shape[1]
    k = k_cache[slots].double().repeat_interleave(group, dim=1)  # [context, heads, dim]
    v = v_cache[slots].double().repeat_interleave(group, dim=1)
    scores = torch.einsum("lhd,chd->hlc", q.double(), k) * scale
    late = torch.arange(context)[None, :] > torch.arange(context - length, context)[:, None]
    if window:
        late |= torch.arange(context)[None, :] <= torch.arange(context - length, context)[:, None] - window
    return torch.einsum("hlc,chd->lhd", with_sinks(scores.masked_fill(late, float("-inf")), sinks), v)


def make_chunk(length, context, heads, kv_heads, dim, seed=0, dtype=torch.bfloat16):
    """Queries of a chunk (dtype) and a bf16 pool whose history slots are scattered; other slots hold NaN."""
    g = torch.Generator().manual_seed(seed)
    pool = 2 * context + 16
    k_cache = torch.full((pool, kv_heads, dim), float("nan")).bfloat16()
    v_cache = k_cache.clone()
    slots = torch.randperm(pool, generator=g)[:context]
    k_cache[slots] = torch.randn(context, kv_heads, dim, generator=g).bfloat16()
    v_cache[slots] = torch.randn(context, kv_heads, dim, generator=g).bfloat16()
    q = (3 * torch.randn(length, heads, dim, generator=g)).to(dtype)  # peaked softmaxes too
    return q, k_cache, v_cache, slots


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("length,context", [(1, 1), (1, 40), (16, 16), (17, 50), (100, 100), (45, 700)])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 32), (8, 2, 128), (2, 1, 96)])
def test_prefill_matches_the_float64_causal_reference(length, context, heads, kv_heads, dim, dtype):
    q, k_cache, v_cache, slots = make_chunk(length, context, heads, kv_heads, dim, dtype=dtype)
    out = paged_prefill_attention(q, k_cache, v_cache, slots, dim ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    expected = causal_reference(q, k_cache, v_cache, slots, dim ** -0.5)
    # bf16 with AVX512-BF16: probabilities meet V as bf16 (2^-9 of each weight) and the output is rounded
    # once (2^-9 of it); float32 math otherwise, with a bf16 output's one rounding
    bound = 2 ** -9 * v_cache[slots].double().abs().max() + 2 ** -8 * expected.abs() + 1e-5
    if dtype == torch.float32:
        bound = 1e-5 * (1 + expected.abs())
    assert ((out.double() - expected).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_query_gets_the_same_bits_however_its_prompt_is_chunked(dtype):
    """Each query's arithmetic depends only on its position and history, never on the chunk around it."""
    q, k_cache, v_cache, slots = make_chunk(300, 300, 9, 3, 64, dtype=dtype)
    whole = paged_prefill_attention(q, k_cache, v_cache, slots, 0.125)
    for start, end in [(0, 23), (23, 64), (64, 65), (65, 300)]:
        part = paged_prefill_attention(q[start:end], k_cache, v_cache, slots[:end], 0.125)
        assert torch.equal(part, whole[start:end])


@pytest.mark.parametrize("dtype,kv_dtype", DTYPES)
@pytest.mark.parametrize("window", [1, 8, 40])
def test_decode_reads_only_the_sliding_window(dtype, kv_dtype, window):
    """A row attends its last `window` positions; the slots before (blocks given back: -1) are never read."""
    q, k_cache, v_cache, slots, lengths = make_batch(20, 75, 9, 3, 64, dtype, kv_dtype=kv_dtype)
    expected = reference(q, k_cache, v_cache, slots, lengths, 0.125, window)
    slots[torch.arange(75)[None, :] < lengths[:, None] - window] = -1
    out = paged_decode_attention(q, k_cache, v_cache, slots, lengths, 0.125, window)
    torch.testing.assert_close(out.double(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("length,context,window", [(1, 40, 8), (17, 50, 5), (100, 100, 24), (45, 700, 33),
                                                   (40, 40, 100)])
def test_prefill_reads_only_the_sliding_window(length, context, window, dtype):
    q, k_cache, v_cache, slots = make_chunk(length, context, 9, 3, 64, dtype=dtype)
    expected = causal_reference(q, k_cache, v_cache, slots, 0.125, window)
    bound = 2 ** -9 * v_cache[slots].double().abs().max() + 2 ** -8 * expected.abs() + 1e-5
    slots[:max(0, context - length - window + 1)] = -1  # before the first query's window: given back
    out = paged_prefill_attention(q, k_cache, v_cache, slots, 0.125, window)
    if dtype == torch.float32:
        bound = 1e-5 * (1 + expected.abs())
    assert ((out.double() - expected).abs() <= bound).all()


@pytest.mark.parametrize("dtype,kv_dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 8])
def test_decode_sinks_join_each_heads_softmax_denominator(dtype, kv_dtype, window):
    q, k_cache, v_cache, slots, lengths = make_batch(20, 75, 9, 3, 64, dtype, kv_dtype=kv_dtype)
    sinks = 2 * torch.randn(9, generator=torch.Generator().manual_seed(1))
    out = paged_decode_attention(q, k_cache, v_cache, slots, lengths, 0.125, window, sinks)
    expected = reference(q, k_cache, v_cache, slots, lengths, 0.125, window, sinks)
    torch.testing.assert_close(out.double(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("length,context,window", [(17, 50, None), (45, 300, 33)])
def test_prefill_sinks_join_each_heads_softmax_denominator(length, context, window, dtype):
    q, k_cache, v_cache, slots = make_chunk(length, context, 9, 3, 64, dtype=dtype)
    sinks = 2 * torch.randn(9, generator=torch.Generator().manual_seed(1))
    out = paged_prefill_attention(q, k_cache, v_cache, slots, 0.125, window, sinks)
    expected = causal_reference(q, k_cache, v_cache, slots, 0.125, window, sinks)
    bound = 2 ** -9 * v_cache[slots].double().abs().max() + 2 ** -8 * expected.abs() + 1e-5
    if dtype == torch.float32:
        bound = 1e-5 * (1 + expected.abs())
    assert ((out.double() - expected).abs() <= bound).all()


def test_prefill_declines_what_it_was_not_built_for():
    assert prefill_serves(torch.bfloat16, torch.bfloat16, 4, 2, 64)
    assert not prefill_serves(torch.float32, torch.float32, 4, 2, 64)  # fp32: the reference, as decode rows
    assert not prefill_serves(torch.bfloat16, torch.bfloat16, 4, 2, 48)
    q, k_cache, v_cache, slots = make_chunk(4, 10, 4, 2, 64)
    with pytest.raises(ValueError):
        paged_prefill_attention(q.float(), k_cache.float(), v_cache.float(), slots, 0.125)
    q, k_cache, v_cache, slots = make_chunk(4, 10, 4, 2, 48)
    with pytest.raises(ValueError):
        paged_prefill_attention(q, k_cache, v_cache, slots, 0.125)


def test_prefill_rejects_slots_outside_the_pool():
    q, k_cache, v_cache, slots = make_chunk(4, 10, 4, 2, 64)
    slots[3] = k_cache.shape[0]
    with pytest.raises(IndexError):
        paged_prefill_attention(q, k_cache, v_cache, slots, 0.125)


def q8_pools(k_cache, v_cache):
    """The pools in q8_0 (a NaN row gets a NaN scale, so reading a padding slot still shows)."""
    return quantize_q8_0(k_cache), quantize_q8_0(v_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128), (4, 4, 32)])
def test_q8_0_pools_match_the_float64_reference_over_their_values(dtype, heads, kv_heads, dim):
    q, k_cache, v_cache, slots, lengths = make_batch(70, 75, heads, kv_heads, dim, dtype, kv_dtype=torch.float32)
    k8, v8 = q8_pools(k_cache, v_cache)
    out = paged_decode_attention(q, k8, v8, slots, lengths, dim ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    expected = reference(q, dequantize_q8_0(k8), dequantize_q8_0(v8), slots, lengths, dim ** -0.5)
    torch.testing.assert_close(out.double(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length,context", [(1, 40), (17, 50), (45, 300)])
def test_q8_0_prefill_matches_the_float64_causal_reference(dtype, length, context):
    q, k_cache, v_cache, slots = make_chunk(length, context, 9, 3, 64, dtype=dtype)
    k8, v8 = q8_pools(k_cache.float(), v_cache.float())
    out = paged_prefill_attention(q, k8, v8, slots, 0.125)
    expected = causal_reference(q, dequantize_q8_0(k8), dequantize_q8_0(v8), slots, 0.125)
    torch.testing.assert_close(out.double(), expected, **TOLERANCE[dtype])
