"""/health tells the truth, on the app in-process around a real engine: 200 while the engine works (also
after a request of its own failed), 503 once the engine stalls with work pending; the server then ends the
open streams with an error and asks the process to exit (see test_lifecycle.py for a real exit)."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import httpx
import pytest
from clock import Clock
from faults import Gate, planted

from zhuzi import SamplingParams
from zhuzi.config import EngineConfig, ParallelConfig, ServerConfig
from zhuzi.engine.front.core_client import EngineCoreClient
from zhuzi.server.app import create_app

QUESTION = [{"role": "user", "content": "Tell me a story"}]
TIMEOUT = 60.0  # --engine-stall-timeout, in the seconds of the test's clock


@pytest.fixture
def clock() -> Clock:
    return Clock(time.monotonic())


@pytest.fixture
def engine(clock: Clock) -> Iterator[EngineCoreClient]:
    """The engine core in a thread of this process (--no-engine-process), with a sampler that fails for seed 666,
    its heartbeats read on the test's clock."""
    with planted("fail_sampling(seed=666)"):
        client = EngineCoreClient(EngineConfig(kv_cache_memory="16MiB"), ParallelConfig(engine_process=False),
                            clock=clock).start()
        yield client
        client.close()


def test_health_is_503_once_the_engine_stalls_and_the_server_asks_to_stop(engine, clock, tmp_path):
    gate = Gate(tmp_path)
    failures: list[str] = []
    app = create_app(engine, ServerConfig(engine_stall_timeout=TIMEOUT), on_failure=failures.append)

    async def main() -> tuple[list[int], httpx.Response]:
        transport = httpx.ASGITransport(app)
        async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://zhuzi") \
                as http:
            statuses = [(await http.get("/health")).status_code]
            body = {"messages": QUESTION, "max_tokens": 50, "ignore_eos": True, "stream": True}
            # the chat's third step hangs (a deadlock, a kernel that never returns)
            with planted(gate.stall("chatcmpl", at_step=3)):
                chat = asyncio.ensure_future(http.post("/v1/chat/completions", json=body))
                await gate.stalled()
                deadline = time.monotonic() + 60
                while not failures:  # the server's watch looks every WATCH_PERIOD_S
                    assert time.monotonic() < deadline, "the server never noticed the stall"
                    statuses.append((await http.get("/health")).status_code)
                    clock.now += TIMEOUT / 4  # a delta of the step before the stall may still come: it resets this
                    await asyncio.sleep(0.05)
                statuses.append((await http.get("/health")).status_code)
                gate.release()
                return statuses, await chat

    statuses, chat = asyncio.run(main())
    assert statuses[:6] == [200] * 6  # before the chat, and silent for 0 to 60 s: no stall yet
    assert statuses[-1] == 503
    assert len(failures) == 1 and "no progress" in failures[0]
    events = [line.removeprefix("data: ") for line in chat.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "no progress" in json.loads(events[-2])["error"]["message"]


def test_a_request_that_fails_alone_leaves_health_at_200(engine):
    """A request's own failure is no engine failure: the engine runs on, /health stays 200."""
    app = create_app(engine, ServerConfig())

    async def main() -> tuple[int, int]:
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://zhuzi") as http:
            async def failing() -> None:
                async for _ in engine.generate("Hi", SamplingParams(seed=666, max_tokens=4), "culprit"):
                    pass

            try:
                await failing()
            except RuntimeError as exc:
                assert "injected fault" in str(exc)
            else:
                raise AssertionError("the culprit did not fail")
            answer = await http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 4})
            return (await http.get("/health")).status_code, answer.status_code

    assert asyncio.run(main()) == (200, 200)
