"""What tensor parallelism adds to a decoder layer and what it saves, on this machine (`zhuzi bench scaling
--collectives`): two local gloo ranks of 1 thread time an all-reduce of one token's hidden state (a layer
pays two), against one layer's four matmuls for one token whole on one thread and rank 0's share under TP=2.
"""
from __future__ import annotations

import os
import socket
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zhuzi.model.linear import Linear

HIDDEN, INTERMEDIATE, HEAD_DIM, Q_HEADS, KV_HEADS = 576, 1536, 64, 9, 3  # SmolLM2-135M's layer
ITERATIONS = 2000


@dataclass
class CollectiveReport:
    all_reduce_bf16_p50_us: float
    all_reduce_bf16_mean_us: float
    all_reduce_fp32_p50_us: float
    all_reduce_fp32_mean_us: float
    layer_whole_us: float  # one token through one layer's matmuls, 1 thread
    layer_rank0_us: float  # rank 0's share of them under TP=2

    @property
    def saved_us(self) -> float:
        return self.layer_whole_us - self.layer_rank0_us

    @property
    def added_us(self) -> float:
        return 2 * self.all_reduce_bf16_p50_us


def _times_us(fn, iterations: int) -> list[float]:
    for _ in range(iterations // 10):
        fn()
    out = []
    for _ in range(iterations):
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1e6)
    return out


def _layer_us(q_heads: int, kv_heads: int, intermediate: int, iterations: int) -> float:
    """Median time of one token through QKV, O, gate/up and down of that size (bf16)."""
    dtype = torch.bfloat16
    x = torch.randn(1, HIDDEN, dtype=dtype)
    qkv = Linear(torch.randn((q_heads + 2 * kv_heads) * HEAD_DIM, HIDDEN, dtype=dtype))
    o = Linear(torch.randn(HIDDEN, q_heads * HEAD_DIM, dtype=dtype))
    gate_up = Linear(torch.randn(2 * intermediate, HIDDEN, dtype=dtype))
    down = Linear(torch.randn(HIDDEN, intermediate, dtype=dtype))

    def layer() -> None:
        o(qkv(x)[:, :q_heads * HEAD_DIM].contiguous())
        down(gate_up(x)[:, :intermediate].contiguous())

    return statistics.median(_times_us(layer, iterations))


def _rank(rank: int, port: int, iterations: int, results) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    timings = {}
    for dtype in (torch.bfloat16, torch.float32):
        vector = torch.randn(1, HIDDEN, dtype=dtype)
        dist.barrier()
        timings[str(dtype)] = _times_us(lambda v=vector: dist.all_reduce(v), iterations)
    dist.destroy_process_group()
    if rank == 0:
        results.put(timings)


def measure(iterations: int = ITERATIONS) -> CollectiveReport:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.Queue()
    procs = [context.Process(target=_rank, args=(rank, port, iterations, results)) for rank in range(2)]
    for p in procs:
        p.start()
    timings = results.get()
    for p in procs:
        p.join()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        whole = _layer_us(Q_HEADS, KV_HEADS, INTERMEDIATE, iterations)
        rank0 = _layer_us(6, 2, INTERMEDIATE // 2, iterations)
    finally:
        torch.set_num_threads(threads)
    bf16, fp32 = timings[str(torch.bfloat16)], timings[str(torch.float32)]
    return CollectiveReport(statistics.median(bf16), statistics.fmean(bf16), statistics.median(fp32),
                            statistics.fmean(fp32), whole, rank0)


def format_report(r: CollectiveReport) -> str:
    return "\n".join([
        f"all-reduce [1, {HIDDEN}] over 2 gloo ranks: bf16 p50 {r.all_reduce_bf16_p50_us:.0f} us "
        f"(mean {r.all_reduce_bf16_mean_us:.0f}), fp32 p50 {r.all_reduce_fp32_p50_us:.0f} us "
        f"(mean {r.all_reduce_fp32_mean_us:.0f})",
        f"one layer's matmuls (zhuzi's Linear), 1 token, bf16, 1 thread: whole {r.layer_whole_us:.0f} us, "
        f"rank 0's TP=2 share {r.layer_rank0_us:.0f} us",
        f"TP=2 per layer: saves {r.saved_us:.0f} us of compute, adds 2 all-reduces = {r.added_us:.0f} us (p50)",
    ])
