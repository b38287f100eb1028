"""The engine client, through both transports of the one step loop (an engine core in a thread of this
process, and in a process of its own): streams equal what the offline engine computes, token for token;
probes and snapshots go through the loop; cancelling or aborting lands before the next step and frees the
pages; a refusal or a failure stays with its request; the event loop stays free; and health() tells a
stalled or failed engine from a working one."""
from __future__ import annotations

import asyncio
import logging
import statistics
import time

import msgspec
import pytest
import torch
from clock import Clock
from faults import Gate, planted

from zhuzi import LLM, SamplingParams
from zhuzi.config import EngineConfig, ParallelConfig
from zhuzi.engine.front import placement
from zhuzi.engine.front.client import EngineDead
from zhuzi.engine.front.core_client import EngineCoreClient
from zhuzi.engine.sequence import PinSpec, Probe, Tenant
from zhuzi.outputs import RequestError
from zhuzi.sampling_params import InvalidRequest, StructuredOutputError, StructuredOutputsParams

pytestmark = pytest.mark.long  # a minute or more: handed out first (tests/conftest.py)

# float32 on the file's blocks: a batch moves only the last bits
CONFIG = EngineConfig(dtype="float32", quantization="gguf", kv_cache_memory="64MiB")
TRANSPORTS = {"thread": ParallelConfig(engine_process=False), "process": ParallelConfig()}
# Planted for the whole module (with the client's stall), each touching only the requests named for it.
FAULTS = ('break_loop("break-the-loop")', "fail_sampling(seed=666)")


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def transport(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def gate(transport, tmp_path_factory) -> Gate:
    """Where the client's stall of request "slow" says it has begun, and is released."""
    return Gate(tmp_path_factory.mktemp(f"stall-{transport}"))


@pytest.fixture(scope="module")
def client(transport, gate):
    with planted(*FAULTS, gate.stall("slow", at_step=1)):
        engine = EngineCoreClient(CONFIG, TRANSPORTS[transport]).start()
        yield engine
        engine.close()


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(**vars(CONFIG))


def same_logprobs(got: list[dict], want: list[dict]) -> bool:
    """The same tokens at every position, each logprob within float32 noise of a run in another batch."""
    return len(got) == len(want) and all(
        g.keys() == w.keys() and all(abs(g[t].logprob - w[t].logprob) <= 1e-4 for t in g) for g, w in zip(got, want))


async def collect(engine, prompt, params, rid):
    outs = [out async for out in engine.generate(prompt, params, rid)]
    return "".join(c.text for out in outs for c in out.outputs), outs


def test_streams_equal_what_the_offline_engine_computes(client, offline):
    """Concurrent streams equal their solo runs and the offline batch, logprobs and prompt logprobs too. Deltas
    cross as lean messages (the prompt stays in front, timings come once, prompt logprobs once)."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time"]
    want = offline.generate(prompts, params)

    async def main():
        solo = [await collect(client, p, params, f"solo-{i}") for i, p in enumerate(prompts)]
        together = await asyncio.gather(*(collect(client, p, params, f"r{i}") for i, p in enumerate(prompts)))
        return solo, together

    solo, together = asyncio.run(main())
    assert [text for text, _ in solo] == [text for text, _ in together]
    for (text, outs), expected in zip(together, want):
        assert len(outs) > 1 and outs[-1].finished  # streamed in pieces
        assert text == expected.outputs[0].text
        assert [t for out in outs for t in out.outputs[0].token_ids] == expected.outputs[0].token_ids
        logprobs = [lp for out in outs for lp in out.outputs[0].logprobs]
        assert same_logprobs(logprobs, expected.outputs[0].logprobs)
        assert all(out.prompt_token_ids == expected.prompt_token_ids for out in outs)
        first_prompt_logprobs = next(out.prompt_logprobs for out in outs if out.prompt_logprobs)
        assert len(first_prompt_logprobs) == len(expected.prompt_token_ids)
        assert outs[-1].metrics.e2e_latency > 0 and outs[-1].metrics.time_to_first_token > 0


def test_cancelling_the_consumer_aborts_and_frees_its_pages(client):
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def main():
        seen = 0
        stream = client.generate("Tell me a long story", params, "cancelled")
        async for _ in stream:
            seen += 1
            if seen == 3:
                break
        await stream.aclose()
        for _ in range(100):  # the abort lands within a step or two
            await asyncio.sleep(0.05)
            stats = client.stats()
            if stats.num_running == 0 and stats.num_free_pages == stats.num_pages:
                return stats
        return client.stats()

    stats = asyncio.run(main())
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_pages == stats.num_pages


def test_an_abort_lands_before_the_next_step_and_ends_the_stream_with_abort(client):
    """The abort goes out as soon as it is asked for (as a shutdown or --request-timeout does) and the loop
    applies it before its next step: at most the step already running when it arrived still yields a token."""
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def main():
        outs, after = [], 0
        async for out in client.generate("Tell me a story", params, "ended"):
            outs.append(out)
            if len(outs) == 3:
                client.abort("ended")
            elif len(outs) > 3:
                after += len(out.outputs[0].token_ids)
        return outs, after

    outs, after = asyncio.run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert after <= 1, f"{after} tokens came after the abort"
    stats = client.stats()
    assert stats.num_running == 0 and stats.num_free_pages == stats.num_pages


def test_a_tenant_and_its_prompt_progress_cross_to_the_engine_and_back(client):
    """The engine serves a request for its tenant (whose load the stats show while it runs) and reports how far
    its prompt's prefill has come, before the first token."""
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    prompt = "Tell me a long story"

    async def main():
        stream = client.generate(prompt, params, "tenant", Tenant("key-0123456789ab"))
        first = await anext(stream)
        for _ in range(100):  # stats come with the step's outputs: the next step's say it runs
            if loads := client.stats().tenants:
                break
            await asyncio.sleep(0.05)
        await stream.aclose()
        return first, loads

    first, loads = asyncio.run(main())
    total = len(first.prompt_token_ids)
    assert first.prompt_progress is not None and (first.prompt_progress.processed, first.prompt_progress.total) \
        == (total, total)
    assert [(load.tenant, load.running, load.waiting) for load in loads] == [("key-0123456789ab", 1, 0)]


def test_the_event_loop_keeps_running_during_forward_passes(client):
    """A loop blocked by the forward passes would tick once a step; measured against this machine's own step pace
    (the gaps between the stream's deltas), nine ticks in ten come within a step."""
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)

    async def main():
        ticks, steps, done = [], [], False

        async def ticker():
            while not done:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.005)

        task = asyncio.create_task(ticker())
        async for _ in client.generate("word " * 400, params, "busy"):
            steps.append(time.monotonic())
        done = True
        await task
        return gaps(ticks), gaps(steps)

    tick_gaps, step_gaps = asyncio.run(main())
    assert statistics.quantiles(tick_gaps, n=10)[-1] < statistics.median(step_gaps)


