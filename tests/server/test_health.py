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
from faults import planted

from zhuzi import SamplingParams
from zhuzi.config import EngineConfig, ParallelConfig, ServerConfig
from zhuzi.engine.core_client import CoreClient
from zhuzi.server.app import create_app

QUESTION = [{"role": "user", "content": "Tell me a story"}]


@pytest.fixture
def engine() -> Iterator[CoreClient]:
    """The engine core in a thread of this process (--no-engine-process), with a sampler that fails for seed 666."""
    with planted("fail_sampling(seed=666)"):
        client = CoreClient(EngineConfig(kv_cache_memory="16MiB"), ParallelConfig(engine_process=False)).start()
        yield client
        client.close()


async def slowest_wait(engine: CoreClient) -> float:
    """The longest this engine, here and now, takes to deliver a delta of a short request (its first included)."""
    waits, last = [], time.monotonic()
    async for _ in engine.generate("Hi", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), "baseline"):
        waits.append(time.monotonic() - last)
        last = time.monotonic()
    return max(waits)


def test_health_is_503_once_the_engine_stalls_and_the_server_asks_to_stop(engine):
    # The stall timeout and the stall are measured against this machine's own pace (a loaded CI runner's steps
    # are many times slower than a quiet one's): no working step comes near the timeout, the stall far exceeds it.
    timeout = max(0.5, 4 * asyncio.run(slowest_wait(engine)))
    failures: list[str] = []
    app = create_app(engine, ServerConfig(engine_stall_timeout=timeout), on_failure=failures.append)

    async def main() -> tuple[list[int], httpx.Response]:
        transport = httpx.ASGITransport(app)
        async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://zhuzi") \
                as http:
            statuses = [(await http.get("/health")).status_code]
            body = {"messages": QUESTION, "max_tokens": 50, "ignore_eos": True, "stream": True}
            # the chat's third step hangs (a deadlock, a kernel that never returns)
            with planted(f'stall_step("chatcmpl", at_step=3, seconds={6 * timeout})'):
                chat = asyncio.ensure_future(http.post("/v1/chat/completions", json=body))
                deadline = time.monotonic() + 20 * timeout
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
