"""Fault isolation on the real SmolLM2 checkpoint: a request whose step raises fails alone, with a clear
error, and the requests batched with it finish with the tokens they get without it."""
import pytest
from faults import FailingSampler, Unchecked

from zhuzi import SamplingParams
from zhuzi.config import EngineConfig
from zhuzi.engine.core.engine_core import EngineCore
from zhuzi.llm import merge
from zhuzi.outputs import RequestOutput
from zhuzi.sample.sampler import Sampler

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time"]
# Greedy, seeded sampling with the truncations, and penalties: each row kind of the sampler.
PARAMS = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
          SamplingParams(temperature=1.0, top_k=40, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True),
          SamplingParams(temperature=0.8, presence_penalty=0.5, repetition_penalty=1.2, seed=3, max_tokens=16,
                         ignore_eos=True)]
REQUESTS = {f"r{i}": (prompt, params) for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS))}


@pytest.fixture(scope="module")
def engine():
    # fp32: batch-invariant
    return EngineCore(EngineConfig(dtype="float32", quantization="gguf", kv_cache_memory="64MiB"))


def run(engine: EngineCore, requests: dict[str, tuple[str, SamplingParams]], join_after: int = 0,
        late: dict[str, tuple[str, SamplingParams]] | None = None) -> dict[str, RequestOutput]:
    """Step until every request ends; the `late` ones join the running batch after join_after steps."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    results: dict[str, RequestOutput] = {}
    steps = 0
    while engine.has_unfinished() or late:
        if late and steps == join_after:
            for rid, (prompt, params) in late.items():
                engine.add_request(rid, prompt, params)
            late = None
        for out in engine.step():
            results[out.request_id] = merge(results.get(out.request_id), out)
        steps += 1
    return results


def tokens(results: dict[str, RequestOutput], rids) -> dict[str, list[int]]:
    return {rid: results[rid].outputs[0].token_ids for rid in rids}


@pytest.fixture(scope="module")
def reference(engine) -> dict[str, list[int]]:
    """REQUESTS' tokens without a fault (seeded or greedy: the same on every run of the engine)."""
    return tokens(run(engine, REQUESTS), REQUESTS)


def assert_all_pages_free(engine: EngineCore) -> None:
    assert not engine.has_unfinished()
    assert (len(engine.scheduler.running), len(engine.scheduler.waiting)) == (0, 0)
    assert engine.pages.num_free_pages == engine.pages.num_pages


def test_an_overflowing_parameter_fails_its_request_alone(engine):
    """As in the reported attack (top_k = 2**64, now refused at admission), a number too large for a tensor
    overflows in the sampler: it joins a running batch, only it fails, and the others match a run where a
    sane twin stood in for it."""
    others = {f"other-{i}": request for i, request in enumerate(REQUESTS.values())}
    twin = {"twin": ("Hi", SamplingParams(temperature=1.0, logprobs=5, max_tokens=16, ignore_eos=True))}
    culprit = {"culprit": ("Hi", Unchecked(temperature=1.0, logprobs=2**64, max_tokens=16, ignore_eos=True))}
    reference = run(engine, others, join_after=3, late=twin)
    faulty = run(engine, others, join_after=3, late=culprit)
    assert tokens(faulty, others) == tokens(reference, others)
    assert all(faulty[rid].outputs[0].finish_reason == "length" and not faulty[rid].error for rid in others)
    failed = faulty["culprit"]
    assert failed.finished and "Overflow" in failed.error and failed.outputs[0].finish_reason == "error"
    assert_all_pages_free(engine)


def test_a_fault_in_the_middle_of_a_generation_fails_that_request_alone(engine, reference):
    culprit = REQUESTS["r1"][1]
    engine.runner.sampler = FailingSampler(culprit, from_step=6)
    try:
        faulty = run(engine, REQUESTS)
    finally:
        engine.runner.sampler = Sampler()
    assert faulty["r1"].error == "RuntimeError: injected fault"
    assert len(faulty["r1"].outputs[0].token_ids) == 5  # the tokens before the fault were delivered
    assert faulty["r1"].outputs[0].finish_reason == "error"
    assert tokens(faulty, ["r0", "r2"]) == {rid: reference[rid] for rid in ("r0", "r2")}
    assert_all_pages_free(engine)


def test_a_step_that_fails_once_is_retried_and_nobody_notices(engine, reference):
    execute, calls = engine.runner.execute, []

    def flaky(batch):
        calls.append(len(batch))
        if len(calls) == 4:
            raise RuntimeError("a passing fault")
        return execute(batch)

    engine.runner.execute = flaky
    try:
        again = run(engine, REQUESTS)
    finally:
        engine.runner.execute = execute
    assert len(calls) > 4 and calls[3] == calls[4]  # the failed step ran again, whole
    assert tokens(again, REQUESTS) == reference
    assert not any(out.error for out in again.values())
    assert_all_pages_free(engine)


def test_a_step_that_fails_twice_fails_its_requests_and_the_engine_goes_on(engine):
    execute = engine.runner.execute

    def broken(batch):
        raise RuntimeError("the forward pass is broken")

    engine.runner.execute = broken
    try:
        failed = run(engine, REQUESTS)
    finally:
        engine.runner.execute = execute
    assert {out.error for out in failed.values()} == {"RuntimeError: the forward pass is broken"}
    assert_all_pages_free(engine)
    after = run(engine, {"after": REQUESTS["r0"]})["after"]
    assert after.error is None and len(after.outputs[0].token_ids) == 16


def test_abort_ends_the_request_with_finish_reason_abort(engine):
    engine.add_request("long", "Tell me a story", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    while engine.requests["long"].seqs[0].num_output_tokens < 4:
        engine.step()
    out = engine.abort("long")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.abort("long") is None  # already gone
    assert_all_pages_free(engine)
