"""The asyncio bridge: streams of deltas, probes and snapshots, cancellation aborts, the event loop stays free,
faults stay with their request, and health() tells a stalled or failed engine from a working one."""
import asyncio
import threading
import time

import pytest
import torch
from faults import Unchecked

from zhuzi import SamplingParams
from zhuzi.config import EngineConfig
from zhuzi.engine.async_engine import AsyncEngine, EngineDead
from zhuzi.engine.sequence import Probe
from zhuzi.outputs import RequestError


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


def test_a_request_the_engine_fails_raises_for_it_alone(engine):
    """The reported bug: one request's failure inside a step ended every stream with "engine error"."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    culprit = Unchecked(temperature=1.0, logprobs=2**64, max_tokens=24)  # overflows in the sampler

    async def main():
        solo = await collect(engine, "The capital of France is", params, "solo")
        neighbours = [asyncio.ensure_future(collect(engine, "The capital of France is", params, f"neighbour-{i}"))
                      for i in range(3)]
        with pytest.raises(RequestError, match="Overflow"):
            await collect(engine, "Hi", culprit, "culprit")
        return solo, await asyncio.gather(*neighbours)

    (solo_text, _), neighbours = asyncio.run(main())
    assert [text for text, _ in neighbours] == [solo_text] * 3
    assert all(outs[-1].outputs[0].finish_reason == "length" for _, outs in neighbours)


def test_abort_ends_a_stream_that_is_still_read_with_finish_reason_abort(engine):
    async def main():
        outs = []
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        async for out in engine.generate("Tell me a story", params, "ended"):
            outs.append(out)
            if len(outs) == 3:
                engine.abort("ended")  # as a shutdown or --request-timeout does
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert len(outs) < 20


def test_health_tells_a_stall_with_work_pending_from_an_idle_engine(engine):
    step, stalled = engine.engine.step, threading.Event()

    def slow_step():
        if not stalled.is_set():
            stalled.set()
            time.sleep(1.0)
        return step()

    async def main():
        await asyncio.sleep(0.5)
        idle = engine.health(stall_timeout=0.3)  # no work for a while: an old heartbeat is no stall
        task = asyncio.ensure_future(collect(engine, "Hi", SamplingParams(temperature=0, max_tokens=4), "slow"))
        seen = []
        while not task.done():
            seen.append(engine.health(stall_timeout=0.3))
            await asyncio.sleep(0.05)
        await task
        return idle, seen

    engine.engine.step = slow_step
    try:
        idle, seen = asyncio.run(main())
    finally:
        del engine.engine.step
    assert idle is None
    assert any(problem and "no progress for" in problem for problem in seen)
    assert engine.health(stall_timeout=0.3) is None  # it moved again


def test_a_failed_engine_loop_ends_every_stream_and_refuses_later_requests():
    dying = AsyncEngine(EngineConfig(kv_cache_memory="16MiB"))

    def broken():
        raise RuntimeError("the scheduler's state is broken")

    async def main():
        stream = dying.generate("Tell me a story", SamplingParams(max_tokens=400, ignore_eos=True), "running")
        await anext(stream)
        dying.engine.scheduler.schedule = broken
        with pytest.raises(EngineDead, match="scheduler's state is broken"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDead):
            await anext(dying.generate("Hi", SamplingParams(max_tokens=4), "later"))

    asyncio.run(main())
    assert dying.health(stall_timeout=60) == "the engine failed: RuntimeError: the scheduler's state is broken"


def test_probes_and_snapshots_go_through_the_loop_and_a_cancelled_probe_frees_its_blocks(engine):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ids = engine.tokenizer.encode("The capital of France is")

    async def main():
        streaming = asyncio.create_task(collect(engine, "Once upon a time", params, "beside"))
        probes = await asyncio.gather(*(engine.probe(ids, Probe(lens_top=k), f"probe-{k}") for k in (0, 2)))
        during = await engine.snapshot(8)
        await streaming
        long = asyncio.create_task(engine.probe(engine.tokenizer.encode("word " * 1000), Probe(), "cancelled"))
        while (await engine.snapshot(0)).stats.num_running == 0:  # until admitted (a prefill of two chunks)
            await asyncio.sleep(0.01)
        long.cancel()
        await asyncio.gather(long, return_exceptions=True)
        for _ in range(100):  # the abort lands within a step or two
            after = await engine.snapshot(0)
            if after.stats.num_running == 0 and after.stats.num_free_blocks == after.stats.num_blocks:
                break
            await asyncio.sleep(0.05)
        return probes, during, after

    probes, during, after = asyncio.run(main())
    assert torch.equal(probes[0].inspection.logits, probes[1].inspection.logits)
    assert len(probes[1].inspection.lens) == during.model.num_layers
    assert during.stats.num_running >= 1 and 1 <= len(during.steps) <= 8
    assert after.stats.num_running == after.stats.num_waiting == 0
    assert after.stats.num_free_blocks == after.stats.num_blocks and after.steps == []
