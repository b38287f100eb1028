"""The asyncio bridge: streams of deltas, cancellation aborts, the event loop stays free."""
import asyncio
import time

import pytest

from zhuzi import SamplingParams
from zhuzi.config import EngineConfig
from zhuzi.engine.async_engine import AsyncEngine


@pytest.fixture(scope="module")
def engine():
    return AsyncEngine(EngineConfig(dtype="float32", kv_cache_memory="64MiB"))  # fp32: batch-invariant


async def collect(engine, prompt, params, rid):
    text, outs = "", []
    async for out in engine.generate(prompt, params, rid):
        outs.append(out)
        text += "".join(c.text for c in out.outputs)
    return text, outs


def test_concurrent_streams_equal_their_solo_results(engine):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time"]

    async def main():
        solo = [await collect(engine, p, params, f"solo-{i}") for i, p in enumerate(prompts)]
        together = await asyncio.gather(*(collect(engine, p, params, f"together-{i}") for i, p in enumerate(prompts)))
        return solo, together

    solo, together = asyncio.run(main())
    assert [t for t, _ in solo] == [t for t, _ in together]
    assert all(outs[-1].finished and len(outs) > 1 for _, outs in together)  # streamed in pieces


def test_cancelling_the_consumer_aborts_and_frees_its_blocks(engine):
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def main():
        seen = 0
        stream = engine.generate("Tell me a long story", params, "cancelled")
        async for _ in stream:
            seen += 1
            if seen == 3:
                break
        await stream.aclose()
        for _ in range(100):  # the abort lands within a step or two
            await asyncio.sleep(0.05)
            stats = engine.stats()
            if stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks:
                return stats
        return engine.stats()

    stats = asyncio.run(main())
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_blocks


def test_the_event_loop_keeps_running_during_forward_passes(engine):
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)

    async def main():
        ticks, done = [], False

        async def ticker():
            while not done:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.005)

        task = asyncio.create_task(ticker())
        await collect(engine, "word " * 400, params, "busy")
        done = True
        await task
        return max(b - a for a, b in zip(ticks, ticks[1:]))

    assert asyncio.run(main()) < 0.25  # no forward pass blocks the loop


def test_a_request_that_cannot_fit_raises_for_that_request_only(engine):
    async def main():
        with pytest.raises(ValueError, match="maximum context length"):
            await collect(engine, [5] * 9000, SamplingParams(max_tokens=10), "too-long")
        return await collect(engine, "Hi", SamplingParams(temperature=0, max_tokens=4), "fine")

    text, outs = asyncio.run(main())
    assert outs[-1].finished and text
