"""/health tells the truth, on the app in-process around a real engine: 200 while the engine works (also
after a request of its own failed), 503 once the engine stalls with work pending; the server then ends the
open streams with an error and asks the process to exit (see test_lifecycle.py for a real exit)."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
from faults import Unchecked

from zhuzi.config import EngineConfig, ServerConfig
from zhuzi.engine.async_engine import AsyncEngine
from zhuzi.server.app import create_app

QUESTION = [{"role": "user", "content": "Tell me a story"}]


def test_health_is_503_once_the_engine_stalls_and_the_server_asks_to_stop():
    engine = AsyncEngine(EngineConfig(kv_cache_memory="16MiB"))
    failures: list[str] = []
    app = create_app(engine, ServerConfig(engine_stall_timeout=0.5), on_failure=failures.append)
    step, calls = engine.engine.step, []

    def stalling_step():
        calls.append(1)
        if len(calls) == 3:
            time.sleep(3.0)  # a step that hangs (a deadlock, a kernel that never returns)
        return step()

    async def main() -> tuple[list[int], httpx.Response]:
        transport = httpx.ASGITransport(app)
        async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://zhuzi") \
                as http:
            statuses = [(await http.get("/health")).status_code]
            engine.engine.step = stalling_step
            body = {"messages": QUESTION, "max_tokens": 50, "ignore_eos": True, "stream": True}
            chat = asyncio.ensure_future(http.post("/v1/chat/completions", json=body))
            deadline = time.monotonic() + 10
            while not failures and time.monotonic() < deadline:
                statuses.append((await http.get("/health")).status_code)
                await asyncio.sleep(0.1)
            statuses.append((await http.get("/health")).status_code)
            return statuses, await chat

    statuses, chat = asyncio.run(main())
    assert statuses[0] == 200 and statuses[-1] == 503
    assert len(failures) == 1 and "no progress" in failures[0]
    events = [line.removeprefix("data: ") for line in chat.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "no progress" in json.loads(events[-2])["error"]["message"]


def test_a_request_that_fails_alone_leaves_health_at_200():
    """A request's own failure is no engine failure: the engine runs on, /health stays 200."""
    engine = AsyncEngine(EngineConfig(kv_cache_memory="16MiB"))
    app = create_app(engine, ServerConfig())

    async def main() -> tuple[int, int]:
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://zhuzi") as http:
            async def failing() -> None:
                async for _ in engine.generate("Hi", Unchecked(logprobs=2**64, max_tokens=4), "culprit"):
                    pass

            try:
                await failing()
            except RuntimeError as exc:
                assert "Overflow" in str(exc)
            else:
                raise AssertionError("the culprit did not fail")
            answer = await http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 4})
            return (await http.get("/health")).status_code, answer.status_code

    assert asyncio.run(main()) == (200, 200)