def gaps(stamps: list[float]) -> list[float]:
    return [b - a for a, b in zip(stamps, stamps[1:])]


def test_a_refused_request_raises_for_it_alone(client):
    async def main():
        with pytest.raises(InvalidRequest, match="maximum context length") as refused:
            await collect(client, [5] * 9000, SamplingParams(max_tokens=10), "too-long")
        return refused.value, await collect(client, "Hi", SamplingParams(temperature=0, max_tokens=4), "fine")

    refused, (text, outs) = asyncio.run(main())
    assert refused.code == "context_length_exceeded"
    assert outs[-1].finished and text


def test_a_request_the_engine_fails_raises_for_it_alone(client):
    """The reported bug: one request's failure inside a step ended every stream with "engine error"."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    culprit = SamplingParams(temperature=1.0, seed=666, max_tokens=24)  # the planted sampler fault

    async def main():
        solo = await collect(client, "The capital of France is", params, "alone")
        neighbours = [asyncio.ensure_future(collect(client, "The capital of France is", params, f"neighbour-{i}"))
                      for i in range(3)]
        with pytest.raises(RequestError, match="injected fault"):
            await collect(client, "Hi", culprit, "culprit")
        return solo, await asyncio.gather(*neighbours)

    (solo_text, _), neighbours = asyncio.run(main())
    assert [text for text, _ in neighbours] == [solo_text] * 3
    assert all(outs[-1].outputs[0].finish_reason == "length" for _, outs in neighbours)
    assert client.health(stall_timeout=60) is None


def test_a_constrained_request_gets_what_the_offline_engine_computes(client, offline):
    """The constraint crosses with the request; the front checks constraints itself (as vLLM's does), and its
    refusal is a StructuredOutputError naming the field, which the server renames to the request's own."""
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "why": {"type": "string",
              "maxLength": 12}}, "required": ["answer", "why"], "additionalProperties": False}
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema))
    want = offline.generate(["Is the sky blue? Answer in JSON."], params)[0].outputs[0]

    async def main():
        await client.check_structured_output(params.structured_outputs)
        with pytest.raises(StructuredOutputError) as refused:
            await client.check_structured_output(StructuredOutputsParams(json={"type": "array", "uniqueItems": True}))
        return refused.value, await collect(client, "Is the sky blue? Answer in JSON.", params, "constrained")

    refused, (text, outs) = asyncio.run(main())
    assert refused.field == "json" and "uniqueItems" in refused.reason
    assert text == want.text and outs[-1].outputs[0].finish_reason == want.finish_reason == "stop"


