"""Many models behind one server (zhuzi/server/models.py): the ModelSet's rules on real engines in threads with a
hand-moved clock (keep-alive, eviction, one load for concurrent requests), and a real `zhuzi serve --models-dir`
of three names for the embedded SmolLM2 (links, not copies) and a split GGUF, through the openai and ollama
clients: each model answers, loads on demand (Ollama's timings count the load), unloads as Ollama asks without
loading first, is evicted while another streams without cutting the stream, and a killed model core fails only
its own requests and comes back on the next; and one with API keys, whose rate limits and quotas count a key's
requests to every model."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import openai
import psutil
import pytest
from clock import Clock
from server_process import ServerProcess, running_server
from tiny import linked

from zhuzi.catalog import Catalog
from zhuzi.config import EngineConfig, ParallelConfig
from zhuzi.engine.front.core_client import EngineCoreClient
from zhuzi.server.common.errors import ApiError
from zhuzi.server.common.gateway import GatewayError
from zhuzi.server.models import ModelSet, ModelSpec, ServedModel, seconds

KV = "16MiB"
NS = 1_000_000_000
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


class Started:
    """Real engine cores in threads of this process; counts the loads each model got."""

    def __init__(self) -> None:
        self.loads: dict[str, int] = {}

    def __call__(self, spec: ModelSpec) -> ServedModel:
        self.loads[spec.id] = self.loads.get(spec.id, 0) + 1
        config = EngineConfig(model=str(spec.path), kv_cache_memory=KV)
        return ServedModel.ready(spec.id, EngineCoreClient(config, ParallelConfig(engine_process=False)).start())


@pytest.fixture
def source(tmp_path: Path, smollm2_path: Path) -> dict[str, ModelSpec]:
    catalog = Catalog.scan([str(linked(tmp_path / "models", smollm2_path, ("a", "b", "c")))])
    return {entry.id: ModelSpec(entry.id, entry.paths, entry.size) for entry in catalog.entries()}


def test_keep_alive_durations() -> None:
    assert seconds("5m") == 300 and seconds("1h30m") == 5400 and seconds(10) == 10 and seconds("1.5s") == 1.5
    assert seconds("-1") is None and seconds(-1) is None and seconds(0) == 0 and seconds(None) == "default"
    with pytest.raises(ValueError, match="not a duration"):
        seconds("soon")


def test_concurrent_requests_load_a_model_once_and_keep_alive_unloads_it(source: dict[str, ModelSpec]) -> None:
    clock, started = Clock(), Started()
    models = ModelSet(source, started, keep_alive=300, clock=clock)

    async def run() -> None:
        first, second = await asyncio.gather(models.acquire("a"), models.acquire("a:latest"))
        assert first is second and first.state == "loaded" and started.loads == {"a": 1}
        models.release(first)
        clock.now += 1000
        models.expire()
        assert first.state == "loaded"  # held by the second request: its keep-alive has not begun
        models.release(second)
        clock.now += 299
        models.expire()
        assert first.state == "loaded"
        clock.now += 2
        models.expire()
        assert first.state == "unloaded"
        # A request's keep_alive: 0 unloads as it ends, negative keeps the model for ever
        models.release(await models.acquire("b", 0))
        assert models.models["b"].state == "unloaded"
        models.release(await models.acquire("b", None))
        clock.now += 10**9
        models.expire()
        assert models.models["b"].state == "loaded" and started.loads == {"a": 1, "b": 2}

    try:
        asyncio.run(run())
    finally:
        models.close()


def test_room_is_made_from_idle_models_least_recently_used_first(source: dict[str, ModelSpec]) -> None:
    clock, started = Clock(), Started()
    size = source["a"].size
    models = ModelSet(source, started, memory=2 * size + size // 2, clock=clock)

    async def run() -> None:
        a = await models.acquire("a")
        models.release(await models.acquire("b"))
        clock.now += 1
        models.release(await models.acquire("c"))  # b was idle: it goes, a runs on
        assert [models.models[m].state for m in "abc"] == ["loaded", "unloaded", "loaded"]
        c = await models.acquire("c")
        with pytest.raises(GatewayError) as refused:  # a and c both busy: nothing can make room
            await models.acquire("b")
        assert refused.value.status == 503 and refused.value.retry_after
        models.release(a)
        clock.now += 1
        models.release(c)
        models.release(await models.acquire("b"))  # a was used before c
        assert [models.models[m].state for m in "abc"] == ["unloaded", "loaded", "loaded"]
        with pytest.raises(ApiError) as missing:
            await models.acquire("d")
        assert missing.value.status == 404 and missing.value.code == "model_not_found"

    try:
        asyncio.run(run())
    finally:
        models.close()


def test_a_model_that_fails_to_load_fails_its_waiting_requests_and_says_why(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a GGUF file")
    started = Started()
    models = ModelSet({"broken": ModelSpec("broken", (broken,), 1)}, started)

    async def run() -> list[object]:
        return await asyncio.gather(models.acquire("broken"), models.acquire("broken"), return_exceptions=True)

    failures = asyncio.run(run())
    assert all(isinstance(f, ApiError) and f.status == 500 and "broken" in f.message for f in failures)
    model = models.models["broken"]
    assert model.state == "unloaded" and model.error and model.error in failures[0].message
    assert started.loads == {"broken": 1}


# ---------------------------------------------------------------- a real server


@pytest.fixture
def server(models_server: ServerProcess) -> ServerProcess:
    """conftest.py's server of many models, which the inspector's page tests share."""
    return models_server


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(api_key="none", base_url=server.api, max_retries=0, timeout=120)


def states(server: ServerProcess) -> dict[str, str]:
    return {card["id"]: card["state"] for card in server.get("/v1/models")["data"]}


def only_loaded(server: ServerProcess, *names: str) -> None:
    for name, state in states(server).items():
        if state == "loaded" and name not in names:
            server.post("/models/unload", {"model": name})
    for name in names:
        server.post("/models/load", {"model": name})
    assert {name for name, state in states(server).items() if state == "loaded"} == set(names)


def loads(server: ServerProcess, name: str) -> int:
    return server.log.read_text().count(f"model {name}: loading")


def test_each_model_answers_through_openai_and_ollama(server: ServerProcess, client: openai.OpenAI,
                                                     models_dir: Path, smollm2_path: Path) -> None:
    only_loaded(server)
    assert states(server) == {"a": "unloaded", "b": "unloaded", "c": "unloaded", "big": "unloaded"}
    disk = {name: smollm2_path.stat().st_size for name in "abc"}
    disk["big"] = sum(part.stat().st_size for part in models_dir.glob("big-*-of-00002.gguf"))  # both parts
    memory = {card["id"]: card["memory"] for card in server.get("/v1/models")["data"]}
    assert memory == {name: size + 64 * 2**20 for name, size in disk.items()}  # each with its KV pool
    tags = {m["name"]: m["size"] for m in server.get("/api/tags")["models"]}
    assert tags == {f"{name}:latest": size for name, size in disk.items()}
    answer = client.chat.completions.create(model="a", messages=CHAT, max_tokens=8, temperature=0)
    assert answer.model == "a" and answer.choices[0].message.content
    reply = ollama.Client(host=server.url).chat(model="b", messages=CHAT, options={"num_predict": 8,
                                                                                  "temperature": 0})
    assert reply.message.content == answer.choices[0].message.content  # the same file, greedy
    load = float(re.findall(r"model b loaded in ([\d.]+) s", server.log.read_text())[-1])
    assert reply.load_duration >= (load - 0.001) * NS and reply.total_duration > reply.load_duration  # b's load
    assert states(server) == {"a": "loaded", "b": "loaded", "c": "unloaded", "big": "unloaded"}
    running = ollama.Client(host=server.url).ps().models
    assert {m.model for m in running} == {"a:latest", "b:latest"} and all(m.expires_at.year < 9999 for m in running)
    assert set(server.get("/health")["models"]) == {"a", "b"}
    assert 'model_name="b"' in httpx.get(server.url + "/metrics").text
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="d", messages=CHAT, max_tokens=1)
    assert missing.value.code == "model_not_found"
    with pytest.raises(ollama.ResponseError, match='model "d" not found'):
        ollama.Client(host=server.url).chat(model="d", messages=CHAT)


def test_an_empty_ollama_request_with_keep_alive_0_unloads_and_never_loads(server: ServerProcess) -> None:
    only_loaded(server, "a", "b")  # as the test before left them
    before = loads(server, "c")
    assert ollama.Client(host=server.url).generate(model="c", keep_alive=0).done_reason == "unload"
    assert states(server)["c"] == "unloaded" and loads(server, "c") == before
    assert ollama.Client(host=server.url).chat(model="a", messages=[], keep_alive="0s").done_reason == "unload"
    assert states(server) == {"a": "unloaded", "b": "loaded", "c": "unloaded", "big": "unloaded"}
    deadline = time.monotonic() + 30
    while encoders(server) != 1 and time.monotonic() < deadline:  # an unloaded model's helper ends with it
        time.sleep(0.1)
    assert encoders(server) == 1


def encoders(server: ServerProcess) -> int:
    """The tokenizer helper processes the server runs: one per loaded model."""
    children = psutil.Process(server.proc.pid).children(recursive=True)
    return sum(any("encoder_process.py" in arg for arg in child.cmdline()) for child in children
               if child.status() != psutil.STATUS_ZOMBIE)


def test_a_look_at_a_model_loads_none(server: ServerProcess) -> None:
    """The inspector's views read a loaded model's engine; one not loaded is a 503 that loads nothing."""
    only_loaded(server, "b")
    before = loads(server, "c")
    assert server.get("/inspect/engine?steps=0&model=b")["model"]["name"] == "b"
    looked = httpx.get(server.url + "/inspect/batch?steps=0&model=c")
    assert looked.status_code == 503 and looked.json()["error"]["code"] == "model_not_loaded"
    assert httpx.get(server.url + "/inspect/engine?model=d").status_code == 404
    assert loads(server, "c") == before and states(server)["c"] == "unloaded"


def test_concurrent_first_requests_load_a_model_once(server: ServerProcess, client: openai.OpenAI) -> None:
    server.post("/models/unload", {"model": "c"})  # a and b, loaded or not, stay: c's load makes its own room
    before = loads(server, "c")
    answers: list[str | None] = []

    def ask() -> None:
        answers.append(client.completions.create(model="c", prompt="Paris is", max_tokens=4,
                                                 temperature=0).choices[0].text)

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(answers) == 2 and answers[0] == answers[1] and loads(server, "c") == before + 1


def test_eviction_never_cuts_a_stream(server: ServerProcess, client: openai.OpenAI) -> None:
    only_loaded(server, "b", "c")  # room for two: a's load must evict c (idle), never b (streaming, used first)
    stream = client.chat.completions.create(model="b", messages=CHAT, max_tokens=64, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    chunks = iter(stream)
    text = next(chunks).choices[0].delta.content or ""
    client.completions.create(model="a", prompt="Paris is", max_tokens=2)
    assert states(server) == {"a": "loaded", "b": "loaded", "c": "unloaded", "big": "unloaded"}
    finish = None
    for chunk in chunks:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "length" and text


def test_a_killed_model_core_fails_only_its_requests(server: ServerProcess, client: openai.OpenAI) -> None:
    only_loaded(server, "a", "b")
    log = server.log.read_text()
    after_a = log[log.rindex("model a: loading"):]
    pid = int(re.search(r"engine core 0 ready: pid (\d+)", after_a)[1])
    stream = iter(client.chat.completions.create(model="a", messages=CHAT, max_tokens=64, stream=True,
                                                 extra_body={"ignore_eos": True}))
    next(stream)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(openai.APIError):
        for _ in stream:
            pass
    assert client.completions.create(model="b", prompt="Paris is", max_tokens=2).choices[0].text
    assert client.completions.create(model="a", prompt="Paris is", max_tokens=2).choices[0].text  # restarted
    assert server.get("/health")["models"]


# ---------------------------------------------------------------- the gateway across models

QUOTA, RATE = "sk-quota-3e8f1a", "sk-rate-c42d90"


@pytest.fixture(scope="module")
def keyed(models_dir: Path) -> Iterator[ServerProcess]:
    """Two keys, each allowed 2 requests a minute; QUOTA 4 tokens a day. Its engines run in threads, small."""
    with running_server(models_dir.parent / "keyed.log", "--models-dir", str(models_dir), "--api-key", QUOTA,
                        "--api-key", RATE, "--rate-limit-rpm", "2", "--quota-tokens-per-day", f"{QUOTA}=4",
                        "--no-engine-process", "--kv-cache-memory", "4MiB") as running:
        yield running


def test_a_keys_rate_limit_and_quota_count_its_requests_to_every_model(keyed: ServerProcess) -> None:
    def ask(key: str, model: str) -> httpx.Response:
        return httpx.post(keyed.api + "/completions", json={"model": model, "prompt": "Paris is", "max_tokens": 2},
                          headers={"Authorization": f"Bearer {key}"}, timeout=120)

    assert ask(QUOTA, "a").status_code == 200  # its prompt and reply spend the quota
    over = ask(QUOTA, "b")
    assert over.status_code == 429 and over.json()["error"]["code"] == "insufficient_quota"
    assert ask(RATE, "a").status_code == ask(RATE, "a").status_code == 200
    limited = ask(RATE, "b")
    assert limited.status_code == 429 and limited.json()["error"]["code"] == "rate_limit_exceeded"
    assert loads(keyed, "a") == 1 and loads(keyed, "b") == 0  # neither refusal loaded b
