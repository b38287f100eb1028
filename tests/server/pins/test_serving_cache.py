"""/v1/cache/pins and the KV tiers over HTTP (one `zhuzi serve` with a host and a disk tier, the engine core in
its own process): a pinned system prompt is found cached by the chats that begin with it, /metrics and the
inspector's engine view show pins and tiers, bad pins get OpenAI's error object, and after a kill -9 of every
process the restarted server loads a long system prompt from disk instead of computing it."""
from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_process import ServerProcess, engine_pids, running_server

PAGE_BYTES = 16 * 23040  # SmolLM2 in bf16: 23,040 bytes of K/V a token
SYSTEM = [{"role": "system", "content": "You answer questions about the weather in the north of Scotland. " * 12}]
QUESTION = [{"role": "user", "content": "Will it rain tomorrow?"}]
RULES = " ".join(f"Rule {n}: answer in plain words, cite the source, never guess a number." for n in range(20))
LONG_SYSTEM = [{"role": "system", "content": RULES}]


def flags(folder: Path) -> list[str]:
    return ["--kv-offload-dir", str(folder), "--kv-offload-memory", "64MiB", "--kv-pinned-memory", "16MiB"]


@pytest.fixture(scope="module")
def kv_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kv")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, kv_folder: Path) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory.mktemp("serve") / "server.log", *flags(kv_folder)) as running:
        yield running


def api(server: ServerProcess) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=300)


def chat(server: ServerProcess, messages: list[dict]) -> dict:
    body = {"messages": messages, "max_tokens": 4, "temperature": 0}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300).json()


def engine_metrics(server: ServerProcess) -> dict[tuple[str, str], float]:
    """(metric name, tier or "") -> value, replica 0's."""
    text = api(server).get("/metrics").text
    return {(s.name, s.labels.get("tier", "")): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.labels.get("replica") == "0"}


def test_a_pinned_system_prompt_is_found_by_the_chats_that_begin_with_it(server):
    answer = api(server).post("/v1/cache/pins", json={"name": "weather", "messages": SYSTEM, "ttl": 600})
    pin = answer.json()
    assert answer.status_code == 200, pin
    assert pin["object"] == "cache.pin" and pin["name"] == "weather" and pin["num_tokens"] >= 128
    assert pin["num_tokens"] == 16 * pin["num_blocks"] and pin["bytes"] == pin["num_blocks"] * PAGE_BYTES
    assert pin["expires_at"] - pin["created_at"] in (599, 600, 601)
    listing = api(server).get("/v1/cache/pins").json()
    assert listing["object"] == "list" and [p["name"] for p in listing["data"]] == ["weather"]

    reply = chat(server, SYSTEM + QUESTION)
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= pin["num_tokens"]
    metrics = engine_metrics(server)
    assert metrics[("zhuzi:kv_pins", "")] == 1 and metrics[("zhuzi:kv_pinned_bytes", "")] == pin["bytes"]
    assert ("zhuzi:kv_offload_blocks", "host") in metrics and ("zhuzi:kv_offload_hits_total", "disk") in metrics
    view = api(server).get("/inspect/engine?steps=0").json()
    assert [p["name"] for p in view["pins"]["pins"]] == ["weather"] and view["pins"]["bytes"] == pin["bytes"]
    assert view["pins"]["limit_bytes"] == (16 * 2**20 // PAGE_BYTES) * PAGE_BYTES
    assert sorted(t["tier"] for t in view["kv_tiers"]) == ["disk", "host"]

    deleted = api(server).delete("/v1/cache/pins/weather")
    assert deleted.status_code == 200 and deleted.json() == {"object": "cache.pin.deleted", "name": "weather",
                                                              "deleted": True}
    again = api(server).delete("/v1/cache/pins/weather")
    assert again.status_code == 404 and again.json()["error"]["code"] == "pin_not_found"
    assert api(server).get("/v1/cache/pins").json()["data"] == []
    assert engine_metrics(server)[("zhuzi:kv_pinned_blocks", "")] == 0


@pytest.mark.parametrize("body,status,param,code", [
    ({"name": "a", "token_ids": [5] * 32, "messages": SYSTEM}, 400, None, None),
    ({"name": "no spaces", "token_ids": [5] * 32}, 400, "name", None),
    ({"name": "a", "token_ids": [5] * 15}, 400, "token_ids", None),
    ({"name": "a", "token_ids": [5] * 32, "ttl": 0}, 400, "ttl", None),
    ({"name": "a", "token_ids": [5, 49152]}, 400, "token_ids", None),
    ({"name": "a", "token_ids": [5] * 2000}, 400, "token_ids", "pinned_memory_exceeded"),
    ({"name": "a", "token_ids": [5] * 32, "model": "gpt-4"}, 404, "model", "model_not_found"),
    ({"name": "a", "token_ids": [5] * 32, "keep": True}, 400, "keep", None),
])
def test_a_pin_the_server_cannot_keep_gets_openais_error_object(server, body, status, param, code):
    answer = api(server).post("/v1/cache/pins", json=body)
    error = answer.json()["error"]
    assert answer.status_code == status and error["param"] == param, error
    assert code is None or error["code"] == code
    assert api(server).get("/v1/cache/pins").json()["data"] == []


def test_after_a_kill_9_the_restarted_server_loads_a_long_prompt_from_disk(server, kv_folder, tmp_path):
    first = chat(server, LONG_SYSTEM + QUESTION)
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert prompt_tokens > 300 and first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    deadline = time.monotonic() + 60
    while engine_metrics(server)[("zhuzi:kv_offload_stored_total", "disk")] < prompt_tokens // 16:
        assert time.monotonic() < deadline, "the disk tier did not write the prompt's pages"
        time.sleep(0.1)
    for pid in [*engine_pids(server).values(), server.proc.pid]:
        os.kill(pid, signal.SIGKILL)
    server.proc.wait()
    with running_server(tmp_path / "restarted.log", *flags(kv_folder)) as restarted:
        again = chat(restarted, LONG_SYSTEM + QUESTION)
        metrics = engine_metrics(restarted)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt_tokens - 1) // 16 * 16
    assert metrics[("zhuzi:kv_offload_hits_total", "disk")] == (prompt_tokens - 1) // 16 * 16
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
