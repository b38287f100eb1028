"""The process boundary: an engine core in a process of its own streams what the in-process engine computes,
token for token, and reads what it reads (the inspector's probes and snapshots); an abort lands before its
next step; a refusal reaches its request alone."""
from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch

from zhuzi import LLM, SamplingParams
from zhuzi.config import EngineConfig, ParallelConfig
from zhuzi.engine.core_client import EngineClient
from zhuzi.engine.sequence import Probe
from zhuzi.sampling_params import InvalidRequest, StructuredOutputError, StructuredOutputsParams

CONFIG = EngineConfig(dtype="float32", kv_cache_memory="64MiB")  # fp32: batch-invariant


@pytest.fixture(scope="module")
def client():
    engine = EngineClient(CONFIG, ParallelConfig()).start()
    yield engine
    engine.close()


async def collect(engine, prompt, params, rid):
    outs = [out async for out in engine.generate(prompt, params, rid)]
    text = "".join(c.text for out in outs for c in out.outputs)
    return text, outs


def test_streams_from_the_engine_process_equal_the_in_process_engine(client):
    """Deltas cross as lean messages (the prompt stays in front, timings come once, prompt logprobs once):
    what a client reads is what the in-process engine computes."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time"]
    offline = LLM(**vars(CONFIG)).generate(prompts, params)

    async def main():
        return await asyncio.gather(*(collect(client, p, params, f"r{i}") for i, p in enumerate(prompts)))

    for (text, outs), want in zip(asyncio.run(main()), offline):
        assert len(outs) > 1 and outs[-1].finished  # streamed in pieces
        assert text == want.outputs[0].text
        assert [t for out in outs for t in out.outputs[0].token_ids] == want.outputs[0].token_ids
        logprobs = [lp for out in outs for lp in out.outputs[0].logprobs]
        assert [{t: round(x.logprob, 4) for t, x in lp.items()} for lp in logprobs] == \
            [{t: round(x.logprob, 4) for t, x in lp.items()} for lp in want.outputs[0].logprobs]
        assert all(out.prompt_token_ids == want.prompt_token_ids for out in outs)
        first_prompt_logprobs = next(out.prompt_logprobs for out in outs if out.prompt_logprobs)
        assert len(first_prompt_logprobs) == len(want.prompt_token_ids)
        assert outs[-1].metrics.e2e_latency > 0 and outs[-1].metrics.time_to_first_token > 0


def test_an_abort_lands_before_the_next_step(client):
    """The abort goes out as soon as it is asked for and the engine core applies it before its next step:
    at most the step already running when it arrived still yields a token."""
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
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks


def test_a_refused_request_raises_for_it_alone(client):
    async def main():
        with pytest.raises(InvalidRequest, match="maximum context length") as refused:
            await collect(client, [5] * 9000, SamplingParams(max_tokens=10), "too-long")
        return refused.value, await collect(client, "Hi", SamplingParams(temperature=0, max_tokens=4), "fine")

    refused, (text, outs) = asyncio.run(main())
    assert refused.code == "context_length_exceeded"
    assert outs[-1].finished and text


def test_a_constrained_request_gets_what_the_in_process_engine_computes(client):
    """The constraint crosses with the request; the front checks constraints itself (as vLLM's does), and its
    refusal is a StructuredOutputError naming the field, which the server renames to the request's own."""
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "why": {"type": "string",
              "maxLength": 12}}, "required": ["answer", "why"], "additionalProperties": False}
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema))
    want = LLM(**vars(CONFIG)).generate(["Is the sky blue? Answer in JSON."], params)[0].outputs[0]

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


def test_probes_and_snapshots_read_what_the_in_process_engine_reads(client):
    """The inspector's calls cross too: a probe's raw logits and logit lens (a tensor on the wire), a snapshot of
    the pool and the recent steps."""
    llm = LLM(**vars(CONFIG))
    ids = llm.engine.tokenizer.encode("The capital of France is")
    llm.engine.add_probe("here", ids, Probe(lens_top=3))
    outs = [out for step in iter(llm.engine.step, []) for out in step]
    want = next(out for out in outs if out.finished).inspection

    async def main():
        reading = await client.probe(ids, Probe(lens_top=3), "there")
        return reading, await client.snapshot(8)

    reading, snapshot = asyncio.run(main())
    got = reading.inspection
    assert got.logits.dtype == torch.float32 and got.logits.shape == want.logits.shape
    assert torch.allclose(got.logits, want.logits, atol=1e-4)
    assert [layer.token_ids for layer in got.lens] == [layer.token_ids for layer in want.lens]
    assert snapshot.stats.num_blocks == client.stats().num_blocks and snapshot.model == llm.engine.model_config
    assert snapshot.steps and snapshot.steps[-1].prefill_tokens + snapshot.steps[-1].decode_tokens > 0
