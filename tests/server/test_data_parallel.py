"""`zhuzi serve --data-parallel-size 2`, with the engine cores as local processes (mp) and as Ray actors (ray),
one thread each: a conversation's second turn lands where its history is cached, both replicas take work,
the metrics say which replica is which, and killing one replica fails only its requests while the other
keeps serving."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import tempfile
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_process import ServerProcess, engine_pids, running_server
from test_lifecycle import stream_events

# A Ray for this machine alone: on the loopback interface (Ray would take the first network interface).
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


@pytest.fixture(scope="module")
def ray_address():
    """One Ray cluster that this module's servers join (starting one costs 6-10 s here)."""
    import ray

    saved = {name: os.environ.get(name) for name in RAY_ENV}
    os.environ.update(RAY_ENV)
    directory = tempfile.mkdtemp(prefix="zr")  # short: Ray's sockets live under it (at most 107 bytes)
    context = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=100 * 2**20,
                       _temp_dir=directory)
    try:
        yield context.address_info["gcs_address"]
    finally:
        ray.shutdown()
        for pid in processes_mentioning(directory):  # Ray's agents may outlive its shutdown
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(directory, ignore_errors=True)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def processes_mentioning(text: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text in (entry / "cmdline").read_text():
                pids.append(int(entry.name))
        except OSError:
            pass
    return pids


def engine_metrics(server: ServerProcess) -> dict[tuple[str, str], float]:
    """(metric name, replica) -> value, for the engine's per-replica metrics."""
    text = httpx.get(server.url + "/metrics").text
    return {(s.name, s.labels["replica"]): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if "replica" in s.labels}


def chat(server: ServerProcess, messages: list[dict], max_tokens: int) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()


async def two_turns(server: ServerProcess, history: list[dict]) -> tuple[dict, dict]:
    """A conversation's first turn while replica 0 streams a long reply (so it goes to replica 1, the least
    loaded), then, both idle again, its second turn."""
    async with httpx.AsyncClient(timeout=120) as http:
        started = asyncio.Event()
        busy = asyncio.ensure_future(stream_events(http, server.url, started, max_tokens=2000))
        await started.wait()
        body = {"messages": history, "max_tokens": 40, "temperature": 0}
        first = (await http.post(server.url + "/v1/chat/completions", json=body)).json()
        busy.cancel()  # the client hangs up: its request is aborted
        await asyncio.gather(busy, return_exceptions=True)
        while any(value for (name, _), value in engine_metrics(server).items() if name == "zhuzi:num_requests_running"):
            await asyncio.sleep(0.05)
        history = history + [first["choices"][0]["message"], {"role": "user", "content": "And of Rome?"}]
        second = (await http.post(server.url + "/v1/chat/completions",
                                  json={"messages": history, "max_tokens": 8, "temperature": 0})).json()
        return first, second


@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_two_replicas_route_by_cached_prefix_and_survive_the_loss_of_one(backend, tmp_path, request):
    args, env = ["--data-parallel-size", "2", "--data-parallel-backend", backend], None
    if backend == "ray":
        args += ["--ray-address", request.getfixturevalue("ray_address")]
        env = RAY_ENV
    with running_server(tmp_path / "server.log", *args, env=env) as server:
        pids = engine_pids(server)
        assert sorted(pids) == [0, 1] and len({*pids.values(), server.proc.pid}) == 3

        # A conversation's next turn goes where its history is cached, though another replica is as idle (ties
        # go to replica 0): the first turn is made to land on replica 1 by keeping replica 0 busy meanwhile.
        history = [{"role": "user", "content": "Tell me about the history of Paris in three sentences."}]
        first, second = asyncio.run(two_turns(server, history))
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"] - 16
        hits = {replica: value for (name, replica), value in engine_metrics(server).items()
                if name == "zhuzi:prefix_cache_hits_total"}
        assert hits["1"] >= first["usage"]["prompt_tokens"] - 16 and hits["0"] == 0

        async def main() -> tuple[dict, list[list[str]], int, dict]:
            async with httpx.AsyncClient(timeout=120) as http:
                starts = [asyncio.Event() for _ in range(2)]
                streams = [asyncio.ensure_future(stream_events(
                    http, server.url, started, max_tokens=128,
                    messages=[{"role": "user", "content": f"Write a poem about the number {n}."}]))
                    for n, started in enumerate(starts)]
                await asyncio.gather(*(started.wait() for started in starts))
                busy = engine_metrics(server)  # both replicas took one of them
                os.kill(pids[1], signal.SIGKILL)
                events = await asyncio.gather(*streams)
                health = (await http.get(server.url + "/health")).status_code
                after = chat(server, [{"role": "user", "content": "Hi!"}], 4)
                return busy, events, health, after

        busy, events, health, after = asyncio.run(main())
        assert busy[("zhuzi:num_requests_running", "0")] == 1 and busy[("zhuzi:num_requests_running", "1")] == 1
        assert busy[("zhuzi:prefix_cache_queries_total", "1")] > 0
        assert all(stream[-1] == "[DONE]" for stream in events)
        ends = [json.loads(stream[-2]) for stream in events]
        errors = [end["error"]["message"] for end in ends if "error" in end]
        finished = [end["choices"][0]["finish_reason"] for end in ends if "choices" in end]
        assert len(errors) == 1 and "replica 1" in errors[0] and finished == ["length"], ends
        assert health == 200 and after["choices"][0]["finish_reason"] == "length"
        assert {replica for _, replica in engine_metrics(server)} == {"0"}  # the dead one left the rotation