def test_a_command_the_engine_core_cannot_read_leaves_it_serving(client):
    """A request that would not decode (a front of another version, a type the wire does not carry) is
    refused on its own; the engine core goes on with the next one."""
    bad = msgspec.msgpack.encode({"type": "AddRequest", "request_id": "unreadable", "prompt_token_ids": "text",
                                  "params": {}})
    for replica in client.replicas:
        replica.send(bad)
    text, outs = asyncio.run(collect(client, "Hi", SamplingParams(temperature=0, max_tokens=4), "after"))
    assert outs[-1].finished and text
    assert client.health(60) is None


def test_probes_and_snapshots_read_what_the_offline_engine_reads(client, offline):
    """The inspector's calls go through the loop, beside a running stream: a probe's raw logits and logit lens
    (a tensor on the wire), a snapshot of the pool and the recent steps; a cancelled probe frees its pages."""
    ids = offline.tokenizer.encode("The capital of France is")
    offline.engine.add_probe("here", ids, Probe(lens_top=3))
    want = next(out for step in iter(offline.engine.step, []) for out in step if out.finished).inspection
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    async def main():
        streaming = asyncio.create_task(collect(client, "Once upon a time", params, "beside"))
        probes = await asyncio.gather(*(client.probe(ids, Probe(lens_top=k), f"probe-{k}") for k in (0, 3)))
        during = await client.snapshot(8)
        await streaming
        long = asyncio.create_task(client.probe(client.tokenizer.encode("word " * 1000), Probe(), "cancelled"))
        while (await client.snapshot(0)).stats.num_running == 0:  # until admitted (a prefill of two chunks)
            await asyncio.sleep(0.01)
        long.cancel()
        await asyncio.gather(long, return_exceptions=True)
        for _ in range(100):  # the abort lands within a step or two
            after = await client.snapshot(0)
            if after.stats.num_running == 0 and after.stats.num_free_pages == after.stats.num_pages:
                break
            await asyncio.sleep(0.05)
        return probes, during, after

    probes, during, after = asyncio.run(main())
    plain, lens = probes[0].inspection, probes[1].inspection
    # The probes may share a step with the stream (or not), which moves float32's last bits on some CPUs.
    assert plain.logits.dtype == torch.float32 and plain.lens is None
    assert all(torch.allclose(read.logits, want.logits, atol=1e-4) for read in (plain, lens))
    assert [layer.token_ids for layer in lens.lens] == [layer.token_ids for layer in want.lens]
    assert during.model == offline.model_config and during.stats.num_pages == client.stats().num_pages
    assert during.stats.num_running >= 1 and 1 <= len(during.steps) <= 8
    assert during.steps[-1].prefill_tokens + during.steps[-1].decode_tokens > 0
    assert after.stats.num_running == after.stats.num_waiting == 0
    assert after.stats.num_free_pages == after.stats.num_pages and after.steps == []


