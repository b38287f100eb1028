"""`zhuzi serve --data-parallel-size 2`, with the engine cores as local processes (mp) and as Ray actors (ray),
one thread each: a conversation's second turn lands where its history is cached, both replicas take work,
the metrics say which replica is which, and killing one replica fails only its requests while the other
keeps serving. A prefill replica hands its prompts' KV to a decode replica, between processes and between Ray
actors (the router is the same for both backends; the Ray test checks what the actors add: start-up, the
hand-off's sockets across actors, and noticing a killed actor)."""
from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_process import ServerProcess, engine_pids, running_server
from test_lifecycle import stream_events

pytestmark = pytest.mark.long  # a minute or more: handed out first (tests/conftest.py)

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


def test_two_replicas_route_by_cached_prefix_and_survive_the_loss_of_one(tmp_path):
    with running_server(tmp_path / "server.log", "--data-parallel-size", "2") as server:
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


# ------------------------------------------------------------------ prefill/decode hand-offs (--kv-role)

PD_FLAGS = ["--dtype", "float32", "--data-parallel-size", "2", "--kv-role", "prefill,decode",
            "--max-local-prefill-tokens", "0"]
# A prefill replica that sends the first shipment of a prompt of several, then dies before the next
# (sitecustomize runs in every process; only a prefill replica sends shipments).
DIE_MID_TRANSFER = """
import os, signal, time
from zhuzi.engine.core.kv.transfer import ShipmentSockets
send = ShipmentSockets.send
def send_then_die(self, shipment):
    send(self, shipment)
    if not shipment.header.last:
        time.sleep(1.0)  # the shipment leaves the process
        os.kill(os.getpid(), signal.SIGKILL)
ShipmentSockets.send = send_then_die
"""
PROMPTS = {"short": 40, "handed": 300, "killed": 1000, "after": 500}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    import tiny

    directory = tmp_path_factory.mktemp("llama")
    tiny.build("llama", directory)
    return str(directory)


def prompt(n: int) -> list[int]:
    rng = random.Random(n)
    return [rng.randrange(3, 1000) for _ in range(n)]


@pytest.fixture(scope="module")
def alone(tiny_model: str) -> dict[str, str]:
    """What one engine, without any hand-off, writes for each prompt."""
    from zhuzi import LLM, SamplingParams

    outs = LLM(tiny_model, dtype="float32").generate([prompt(n) for n in PROMPTS.values()],
                                                    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    return {name: out.outputs[0].text for name, out in zip(PROMPTS, outs)}


def streamed_completion(server: ServerProcess, name: str) -> tuple[str, dict]:
    """The text of a streamed completion of one of PROMPTS, and its usage."""
    body = {"prompt": prompt(PROMPTS[name]), "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    text, usage = "", {}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                text += "".join(choice["text"] for choice in chunk["choices"])
                usage = chunk.get("usage") or usage
    return text, usage


def test_a_prefill_replica_hands_its_prompt_to_a_decode_replica_and_one_killed_mid_transfer_falls_back(
        tiny_model, alone, tmp_path):
    with running_server(tmp_path / "server.log", tiny_model, *PD_FLAGS, inject=DIE_MID_TRANSFER) as server:
        text, usage = streamed_completion(server, "handed")  # 18 pages: one shipment
        assert text == alone["handed"] and usage["prompt_tokens"] == 300
        assert usage["prompt_tokens_details"]["cached_tokens"] == 288  # the pages that came, as vLLM counts
        metrics = engine_metrics(server)
        assert metrics[("zhuzi:kv_transfers_sent_total", "0")] == 1
        assert metrics[("zhuzi:kv_transfers_received_total", "1")] == 1
        assert metrics[("zhuzi:kv_transfer_blocks_received_total", "1")] == 18

        text, usage = streamed_completion(server, "killed")  # 62 pages: the prefill replica dies after 32
        assert text == alone["killed"]
        metrics = engine_metrics(server)
        assert metrics[("zhuzi:kv_transfer_blocks_received_total", "1")] == 18 + 32
        assert metrics[("zhuzi:kv_transfers_failed_total", "1")] == 1
        assert usage["prompt_tokens_details"]["cached_tokens"] == 32 * 16  # the rest was computed there
        assert ("zhuzi:num_requests_running", "0") not in metrics  # the prefill replica left the rotation
        assert "given up after 32 pages" in server.log.read_text()
        assert streamed_completion(server, "after")[0] == alone["after"]  # the decode replica alone serves on


def test_a_hand_off_between_ray_actors(tiny_model, alone, tmp_path, ray_address):
    args = [tiny_model, *PD_FLAGS, "--data-parallel-backend", "ray", "--ray-address", ray_address]
    with running_server(tmp_path / "server.log", *args, env=RAY_ENV) as server:
        text, usage = streamed_completion(server, "handed")
        assert text == alone["handed"] and usage["prompt_tokens_details"]["cached_tokens"] == 288
        assert engine_metrics(server)[("zhuzi:kv_transfers_received_total", "1")] == 1
        assert streamed_completion(server, "short")[0] == alone["short"]  # 2 pages: handed off too (threshold 0)
        assert engine_metrics(server)[("zhuzi:kv_transfers_received_total", "1")] == 2
        os.kill(engine_pids(server)[0], signal.SIGKILL)  # the prefill actor dies: the decode one serves on alone
        killed = time.monotonic()
        while {replica for _, replica in engine_metrics(server)} != {"1"}:  # the dead one leaves the rotation
            assert time.monotonic() < killed + 30, "the killed Ray actor was never noticed"
            time.sleep(0.1)
        assert streamed_completion(server, "after")[0] == alone["after"]
