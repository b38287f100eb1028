"""API keys, per-key rate limits and the bounded queue, over HTTP against a real `zhuzi serve`.

The server runs one sequence at a time (--max-num-seqs 1) with room for one more to wait
(--max-waiting 1), three requests per minute and 400 tokens per minute for each key, and
serves the model under another name (--served-model-name).
"""
from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import openai
import pytest
from server_process import IN_THREAD, ServerProcess, running_server

MODEL = "smol"  # --served-model-name
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# 3 requests a minute each: no test spends more
KEYS = ("key-auth", "key-rpm", "key-tpm", "key-queue", "key-big", "key-tokenize", "key-tokenize-tpm", "key-inspect",
        "key-inspect-2")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    keys = [arg for key in KEYS for arg in ("--api-key", key)]
    limits = ["--rate-limit-rpm", "3", "--rate-limit-tpm", "400", "--max-num-seqs", "1", "--max-waiting", "1"]
    with running_server(tmp_path_factory.mktemp("gateway") / "server.log", "--served-model-name", MODEL,
                        *keys, *limits, *IN_THREAD) as running:
        yield running


def client(server: ServerProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url=server.api, max_retries=0, timeout=60)


def ask(server: ServerProcess, key: str, **extra) -> httpx.Response:
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 4, "temperature": 0, **extra}
    return httpx.post(server.api + "/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=60)


def test_missing_or_wrong_key_is_401(server: ServerProcess) -> None:
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "key-auth"}):
        response = httpx.post(server.api + "/chat/completions", json={"messages": QUESTION}, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client(server, "nope").models.list()
    assert [m.id for m in client(server, "key-auth").models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200  # probes need no key


def test_the_page_is_public_and_inspection_obeys_keys_and_limits(server: ServerProcess) -> None:
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and "default-src 'self'" in page.headers["content-security-policy"]
    assert httpx.get(server.url + "/static/js/app.js").status_code == 200
    key, other = {"Authorization": "Bearer key-inspect"}, {"Authorization": "Bearer key-inspect-2"}
    engine = ("GET", "/inspect/engine?steps=0", None)
    posts = [("POST", "/inspect/bpe", {"text": "hi"}), ("POST", "/inspect/document", {"messages": QUESTION}),
             ("POST", "/inspect/next-token", {"contexts": [[1, 2]], "model": MODEL})]
    lens = ("POST", "/inspect/logit-lens", {"token_ids": [1, 2, 3]})
    for method, path, body in (engine, *posts, lens):
        bare = httpx.request(method, server.url + path, json=body, timeout=60)
        assert bare.status_code == 401 and bare.json()["error"]["code"] == "invalid_api_key"
    for method, path, body in posts:  # the key's three requests a minute
        assert httpx.request(method, server.url + path, json=body, headers=key, timeout=60).status_code == 200
    refused = httpx.post(server.url + lens[1], json=lens[2], headers=key, timeout=60)
    assert refused.status_code == 429 and refused.json()["error"]["type"] == "requests"
    assert httpx.get(server.url + engine[1], headers=key).status_code == 200  # reading the engine costs nothing
    assert httpx.post(server.url + lens[1], json=lens[2], headers=other, timeout=60).status_code == 200
    wrong_model = httpx.post(server.url + "/inspect/next-token", json={"contexts": [[1]], "model": "other"},
                             headers=other, timeout=60)
    assert wrong_model.status_code == 404 and wrong_model.json()["error"]["code"] == "model_not_found"
    too_many = httpx.post(server.url + "/inspect/next-token", json={"contexts": [[1]] * 3}, timeout=60,
                          headers={"Authorization": "Bearer key-big"})  # 1 running + 1 waiting place
    assert too_many.status_code == 400 and too_many.json()["error"]["code"] == "too_many_sequences"


def test_requests_per_minute_give_429_with_retry_after(server: ServerProcess) -> None:
    for _ in range(3):
        assert ask(server, "key-rpm").status_code == 200
    refused = ask(server, "key-rpm")
    assert refused.status_code == 429
    assert refused.json()["error"]["type"] == "requests"
    assert 1 <= int(refused.headers["Retry-After"]) <= 20  # one request back every 20 s
    assert ask(server, "key-auth").status_code == 200  # another key is not affected
    assert ask(server, "key-auth", model="SmolLM2-135M-Instruct").status_code == 404  # served as "smol" only


def test_tokenize_and_detokenize_count_against_the_rate_limits(server: ServerProcess) -> None:
    """They cost CPU as a prompt does: a key cannot tokenize without limit (they were outside the limits)."""
    headers = {"Authorization": "Bearer key-tokenize"}
    statuses = [httpx.post(server.url + path, json=body, headers=headers, timeout=60).status_code
                for path, body in [("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1, 2]}),
                                   ("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1, 2]})]]
    assert statuses == [200, 200, 200, 429]
    headers = {"Authorization": "Bearer key-tokenize-tpm"}
    long_text = {"prompt": "Tell me about Paris. " * 100}  # ~500 tokens: the 400 a minute are spent
    assert httpx.post(server.url + "/tokenize", json=long_text, headers=headers, timeout=60).status_code == 200
    refused = httpx.post(server.url + "/tokenize", json={"prompt": "hi"}, headers=headers, timeout=60)
    assert refused.status_code == 429 and refused.json()["error"]["type"] == "tokens"


def test_tokens_per_minute_give_429_with_retry_after(server: ServerProcess) -> None:
    long_prompt = [{"role": "user", "content": "Tell me about Paris. " * 100}]  # ~500 tokens
    assert ask(server, "key-tpm", messages=long_prompt).status_code == 200
    refused = ask(server, "key-tpm")
    assert refused.status_code == 429
    assert refused.json()["error"]["type"] == "tokens"
    assert int(refused.headers["Retry-After"]) >= 10


def test_more_samples_than_the_queue_holds_is_400_not_429(server: ServerProcess) -> None:
    refused = ask(server, "key-big", n=3)  # 1 running + 1 waiting place: retrying could never help
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "too_many_sequences"


def test_full_queue_gives_429_at_once(server: ServerProcess) -> None:
    asyncio.run(fill_the_queue(server))
    assert ask(server, "key-auth").status_code == 200  # the places are free again


async def fill_the_queue(server: ServerProcess) -> None:
    url = server.api + "/chat/completions"
    endless = {"model": MODEL, "messages": QUESTION, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(timeout=60, headers={"Authorization": "Bearer key-queue"}) as http:
        async with http.stream("POST", url, json=endless) as running:
            lines = running.aiter_lines()  # kept: a dropped iterator closes the connection
            await anext(lines)  # generating: the one running sequence
            waiting = asyncio.create_task(http.post(url, json=endless))  # queued behind it: the one waiting place
            await until_waiting(http, server, 1)
            round_trip = 0.0  # the baseline: the slowest of a few admitted calls here and now
            for _ in range(5):
                started = time.monotonic()
                assert (await http.get(server.api + "/models")).status_code == 200
                round_trip = max(round_trip, time.monotonic() - started)
            started = time.monotonic()
            refused = await http.post(url, json={**endless, "stream": False, "max_tokens": 1})
            assert refused.status_code == 429 and time.monotonic() - started < 20 * round_trip  # at once
            assert refused.json()["error"]["code"] == "queue_full"
            assert int(refused.headers["Retry-After"]) >= 1
            waiting.cancel()  # hanging up aborts it
            with contextlib.suppress(asyncio.CancelledError):
                await waiting


async def until_waiting(http: httpx.AsyncClient, server: ServerProcess, count: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in (await http.get(server.url + "/metrics")).text.splitlines():
            if line.startswith("zhuzi:num_requests_waiting{") and float(line.split()[-1]) == count:
                return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never saw {count} waiting request(s)")
