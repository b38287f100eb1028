"""Paged attention's own paths against a dense float64 softmax: with a sliding window, decode rows and prompt
chunks read only their window, through the kernels and through torch (the path of CUDA, or of a CPU without
a compiler), with the slots of blocks already given back (-1) before each window."""
import pytest
import torch

from zhuzi.model import native
from zhuzi.model.attention import AttentionMetadata, PrefillChunk, paged_attention

CONTEXT, WINDOW, HEADS, KV_HEADS, DIM = 30, 7, 4, 2, 32


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: range, window: int) -> torch.Tensor:
    """Query i at positions[i] over keys positions[i] - window + 1 .. positions[i] of the whole sequence."""
    k, v = (x.double().repeat_interleave(HEADS // KV_HEADS, dim=1) for x in (k, v))
    keys = torch.arange(k.shape[0])[None, :]
    rows = torch.tensor(positions)[:, None]
    scores = torch.einsum("lhd,chd->hlc", q.double(), k) * DIM ** -0.5
    scores = scores.masked_fill((keys > rows) | (keys <= rows - window), float("-inf"))
    return torch.einsum("hlc,chd->lhd", torch.softmax(scores, dim=-1), v)


@pytest.mark.parametrize("path", ["kernels", "torch"])
def test_a_sliding_window_reads_only_its_positions_in_decode_rows_and_prompt_chunks(path):
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
        out = paged_attention(q[rows], k[rows], v[rows], cache[0], cache[1], meta, window=WINDOW)
    finally:
        native.select(before)
    expected = dense(q[rows], k, v, rows, WINDOW)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
