"""How requests and the server end, on real `zhuzi serve` processes: SIGTERM drains (running streams finish
or end with finish_reason "abort" and [DONE], the process exits 0), an engine that fails makes the server
exit non-zero after ending its streams with an error, and --request-timeout ends a request with "abort"."""
from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest
from open_responses import check_event
from server_process import running_server

pytestmark = pytest.mark.long  # a minute or more: handed out first (tests/conftest.py)

QUESTION = [{"role": "user", "content": "Tell me a long story"}]


async def stream_events(http: httpx.AsyncClient, url: str, started: asyncio.Event | None = None,
                        path: str = "/v1/chat/completions", **body) -> list[str]:
    """The data of every SSE event of one stream (a chat's, unless path and body say otherwise); sets started
    at its first event."""
    events = []
    chat = {"messages": QUESTION, "temperature": 0, "ignore_eos": True} if path == "/v1/chat/completions" else {}
    request = {**chat, "stream": True, **body}
    async with http.stream("POST", url + path, json=request) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                if started is not None:
                    started.set()
    return events


def finish_reason(events: list[str]) -> str:
    assert events[-1] == "[DONE]"
    return json.loads(events[-2])["choices"][0]["finish_reason"]


def test_sigterm_lets_running_streams_finish_then_ends_the_rest_with_abort_and_exits_0(tmp_path):
    """They were cut 2.3 s after the signal with no finish chunk and no [DONE]: clients saw an outage."""
    timeout = 5.0
    with running_server(tmp_path / "server.log", "--shutdown-timeout", str(timeout)) as server:
        async def main() -> tuple[list[list[str]], dict]:
            async with httpx.AsyncClient(timeout=120) as http:
                starts = [asyncio.Event() for _ in range(4)]
                lengths = [10, 2000, 2000, 2000]  # one finishes within the drain, three do not
                streams = [asyncio.ensure_future(stream_events(http, server.url, started, max_tokens=n))
                           for started, n in zip(starts, lengths)]
                await asyncio.gather(*(started.wait() for started in starts))
                signalled = time.monotonic()
                server.proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.5)
                refused = await http.post(server.url + "/v1/chat/completions", json={"messages": QUESTION})
                health = await http.get(server.url + "/health")
                events = await asyncio.gather(*streams)
                return events, {"refused": refused, "health": health, "drained": time.monotonic() - signalled}

        events, seen = asyncio.run(main())
        print(f"\nSIGTERM: drained in {seen['drained']:.2f} s (--shutdown-timeout {timeout:g})")
        assert seen["refused"].status_code == 503 and "shutting down" in seen["refused"].json()["error"]["message"]
        assert seen["health"].status_code == 503
        assert [finish_reason(e) for e in events] == ["length", "abort", "abort", "abort"]
        assert timeout - 0.5 < seen["drained"] < timeout + 10
        assert server.proc.wait(timeout=30) == 0
        log = server.log.read_text()
        assert "ending the 3 requests still running" in log and "Traceback" not in log


MODEL = "SmolLM2-135M-Instruct"
FAILING_ENGINE = """
from zhuzi.engine.core.scheduler import Scheduler
schedule, calls = Scheduler.schedule, []
def failing(self):
    calls.append(1)
    if len(calls) == 8:
        raise RuntimeError("injected: the scheduler's state is broken")
    return schedule(self)
Scheduler.schedule = failing
"""


@pytest.mark.parametrize("transport", [[], ["--no-engine-process"]], ids=["engine-process", "engine-thread"])
def test_an_engine_that_fails_ends_its_streams_with_an_error_and_the_server_exits_non_zero(tmp_path, transport):
    """/health said 200 whatever the engine's state; now a failed engine stops the server for its supervisor,
    wherever the step loop runs. Each API's stream ends in its own words: chat's error chunk and [DONE],
    Anthropic's error event, the Responses API's response.failed and [DONE]."""
    story = [{"role": "user", "content": "Write a long story about a dragon."}]
    with running_server(tmp_path / "server.log", *transport, inject=FAILING_ENGINE) as server:
        async def main() -> list[list[str]]:
            async with httpx.AsyncClient(timeout=60) as http:
                return await asyncio.gather(
                    stream_events(http, server.url, max_tokens=100),
                    stream_events(http, server.url, path="/v1/messages", model=MODEL, max_tokens=100,
                                  messages=story, temperature=0),
                    stream_events(http, server.url, path="/v1/responses", input=story, max_output_tokens=100,
                                  temperature=0))

        chat, messages, responses = asyncio.run(main())
        assert chat[-1] == "[DONE]"
        error = json.loads(chat[-2])["error"]
        assert error["code"] == 503 and "injected: the scheduler's state is broken" in error["message"]
        error = json.loads(messages[-1])
        assert error["type"] == "error" and error["error"]["type"] == "overloaded_error"
        assert "injected" in error["error"]["message"]
        assert responses[-1] == "[DONE]"
        failed = json.loads(responses[-2])
        check_event(failed)  # the Open Responses specification's event
        assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
        assert "injected" in failed["response"]["error"]["message"]
        assert server.proc.wait(timeout=30) == 1
        assert "zhuzi: the engine failed: RuntimeError: injected" in server.log.read_text()


def short_request(server) -> tuple[dict, float]:
    started = time.monotonic()
    response = httpx.post(server.url + "/v1/chat/completions",
                          json={"messages": QUESTION, "max_tokens": 4, "ignore_eos": True}, timeout=60)
    return response.json(), time.monotonic() - started


def test_request_timeout_ends_long_requests_with_abort(tmp_path):
    with running_server(tmp_path / "server.log", "--request-timeout", "2") as server:
        _, short_s = short_request(server)  # the baseline: a whole 4-token request here and now

        async def main() -> tuple[list[str], dict, float]:
            async with httpx.AsyncClient(timeout=60) as http:
                started = time.monotonic()
                streamed, whole = await asyncio.gather(
                    stream_events(http, server.url, max_tokens=2000),
                    http.post(server.url + "/v1/chat/completions",
                              json={"messages": QUESTION, "max_tokens": 2000, "ignore_eos": True}))
                return streamed, whole.json(), time.monotonic() - started

        streamed, whole, seconds = asyncio.run(main())
        assert finish_reason(streamed) == "abort"
        assert whole["choices"][0]["finish_reason"] == "abort" and whole["usage"]["completion_tokens"] > 0
        assert 2 <= seconds < 2 + 5 * short_s  # ended by the timeout, within a few steps of it
        short, _ = short_request(server)
        assert short["choices"][0]["finish_reason"] == "length"