def test_a_pin_holds_its_pages_for_the_requests_that_begin_with_it_until_deleted(client):
    """Pins go through the loop too: a pin holds its prompt's full pages, is listed, is found cached by a
    request beginning with it, and deleting it gives every page back."""
    ids = client.tokenizer.encode("The weather in the north of Scotland, day by day. " * 6)
    params = SamplingParams(temperature=0, max_tokens=4)

    async def main():
        pin = await client.pin(ids, PinSpec("weather", ttl=600), "pin-weather")
        listed, held = await client.pins(), await client.snapshot(0)
        _, outs = await collect(client, ids + ids[:5], params, "after-pin")
        removed, again = await client.unpin("weather"), await client.unpin("weather")
        return pin, listed, held, outs[-1], removed, again, await client.snapshot(0)

    pin, listed, held, out, removed, again, after = asyncio.run(main())
    pages = len(ids) // CONFIG.page_size
    assert (pin.name, pin.num_pages, pin.num_tokens) == ("weather", pages, pages * CONFIG.page_size)
    assert [p.name for p in listed] == ["weather"] and listed[0].expires_at is not None
    assert held.stats.pinned_pages == pages and held.stats.num_free_pages == held.stats.num_pages - pages
    assert out.num_cached_tokens >= pin.num_tokens
    assert (removed, again) == (True, False)
    assert after.pins == [] and after.stats.num_free_pages == after.stats.num_pages


def test_health_tells_a_stall_with_work_pending_from_an_idle_engine(client, gate, monkeypatch):
    clock = Clock(time.monotonic())
    monkeypatch.setattr(client, "clock", clock)

    async def main():
        clock.now += 3600
        idle = client.health(stall_timeout=10)  # no work for an hour: an old heartbeat is no stall
        task = asyncio.ensure_future(collect(client, "Hi", SamplingParams(temperature=0, max_tokens=4), "slow"))
        await gate.stalled()  # in its first step, before which the idle engine sent nothing
        clock.now += 10
        within = client.health(stall_timeout=10)
        clock.now += 1
        stalled = client.health(stall_timeout=10)
        gate.release()
        await task
        return idle, within, stalled

    idle, within, stalled = asyncio.run(main())
    assert (idle, within) == (None, None)
    assert stalled == "the engine has made no progress for 11 s with requests pending"
    assert client.health(stall_timeout=10) is None  # it moved again


def test_a_failed_engine_loop_ends_every_stream_and_refuses_later_requests(transport):
    with planted(*FAULTS):
        dying = EngineCoreClient(EngineConfig(kv_cache_memory="16MiB"), TRANSPORTS[transport]).start()
    try:
        async def main():
            stream = dying.generate("Tell me a story", SamplingParams(max_tokens=400, ignore_eos=True), "running")
            await anext(stream)
            with planted(*FAULTS):  # the thread transport's engine runs here, and must meet the fault
                breaking = asyncio.ensure_future(anext(dying.generate("Hi", SamplingParams(max_tokens=4),
                                                                      "break-the-loop")))
                with pytest.raises(EngineDead, match="scheduler's state is broken"):
                    async for _ in stream:
                        pass
                with pytest.raises(EngineDead, match="scheduler's state is broken"):
                    await breaking
            with pytest.raises(EngineDead):
                await anext(dying.generate("Hi", SamplingParams(max_tokens=4), "later"))

        asyncio.run(main())
        assert dying.health(stall_timeout=60) == "the engine failed: RuntimeError: the scheduler's state is broken"
    finally:
        dying.close()


def test_closing_while_an_engine_thread_is_in_a_step_lets_it_end_quietly(monkeypatch, caplog, tmp_path):
    """close() gives the engine cores SHUTDOWN_WAIT_S; a thread still in a step after that ends at its next
    socket call, on sockets nobody closed under it: no failure, nothing logged."""
    monkeypatch.setattr(placement, "SHUTDOWN_WAIT_S", 0.2)
    gate = Gate(tmp_path)
    with planted(gate.stall("slow", at_step=1, seconds=2)):
        engine = EngineCoreClient(EngineConfig(kv_cache_memory="16MiB"), TRANSPORTS["thread"]).start()

        async def main():
            stream = engine.generate("Tell me a story", SamplingParams(max_tokens=8), "slow")
            first = asyncio.ensure_future(anext(stream))
            await gate.stalled()
            engine.close()
            first.cancel()

        with caplog.at_level(logging.WARNING):
            asyncio.run(main())
            thread = engine.replicas[0].thread
            thread.join(10)
    assert not thread.is_alive()
    assert not caplog.records, caplog.text
