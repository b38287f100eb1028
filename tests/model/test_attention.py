"""Paged attention's own paths against a dense float64 softmax: with a sliding window, decode rows and prompt
chunks read only their window, through the kernels and through torch (the path of CUDA, or of a CPU without
a compiler), with the slots of blocks already given back (-1) before each window, with and without attention
sinks. And the backend each model gets, chosen once from what the kernels serve."""
import pytest
import torch

from zhuzi.model import native
from zhuzi.model.attention import AttentionBackend, AttentionMetadata, PrefillChunk, paged_attention, select
from zhuzi.model.kv_format import Q8_0

CONTEXT, WINDOW, HEADS, KV_HEADS, DIM = 30, 7, 4, 2, 32


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: range, window: int,
          sinks: torch.Tensor | None) -> torch.Tensor:
    """Query i at positions[i] over keys positions[i] - window + 1 .. positions[i] of the whole sequence; a sink
    is one more logit per head in the softmax, whose probability is dropped (transformers' gpt-oss)."""
    k, v = (x.double().repeat_interleave(HEADS // KV_HEADS, dim=1) for x in (k, v))
    keys = torch.arange(k.shape[0])[None, :]
    rows = torch.tensor(positions)[:, None]
    scores = torch.einsum("lhd,chd->hlc", q.double(), k) * DIM ** -0.5
    scores = scores.masked_fill((keys > rows) | (keys <= rows - window), float("-inf"))
    if sinks is None:
        return torch.einsum("hlc,chd->lhd", torch.softmax(scores, dim=-1), v)
    with_sinks = torch.cat([scores, sinks.double()[:, None, None].expand(-1, len(positions), 1)], -1)
    return torch.einsum("hlc,chd->lhd", torch.softmax(with_sinks, dim=-1)[..., :-1], v)


@pytest.mark.parametrize("sinks", [None, torch.tensor([2.0, -1.0, 0.5, 4.0])], ids=["", "sinks"])
@pytest.mark.parametrize("path", ["kernels", "torch"])
def test_a_sliding_window_reads_only_its_positions_in_decode_rows_and_prompt_chunks(path, sinks):
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(CONTEXT, KV_HEADS, DIM, generator=g), torch.randn(CONTEXT, KV_HEADS, DIM, generator=g)
    q = 3 * torch.randn(CONTEXT, HEADS, DIM, generator=g)
    slots = torch.randperm(64, generator=g)[:CONTEXT]
    cache = [torch.full((64, KV_HEADS, DIM), float("nan")) for _ in range(2)]  # a slot never written is NaN
    cache[0][slots], cache[1][slots] = k, v
    chunk = range(20, CONTEXT)  # a prompt chunk at 20 .. 29 beside a decode row at 29
    decode_slots = slots.clone()[None, :]
    decode_slots[0, :CONTEXT - WINDOW] = -1
    chunk_slots = slots.clone()
    chunk_slots[:chunk.start - WINDOW + 1] = -1
    rows = [CONTEXT - 1, *chunk]
    meta = AttentionMetadata(slots[rows], 1, decode_slots, torch.tensor([CONTEXT]),
                             [PrefillChunk(1, len(chunk), CONTEXT, chunk_slots)])
    before = native.current()
    native.select("torch" if path == "torch" else before)
    try:
        out = paged_attention(q[rows], k[rows], v[rows], cache[0], cache[1], meta, window=WINDOW, sinks=sinks)
    finally:
        native.select(before)
    expected = dense(q[rows], k, v, rows, WINDOW, sinks)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


KERNELS = pytest.mark.skipif(native.current() == "torch" or native.compiler() is None, reason="no kernels here")


@KERNELS
def test_the_backend_is_what_the_kernels_serve():
    v = native.current()
    kernels = AttentionBackend("kernel", "kernel")
    assert select("cpu", torch.bfloat16, torch.bfloat16, 4, 2, 64, True, v) == kernels
    assert select("cpu", torch.float32, Q8_0, 4, 2, 64, True, v) == kernels
    # a float32 pool is the reference, and --deterministic asks for it: prompts as decode rows
    assert select("cpu", torch.float32, torch.float32, 4, 2, 64, True, v) == AttentionBackend("kernel", "decode kernel")
    assert select("cpu", torch.bfloat16, torch.bfloat16, 4, 2, 64, False, v).prefill == "decode kernel"
    # what no kernel serves: bf16 queries over a float32 pool, a head size it was not built for
    torch_only = AttentionBackend("torch", "torch")
    assert select("cpu", torch.bfloat16, torch.float32, 4, 2, 64, True, v) == torch_only
    assert select("cpu", torch.float32, torch.float32, 4, 2, 48, True, v) == torch_only


def test_without_kernels_or_off_the_cpu_torch_attends():
    torch_only = AttentionBackend("torch", "torch")
    assert select("cuda", torch.bfloat16, torch.bfloat16, 4, 2, 64, True, native.current()) == torch_only
    assert select("cpu", torch.bfloat16, torch.bfloat16, 4, 2, 64, True, "torch") == torch_only


@KERNELS
@pytest.mark.parametrize("pool", [torch.bfloat16, Q8_0], ids=["bf16", "q8_0"])
def test_the_gpus_path_attends_as_the_cpu_kernels_do(pool):
    """The torch path (a GPU's: pages gathered, SDPA with GQA), run on CPU tensors, against the CPU kernels over the
    same bf16 or q8_0 pool: decode rows and a prompt chunk over a cached prefix, float32 queries."""
    from zhuzi.model.kv_format import head_width, to_pool
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(CONTEXT, KV_HEADS, DIM, generator=g), torch.randn(CONTEXT, KV_HEADS, DIM, generator=g)
    q = torch.randn(CONTEXT, HEADS, DIM, generator=g)
    slots = torch.randperm(64, generator=g)[:CONTEXT]
    cache = [torch.zeros(64, KV_HEADS, head_width(DIM, pool), dtype=pool) for _ in range(2)]
    cache[0][slots[:20]], cache[1][slots[:20]] = to_pool(k[:20], pool), to_pool(v[:20], pool)  # a cached prefix
    rows = [19, 12, *range(20, CONTEXT)]  # two decode rows (contexts of 20 and 13), a chunk at 20 .. 29
    meta = AttentionMetadata(slots[rows], 2, torch.stack([slots[:20], slots[:20]]), torch.tensor([20, 13]),
                             [PrefillChunk(2, CONTEXT - 20, CONTEXT, slots)])
    outs = []
    for path in ("kernels", "torch"):
        before = native.current()
        native.select("torch" if path == "torch" else before)
        try:
            pools = [c.clone() for c in cache]
            outs.append(paged_attention(q[rows], k[rows], v[rows], *pools, meta))
        finally:
            native.select(before)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
