"""Many keys on one `zhuzi serve`: fair shares per key, daily token quotas kept across a kill -9, prompt
progress before the first token, priority, and each key's load shown without the key.

The server has four keys (so it schedules fairly by default), a 16-token step budget (a long prompt takes
several steps) and a daily quota of 30 tokens on one key, its usage in the server's SQLite store (a file of
the test's own).
"""
from __future__ import annotations

import asyncio
import contextlib
import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from server_process import IN_THREAD, ServerProcess, running_server

from zhuzi.server.common.gateway import key_id

ALICE, BOB, QUOTA, SPARE = "sk-alice-0f3c9e", "sk-bob-7d21aa", "sk-quota-55e0b1", "sk-spare-9a8b7c"
BUDGET = 16  # --max-num-batched-tokens: a key may lead another by at most one step's budget
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MODEL = "SmolLM2-135M-Instruct"


class Tenancy:
    """The module's server, which one test kills with SIGKILL and starts again on the same store (the file
    of stored responses, where usage is kept too)."""

    def __init__(self, root: Path) -> None:
        self.root, self.starts, self.stack = root, 0, contextlib.ExitStack()
        self.store = root / "zhuzi.sqlite3"
        self.server = self.start()

    def start(self) -> ServerProcess:
        self.starts += 1
        keys = [arg for key in (ALICE, BOB, QUOTA, SPARE) for arg in ("--api-key", key)]
        return self.stack.enter_context(running_server(
            self.root / f"server-{self.starts}.log", *keys, "--max-num-batched-tokens", str(BUDGET),
            "--quota-tokens-per-day", f"{QUOTA}=30", "--responses-store", str(self.store), *IN_THREAD))

    def kill_and_restart(self) -> None:
        self.server.proc.kill()
        self.stack.close()
        self.stack = contextlib.ExitStack()
        self.server = self.start()


@pytest.fixture(scope="module")
def tenancy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tenancy]:
    tenancy = Tenancy(tmp_path_factory.mktemp("tenants"))
    try:
        yield tenancy
    finally:
        tenancy.stack.close()


def client(server: ServerProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url=server.api, max_retries=0, timeout=120)


def metrics(server: ServerProcess) -> str:
    return httpx.get(server.url + "/metrics").text


def metric(text: str, name: str, key: str) -> float | None:
    found = re.search(rf'^zhuzi:{name}\{{[^}}]*key="{key_id(key)}"[^}}]*\}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else None


# ------------------------------------------------------------------ prompt progress

def test_a_long_prompt_streams_its_progress_before_the_first_token(tenancy: Tenancy) -> None:
    long = [{"role": "user", "content": "Summarize: " + "the river runs past the old mill and on to the sea. " * 20}]
    stream = client(tenancy.server, SPARE).chat.completions.create(
        model=MODEL, messages=long, max_tokens=3, stream=True, stream_options={"include_usage": True},
        extra_body={"return_progress": True})
    progress, text_seen, usage = [], False, None
    for chunk in stream:
        if (p := (chunk.model_extra or {}).get("prompt_progress")) is not None:
            assert not text_seen and chunk.choices == []
            progress.append((p["prompt_tokens_processed"], p["prompt_tokens_total"], p["cached"]))
        text_seen = text_seen or any(c.delta.content for c in chunk.choices)
        usage = chunk.usage or usage
    total = usage.prompt_tokens
    assert total > 3 * BUDGET and len(progress) >= 3
    assert [p[1] for p in progress] == [total] * len(progress) and progress[-1][0] == total
    assert all(a[0] < b[0] for a, b in zip(progress, progress[1:]))  # it grows, step by step
    assert all(p[2] == usage.prompt_tokens_details.cached_tokens for p in progress)


def test_progress_is_refused_without_a_stream(tenancy: Tenancy) -> None:
    with pytest.raises(openai.BadRequestError, match="return_progress is only allowed when stream is true"):
        client(tenancy.server, SPARE).chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2,
                                                              extra_body={"return_progress": True})


# ------------------------------------------------------------------ fair shares

