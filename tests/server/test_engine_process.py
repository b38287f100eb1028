"""`zhuzi serve` runs the step loop in an engine-core process of its own: when that process dies, the server
notices at once (/health 503, the streams in flight end with an error event) and exits 1 with a clear message.
With tensor parallelism, the ranks serve what one process computes, spawned by the engine core or started
torchrun-style, one `zhuzi serve` per rank."""
from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from server_process import ServerProcess, engine_pids, free_port, running_server
from test_lifecycle import stream_events

from zhuzi import LLM, SamplingParams
from zhuzi.engine.front.placement import EXIT_CODE_WAIT_S

pytestmark = pytest.mark.long  # a minute or more: handed out first (tests/conftest.py)

PROMPT = "The capital of France is"


def test_killing_the_engine_process_ends_the_streams_and_stops_the_server(tmp_path):
    with running_server(tmp_path / "server.log") as server:
        (pid,) = engine_pids(server).values()
        assert pid != server.proc.pid

        async def main() -> tuple[list[list[str]], list[int], float, float]:
            async with httpx.AsyncClient(timeout=60) as http:
                starts = [asyncio.Event() for _ in range(2)]
                streams = [asyncio.ensure_future(stream_events(http, server.url, started, max_tokens=2000))
                           for started in starts]
                await asyncio.gather(*(started.wait() for started in starts))
                round_trip = 0.0  # the slowest /health here and now, the streams running: the baseline
                for _ in range(5):
                    sent = time.monotonic()
                    await http.get(server.url + "/health")
                    round_trip = max(round_trip, time.monotonic() - sent)
                os.kill(pid, signal.SIGKILL)
                killed = time.monotonic()
                statuses = []
                while not statuses or statuses[-1] == 200:
                    statuses.append((await http.get(server.url + "/health")).status_code)
                noticed = time.monotonic() - killed
                return await asyncio.gather(*streams), statuses, noticed, round_trip

        events, statuses, noticed, round_trip = asyncio.run(main())
        print(f"\n/health said 503 {noticed * 1000:.0f} ms after the SIGKILL (round trip {round_trip * 1000:.0f} ms)")
        # at once: the reader's wait for the exit code, and a few /health round trips
        assert statuses[-1] == 503 and noticed < EXIT_CODE_WAIT_S + 10 * round_trip
        for stream in events:
            assert stream[-1] == "[DONE]"
            error = json.loads(stream[-2])["error"]
            assert error["code"] == 503 and f"(pid {pid}) was killed by SIGKILL" in error["message"]
        assert server.proc.wait(timeout=30) == 1
        assert f"zhuzi: the engine core process (pid {pid}) was killed by SIGKILL" in server.log.read_text()


def test_ranks_started_torchrun_style_serve_what_one_process_computes(tmp_path):
    """What the README says to run on each machine, here on one: `zhuzi serve` with RANK 1 follows, `zhuzi serve`
    with RANK 0 serves; the answer is TP=1's."""
    world = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    follower_env = {**os.environ, **world, "RANK": "1"}
    follower = subprocess.Popen([sys.executable, "-m", "zhuzi.cli", "serve", "--kv-cache-memory", "64MiB", *TP_ARGS],
                                env=follower_env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        with running_server(tmp_path / "rank0.log", *TP_ARGS, env={**world, "RANK": "0"}) as server:
            text = greedy_text(server)
        assert follower.wait(timeout=30) == 0  # rank 0 told it to stop
    finally:
        follower.kill()
    assert text == one_process_text()


def test_ranks_the_engine_core_spawns_serve_what_one_process_computes(tmp_path):
    """`zhuzi serve --tensor-parallel-size 2` on one machine: the engine-core process starts rank 1 itself."""
    with running_server(tmp_path / "tp.log", *TP_ARGS) as server:
        text = greedy_text(server)
        assert greedy_text(server) == text  # the ranks stay in step from one request to the next
    assert text == one_process_text()


TP_ARGS = ["--tensor-parallel-size", "2", "--dtype", "float32", "--num-threads", "1"]


def greedy_text(server: ServerProcess) -> str:
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]


@functools.cache
def one_process_text() -> str:
    llm = LLM(dtype="float32", kv_cache_memory="32MiB")
    return llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0].text
