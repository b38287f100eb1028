"""Tensor-parallel ranks: how rank 0 (the engine) meets the others, and the others' loop (follow)."""
from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
from dataclasses import replace
from multiprocessing.process import BaseProcess

import torch

from zhuzi.config import EngineConfig
from zhuzi.engine.worker.model_runner import load_runner
from zhuzi.engine.worker.tp_control import FORWARD, STOP, StepChannel, unpack_step
from zhuzi.model.decoder import Decoder
from zhuzi.model.parallel import TPRank

log = logging.getLogger("zhuzi")
LOCALHOST = "127.0.0.1"


def torchrun_rank() -> int | None:
    """This process's RANK when it was started torchrun-style, else None."""
    return int(os.environ["RANK"]) if "RANK" in os.environ else None


def _torchrun_store() -> bool:
    """torchrun's agent already serves the rendezvous store at MASTER_ADDR:MASTER_PORT."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def _torchrun_group(config: EngineConfig) -> tuple[int, str, int]:
    world = int(os.environ.get("WORLD_SIZE", 0))
    if world != config.tensor_parallel_size:
        raise ValueError(f"WORLD_SIZE is {world or 'not set'} but --tensor-parallel-size is "
                         f"{config.tensor_parallel_size}")
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise ValueError(f"RANK is set but {' and '.join(missing)} not: set all four as torchrun does")
    return int(os.environ["RANK"]), os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOCALHOST, 0))
        return s.getsockname()[1]


def start(config: EngineConfig) -> tuple[TPRank | None, list[BaseProcess]]:
    """Join the group as rank 0: with the ranks started elsewhere torchrun-style, or with ranks spawned here.
    Returns the group and the local processes (none without tensor parallelism).

    On one machine the engine spawns ranks 1..N-1 itself. Across machines every rank is started the way
    torchrun starts one, with MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK in its environment (torchrun sets
    them; so can a user, one `zhuzi serve` per rank): rank 0 serves, the others run follow()."""
    world = config.tensor_parallel_size
    if world < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {world}")
    if world == 1:
        return None, []
    if torchrun_rank() is not None:
        rank, addr, port = _torchrun_group(config)
        if rank != 0:
            raise ValueError(f"RANK {rank} follows rank 0 and runs no engine of its own")
        log.info("tensor parallel: rank 0 of %d, waiting for the others at %s:%d", world, addr, port)
        return TPRank.join(0, world, addr, port, config.device, _torchrun_store()), []
    port = _free_port()
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_spawned, args=(config, rank, world, LOCALHOST, port), daemon=True,
                               name=f"tensor-parallel rank {rank}") for rank in range(1, world)]
    for worker in workers:
        worker.start()
    try:
        return TPRank.join(0, world, LOCALHOST, port, config.device), workers
    except BaseException:
        _end(workers)
        raise


def stop(tp: TPRank, channel: StepChannel, workers: list[BaseProcess]) -> None:
    """Tell the followers to stop (rank 0, through its runner's channel) and wait for the local ones."""
    channel.post(STOP)
    tp.close()
    _end(workers)


def _end(workers: list[BaseProcess]) -> None:
    for worker in workers:
        worker.join(10)
        if worker.is_alive():
            worker.kill()
            worker.join()


def _spawned(config: EngineConfig, rank: int, world: int, addr: str, port: int) -> None:
    """A rank spawned by rank 0, which decides when it ends (a terminal's Ctrl-C reaches every process)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    run(config, rank, world, addr, port)


def run(config: EngineConfig, rank: int, world: int, addr: str, port: int) -> None:
    """A follower's life: join, load this rank's slice, follow until rank 0 says stop."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s zhuzi.tp[{rank}]: %(message)s")
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = f"cuda:{local_rank}" if config.device == "cuda" else config.device
    tp = TPRank.join(rank, world, addr, port, device, _torchrun_store())
    _, runner = load_runner(replace(config, device=device), tp)
    log.info("rank %d of %d: %d of %d query heads, %d KV heads", rank, world, runner.model.num_heads,
             runner.model.config.num_heads, runner.model.num_kv_heads)
    follow(runner.model, runner.kv_cache, tp, runner.states)
    tp.close()


def run_torchrun_rank(config: EngineConfig) -> None:
    """`zhuzi serve` on a rank other than 0: follow rank 0, serve nothing."""
    rank, addr, port = _torchrun_group(config)
    run(config, rank, config.tensor_parallel_size, addr, port)


@torch.inference_mode()
def follow(model: Decoder, kv_cache: torch.Tensor, tp: TPRank, states: list[list[torch.Tensor]] | None = None) -> None:
    """A follower's loop: with its slice of the model and of the KV pool (and of a hybrid model's state pool), it
    runs each forward pass and LM-head call that rank 0's model runner posts (tp_control.py), until the stop; it
    schedules and samples nothing."""
    channel = StepChannel(tp)
    while True:
        op, payload = channel.next_op()
        if op == STOP:
            return
        if op == FORWARD:
            model.forward(*unpack_step(payload), kv_cache, None, states)
        else:
            model.logits(payload)