async def stream_tokens(http: httpx.AsyncClient, url: str, key: str, max_tokens: int, counts: dict[str, int],
                        name: str, **extra) -> None:
    """Stream a chat, adding each chunk's tokens to counts[name] as they arrive."""
    body = {"messages": QUESTION, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "return_token_ids": True, **extra}
    async with http.stream("POST", url, json=body, headers={"Authorization": f"Bearer {key}"}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = httpx.Response(200, content=line[6:]).json()
                counts[name] = counts.get(name, 0) + sum(len(c.get("token_ids") or []) for c in chunk["choices"])


async def race(server: ServerProcess, **bob_options) -> tuple[int, int, dict]:
    """Alice runs 4 streams; once they decode, Bob runs one. Tokens each got while Bob's stream ran, and the
    engine's view of both keys in the middle of it."""
    url = server.api + "/chat/completions"
    counts: dict[str, int] = {}
    async with httpx.AsyncClient(timeout=120) as http:
        alice = [asyncio.create_task(stream_tokens(http, url, ALICE, 1000, counts, f"a{i}")) for i in range(4)]
        while len([name for name in counts if counts[name]]) < 4:
            await asyncio.sleep(0.02)
        before = sum(counts.values())
        bob = asyncio.create_task(stream_tokens(http, url, BOB, 60, counts, "bob", **bob_options))
        while counts.get("bob", 0) < 30:
            await asyncio.sleep(0.02)
        view = (await http.get(server.url + "/inspect/engine?steps=0",
                               headers={"Authorization": f"Bearer {BOB}"})).json()
        await bob
        alice_tokens = sum(counts.values()) - before - counts["bob"]
        for task in alice:
            task.cancel()
        await asyncio.gather(*alice, return_exceptions=True)
    return alice_tokens, counts["bob"], view


def test_a_key_with_one_stream_gets_as_many_tokens_as_a_key_with_four(tenancy: Tenancy) -> None:
    alice, bob, view = asyncio.run(race(tenancy.server, priority=-3))  # under fair, priority orders Bob's own
    assert bob == 60
    # Alice may lead Bob by one step's budget, plus what ran before his request was in and his prompt's few
    # uncached tokens; first come, first served she would get 4 x 60.
    assert alice <= bob + 4 * BUDGET, (alice, bob)
    tenants = {t["key"]: (t["running"], t["waiting"]) for t in view["requests"]["tenants"]}
    assert tenants == {key_id(ALICE): (4, 0), key_id(BOB): (1, 0)}
    assert ALICE not in str(view) and BOB not in str(view)


def test_priority_needs_no_other_policy_here_and_is_range_checked(tenancy: Tenancy) -> None:
    chat = client(tenancy.server, SPARE).chat.completions
    assert chat.create(model=MODEL, messages=QUESTION, max_tokens=2, extra_body={"priority": 5}).choices
    with pytest.raises(openai.BadRequestError) as refused:
        chat.create(model=MODEL, messages=QUESTION, max_tokens=2, extra_body={"priority": 1.5})
    assert refused.value.body["param"] == "priority"



def test_messages_and_responses_take_priority_as_chat_does(tenancy: Tenancy) -> None:
    claude = anthropic.Anthropic(base_url=tenancy.server.url, api_key=SPARE, max_retries=0, timeout=120)
    responses = client(tenancy.server, SPARE).responses
    assert claude.messages.create(model=MODEL, max_tokens=2, messages=QUESTION, extra_body={"priority": 5}).content
    assert responses.create(model=MODEL, max_output_tokens=16, input="Hi", extra_body={"priority": 5}).output
    with pytest.raises(anthropic.BadRequestError, match="priority"):
        claude.messages.create(model=MODEL, max_tokens=2, messages=QUESTION, extra_body={"priority": 2**63})
    with pytest.raises(openai.BadRequestError, match="priority"):
        responses.create(model=MODEL, max_output_tokens=16, input="Hi", extra_body={"priority": 2**63})

# ------------------------------------------------------------------ quotas (the kill -9 test last)

def test_over_the_daily_quota_is_a_429_naming_it_and_metrics_show_usage_by_masked_key(tenancy: Tenancy) -> None:
    quota = client(tenancy.server, QUOTA)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):  # refused by the engine: free
        quota.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=9000)
    first = quota.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8)  # 0 used: admitted
    used = first.usage.prompt_tokens + first.usage.completion_tokens
    assert used >= 30
    with pytest.raises(openai.RateLimitError) as refused:
        quota.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8)
    error = refused.value.body
    assert (error["type"], error["code"]) == ("insufficient_quota", "insufficient_quota")
    assert f"may use 30 prompt + generated tokens a day and has used {used}" in error["message"]
    assert re.search(r"resets at \d{4}-\d\d-\d\d 00:00 UTC", error["message"])
    assert 0 < int(refused.value.response.headers["Retry-After"]) <= 86400
    assert client(tenancy.server, SPARE).chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1)
    text = metrics(tenancy.server)
    assert metric(text, "key_tokens_used_today", QUOTA) == used
    assert metric(text, "key_quota_tokens_per_day", QUOTA) == 30
    assert metric(text, "key_tokens_used_today", SPARE) > 0  # every key's usage counts, quota or not
    assert not any(key in text for key in (ALICE, BOB, QUOTA, SPARE))


def test_usage_survives_a_kill_and_a_restart(tenancy: Tenancy) -> None:
    before = metric(metrics(tenancy.server), "key_tokens_used_today", QUOTA)
    assert before is not None and before >= 30
    tenancy.kill_and_restart()
    assert metric(metrics(tenancy.server), "key_tokens_used_today", QUOTA) == before
    components = sqlite3.connect(tenancy.store).execute("SELECT component FROM zhuzi_schema").fetchall()
    assert sorted(components) == [("key_usage",), ("responses",)]  # one file for what outlives the server
    with pytest.raises(openai.RateLimitError, match="Daily token quota exceeded"):
        client(tenancy.server, QUOTA).chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1)
