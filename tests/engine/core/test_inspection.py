"""Inspections (probes) through the step loop on the real SmolLM2: they read the very distribution a step
sampled from, the logit lens ends in the model's output, they change no one else's result, and they
return every page."""
import pytest
import torch

from zhuzi import SamplingParams
from zhuzi.config import EngineConfig
from zhuzi.engine.core.engine_core import EngineCore
from zhuzi.engine.sequence import Probe
from zhuzi.outputs import RequestOutput, StepRow
from zhuzi.sampling_params import InvalidRequest

PROMPT = "The capital of France is"
REPLY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=20)


@pytest.fixture(scope="module")
def engine():
    return EngineCore(EngineConfig(dtype="float32", kv_cache_memory="64MiB"))  # fp32: a re-run reproduces a step


def run(engine: EngineCore) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def reply(engine: EngineCore, request_id: str) -> tuple[list[int], list[int], list[dict]]:
    """A greedy reply's prompt ids, token ids and per-step logprobs (top 20)."""
    engine.add_request(request_id, PROMPT, REPLY)
    outs = run(engine)[request_id]
    ids = [t for out in outs for c in out.outputs for t in c.token_ids]
    logprobs = [e for out in outs for c in out.outputs for e in c.logprobs]
    return outs[0].prompt_token_ids, ids, logprobs


def assert_all_pages_free(engine: EngineCore) -> None:
    assert not engine.has_unfinished() and engine.pages.num_free_pages == engine.pages.num_pages


def test_a_probe_reads_the_distribution_each_step_sampled_from(engine):
    prompt, ids, steps = reply(engine, "reply")
    for i in range(len(ids)):  # all at once: they share one step
        engine.add_probe(f"probe-{i}", prompt + ids[:i], Probe())
    outs = run(engine)
    for i, (token, step) in enumerate(zip(ids, steps)):
        (out,) = outs[f"probe-{i}"]
        assert out.finished and out.outputs == [] and out.inspection.lens is None
        logprobs = out.inspection.logits.log_softmax(-1)
        assert int(logprobs.argmax()) == token  # greedy took the argmax
        assert all(abs(logprobs[t].item() - lp.logprob) < 1e-4 for t, lp in step.items())
        assert out.num_cached_tokens >= len(prompt) // 16 * 16  # the reply's pages were found cached
    assert_all_pages_free(engine)


def test_the_logit_lens_has_every_layer_and_ends_in_the_output(engine):
    ids = engine.tokenizer.encode(PROMPT)  # shorter than a page: each probe computes all of it
    engine.add_probe("plain", ids, Probe())
    plain = run(engine)["plain"][0].inspection
    engine.add_probe("lens", ids, Probe(lens_top=5))  # the very step plain ran, with the layers tapped
    lens = run(engine)["lens"][0].inspection
    assert len(lens.lens) == engine.model_config.num_layers
    assert all(len(layer.token_ids) == len(layer.logprobs) == 5 for layer in lens.lens)
    top = plain.logits.log_softmax(-1).topk(5)
    assert lens.lens[-1].token_ids == top.indices.tolist()
    assert max(abs(a - b) for a, b in zip(lens.lens[-1].logprobs, top.values.tolist())) < 1e-4
    assert lens.lens[0].token_ids != lens.lens[-1].token_ids  # the first layer has not found the answer yet
    assert torch.equal(lens.logits, plain.logits)  # the lens costs the batch nothing in precision
    assert_all_pages_free(engine)


def test_probes_in_the_batch_change_no_reply(engine):
    _, alone, alone_steps = reply(engine, "alone")
    engine.add_request("beside", PROMPT, REPLY)
    outs = []
    for k in range(4):  # a probe joins each of the first steps
        engine.add_probe(f"probe-{k}", engine.tokenizer.encode(f"Question {k}: why is the sky blue?"),
                         Probe(lens_top=3 if k % 2 else 0))
        outs += engine.step()
    outs += [out for per_request in run(engine).values() for out in per_request]
    beside = [c for out in outs if out.request_id == "beside" for c in out.outputs]
    assert [t for c in beside for t in c.token_ids] == alone
    steps = [e for c in beside for e in c.logprobs]
    assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for a, b, t in zip(steps, alone_steps, alone))
    assert_all_pages_free(engine)


def test_a_probe_is_checked_like_a_prompt(engine):
    with pytest.raises(InvalidRequest) as bad:
        engine.add_probe("bad", [1, engine.model_config.vocab_size], Probe())
    assert bad.value.param == "prompt"
    with pytest.raises(InvalidRequest) as long:
        engine.add_probe("long", [1] * engine.max_model_len, Probe())
    assert long.value.code == "context_length_exceeded"
    assert_all_pages_free(engine)


def test_an_aborted_probe_returns_its_pages(engine):
    engine.add_probe("aborted", engine.tokenizer.encode("word " * 200), Probe(lens_top=2))
    engine.abort("aborted")
    assert run(engine) == {}
    assert_all_pages_free(engine)


def test_the_snapshot_shows_the_pool_and_the_recent_steps(engine):
    engine.add_request("busy", "Tell me a story " * 5, SamplingParams(max_tokens=6, ignore_eos=True))
    engine.step()
    busy = engine.snapshot(4)
    assert busy.stats.num_running == 1 and busy.stats.num_free_pages < busy.stats.num_pages
    run(engine)
    idle = engine.snapshot(5)
    assert idle.stats.num_running == 0 and idle.stats.num_free_pages == idle.stats.num_pages
    assert len(idle.steps) == 5 and [s.decode_tokens for s in idle.steps] == [1] * 5
    assert [s.kv_tokens_read for s in idle.steps] == list(range(idle.steps[0].kv_tokens_read,
                                                                idle.steps[0].kv_tokens_read + 5))
    prompt = len(engine.tokenizer.encode("Tell me a story " * 5))
    assert busy.steps[-1].rows == [StepRow("busy", "prefill", prompt, prompt)]  # the prompt's step
    assert [(r.kind, r.tokens, r.context) for s in idle.steps for r in s.rows] == [
        ("decode", 1, s.kv_tokens_read) for s in idle.steps]
    assert [s.index for s in idle.steps] == list(range(idle.steps[0].index, idle.steps[0].index + 5))
    c = idle.model
    assert idle.kv_plan.bytes_per_token == 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4  # float32
    assert idle.kv_plan.num_pages == idle.stats.num_pages
    assert 1e8 < idle.read_bandwidth < 1e13 and idle.cached_pages > 0
    assert engine.snapshot(0).steps == []
