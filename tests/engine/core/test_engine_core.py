"""Serving-engine invariants on the real SmolLM2 checkpoint: batching, prefix caching, chunked
prefill and preemption never change a greedy result, and every KV page comes back. The invariants run in
float32 on the file's own Q4_1 blocks, as served (a fifth of the dense reference's bytes a step)."""
import dataclasses
import random

import pytest
import tiny
import torch

from zhuzi import LLM, SamplingParams
from zhuzi.config import EngineConfig
from zhuzi.engine.core.engine_core import EngineCore
from zhuzi.engine.core.kv.page_manager import FREED
from zhuzi.model.kv_pool import KVShape
from zhuzi.model.loader import default_model_path, load_model_config
from zhuzi.sampling_params import InvalidRequest
from zhuzi.tokenizer import Tokenizer

pytestmark = pytest.mark.long  # a minute or more: handed out first (tests/conftest.py)

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
NEAR_TIE = 1e-4


def mixed_prompts(tokenizer, count: int = 8, longest: int = 300, seed: int = 0) -> list[list[int]]:
    """Real text, 8 to `longest` tokens."""
    rng = random.Random(seed)
    words = ("the river city light morning question answer model token people write small house "
             "garden music number paper window road story").split()
    lengths = [8, longest] + [rng.randint(8, longest) for _ in range(count - 2)]
    prompts = []
    for n in lengths:
        ids = tokenizer.encode(" ".join(rng.choice(words) for _ in range(n)))
        prompts.append(ids[:n])
    return prompts


def assert_same_or_near_tie(a, b):
    """Token for token; a difference is only allowed where the two best tokens were within NEAR_TIE,
    and until then the chosen tokens' logprobs agree within NEAR_TIE."""
    for out_a, out_b in zip(a, b):
        ta, tb = out_a.outputs[0], out_b.outputs[0]
        for i, (x, y) in enumerate(zip(ta.token_ids, tb.token_ids)):
            lp_a, lp_b = ta.logprobs[i], tb.logprobs[i]
            if x != y:
                ranked = sorted(lp_a.values(), key=lambda lp: lp.rank)
                assert ranked[0].logprob - ranked[1].logprob < NEAR_TIE, f"token {i} differs and is no near-tie"
                break
            assert abs(lp_a[x].logprob - lp_b[y].logprob) < NEAR_TIE
        else:
            assert ta.token_ids == tb.token_ids


@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts(Tokenizer.load(default_model_path()))


@pytest.fixture(scope="module")
def alone(prompts):
    """Each prompt on its own: the reference, with its prompt logprobs too (computed apart from the sampled
    token's logits, they change nothing else)."""
    llm = LLM(dtype="float32", quantization="gguf", enable_prefix_caching=False)
    return [llm.generate([p], dataclasses.replace(GREEDY, prompt_logprobs=1))[0] for p in prompts]


def run_together(prompts, **options):
    llm = LLM(dtype="float32", quantization="gguf", **options)
    outs = llm.generate(prompts, GREEDY)
    engine = llm.engine
    assert engine.pages.num_free_pages == engine.pages.num_pages  # every page returned
    return outs, engine


def test_batching_never_changes_a_greedy_result(prompts, alone):
    together, _ = run_together(prompts, enable_prefix_caching=False)
    assert_same_or_near_tie(alone, together)


def test_prefix_caching_never_changes_a_greedy_result(prompts, alone):
    # Each prompt twice: the second copies find the first ones' pages in the cache.
    cached, engine = run_together(prompts[:4] + prompts[:4], enable_prefix_caching=True)
    assert_same_or_near_tie(alone[:4] + alone[:4], cached)
    assert engine.pages.prefix_hits > 0


def test_chunked_prefill_never_changes_a_greedy_result(prompts, alone):
    chunked, _ = run_together(prompts, max_num_batched_tokens=64)
    assert_same_or_near_tie(alone, chunked)


def test_preemption_never_changes_a_greedy_result(prompts, alone):
    # 20 pages of 16 tokens: the longest request (300 + 12) just fits alone. Steps of 256 tokens admit
    # prompts a part at a time, so the pool runs out again and again (decoding requests are preempted too),
    # and without the prefix cache a preempted request computes all its tokens again.
    preempted, engine = run_together(prompts, kv_cache_memory=20 * 16 * 46080, max_num_batched_tokens=256,
                                     enable_prefix_caching=False)
    assert engine.pages.num_pages == 20
    assert engine.scheduler.num_preemptions >= 3
    assert_same_or_near_tie(alone, preempted)


# -- engine mechanics on the default bf16 model ------------------------------------------


@pytest.fixture(scope="module")
def engine():
    return EngineCore(EngineConfig(max_num_batched_tokens=64, kv_cache_memory="64MiB"))


def run(engine: EngineCore, until=lambda: False) -> dict:
    """Step until done (or until `until()`); returns request id -> concatenated text deltas."""
    texts: dict[str, str] = {}
    while engine.has_unfinished() and not until():
        for out in engine.step():
            for c in out.outputs:
                texts[out.request_id] = texts.get(out.request_id, "") + c.text
    return texts


def assert_all_pages_free(engine: EngineCore):
    assert not engine.has_unfinished()
    assert engine.pages.num_free_pages == engine.pages.num_pages
    assert not any(engine.pages.ref_counts)


def test_abort_in_every_state_returns_every_page(engine):
    long_prompt = engine.tokenizer.encode("word " * 300)
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"decoding-{i}", "Tell me a story", params)
    engine.add_request("prefilling", long_prompt, params)
    engine.add_request("waiting", long_prompt, params)
    seqs = {rid: engine.requests[rid].seqs[0] for rid in engine.requests}
    run(engine, until=lambda: 0 < seqs["prefilling"].num_computed_tokens < len(long_prompt))
    assert seqs["decoding-0"].num_output_tokens > 0 and seqs["waiting"].status.value == "waiting"
    for rid in ("prefilling", "waiting", "decoding-0"):
        engine.abort(rid)
    run(engine)
    assert_all_pages_free(engine)


def test_abort_of_a_preempted_request_and_resumed_ones_return_every_page():
    engine = EngineCore(EngineConfig(kv_cache_memory=12 * 16 * 23040, max_num_batched_tokens=256))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"r{i}", engine.tokenizer.encode(f"{i} " * 20), params)

    def victims() -> list:
        return [s for r in engine.requests.values() for s in r.seqs if s.num_preemptions]

    run(engine, until=lambda: bool(victims()))
    assert victims(), "the pool was meant to run out"
    engine.abort(victims()[0].request_id)
    run(engine)
    assert engine.scheduler.num_preemptions >= 2  # another request was preempted, and resumed
    assert_all_pages_free(engine)


def test_second_turn_computes_only_its_new_tokens(engine):
    params = SamplingParams(temperature=0, max_tokens=20)
    history = [{"role": "user", "content": "Name three rivers in Europe and say one thing about each."}]
    first = engine.tokenizer.encode_chat(history)
    engine.add_request("turn-1", first, params)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    reply_ids = [t for o in outs for c in o.outputs for t in c.token_ids]
    reply = "".join(c.text for o in outs for c in o.outputs)
    history += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Which is longest?"}]
    second = engine.tokenizer.encode_chat(history)
    queries, hits = engine.pages.prefix_queries, engine.pages.prefix_hits
    engine.add_request("turn-2", second, params)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    # Turn 1's prompt and reply sit in the cache; every whole page of what turn 2 shares with
    # them is reused, so only the new messages (and a partial page) are computed.
    seen = first + reply_ids
    common = next(i for i, (a, b) in enumerate(zip(seen + [-1], second)) if a != b)
    cached = outs[-1].num_cached_tokens
    assert common > len(first)
    assert cached == min(common, len(second) - 1) // 16 * 16
    assert engine.pages.prefix_queries - queries == len(second)
    assert engine.pages.prefix_hits - hits == cached
    assert outs[-1].metrics.num_cached_tokens == cached
    assert_all_pages_free(engine)


def test_n_samples_share_the_prompt_pages_and_seeds_reproduce(engine):
    prompt = engine.tokenizer.encode("Write a short poem about the sea. " * 6)
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    hits = engine.pages.prefix_hits
    engine.add_request("poem", prompt, params)
    first = run(engine)["poem"]
    shared = (len(prompt) - 1) // 16 * 16
    assert engine.pages.prefix_hits - hits >= 3 * shared  # samples 2-4 reuse sample 1's prompt pages
    llm_outputs = []
    for rid in ("again-1", "again-2"):
        engine.add_request(rid, prompt, params)
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        tokens = {}
        for out in outs:
            for c in out.outputs:
                tokens.setdefault(c.index, []).extend(c.token_ids)
        llm_outputs.append(tokens)
    assert llm_outputs[0] == llm_outputs[1]  # same seed, same samples
    assert len({tuple(t) for t in llm_outputs[0].values()}) == 4  # the 4 samples differ
    assert first
    assert_all_pages_free(engine)


def test_streamed_deltas_concatenate_to_the_final_text_with_stop_strings(engine):
    llm_text = {}
    prompt = "List the numbers from one to ten in words: one, two, three,"
    engine.add_request("full", prompt, SamplingParams(temperature=0, max_tokens=30))
    full = run(engine)["full"]
    stop = full[10:14]  # a stop string that spans token boundaries inside the real output
    for include in (False, True):
        rid = f"stop-{include}"
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=30, stop=[stop],
                                                       include_stop_str_in_output=include))
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        llm_text[include] = "".join(c.text for o in outs for c in o.outputs)
        last = outs[-1].outputs[-1]
        assert (last.finish_reason, last.stop_reason) == ("stop", stop)
    assert llm_text[False] == full[:full.index(stop)]
    assert llm_text[True] == full[:full.index(stop)] + stop
    assert_all_pages_free(engine)


def test_an_emoji_split_over_tokens_arrives_whole(engine):
    cat = engine.tokenizer.encode("🐱")
    assert len(cat) == 3  # each piece alone decodes to U+FFFD
    engine.add_request("cat", "🐱" * 10, SamplingParams(temperature=0, max_tokens=9))  # the model copies it
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    ids = [t for o in outs for c in o.outputs for t in c.token_ids]
    pieces = [c.text for o in outs for c in o.outputs]
    assert ids == cat * 3
    assert pieces.count("🐱") == 3 and "".join(pieces) == "🐱" * 3
    assert all("\ufffd" not in p for p in pieces)


def test_requests_that_can_never_fit_are_refused_with_the_numbers(engine):
    with pytest.raises(ValueError, match=r"8192 tokens.*8200"):
        engine.add_request("too-long", [5] * 8000, SamplingParams(max_tokens=200))
    small = EngineCore(EngineConfig(kv_cache_memory=4 * 16 * 23040))
    with pytest.raises(ValueError, match="64 tokens"):
        small.add_request("too-big", [5] * 60, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("empty", [], SamplingParams())


def test_metrics_record_every_phase(engine):
    engine.add_request("timed", "Hello there", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    m = outs[-1].metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert m.queue_time >= 0 and m.prefill_time > 0 and m.time_to_first_token > 0
    assert len(m.decode_step_times) == 7 and all(t > 0 for t in m.decode_step_times)


def test_a_long_prompt_is_chunked_beside_running_streams_which_get_a_token_every_step():
    engine = EngineCore(EngineConfig(kv_cache_memory="64MiB", max_num_batched_tokens=512,
                                 long_prefill_token_threshold=128))
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)  # outlasts the long prompt's 5 chunks
    engine.add_request("stream", "Tell me a story", params)
    while not engine.requests["stream"].seqs[0].num_output_tokens:
        engine.step()
    long_prompt = engine.tokenizer.encode("word " * 1000)[:600]
    engine.add_request("long", long_prompt, SamplingParams(temperature=0, max_tokens=2))
    stream, long = engine.requests["stream"].seqs[0], engine.requests["long"].seqs[0]
    chunks = []
    while not long.prompt_done:
        before, tokens = long.num_computed_tokens, stream.num_output_tokens
        engine.step()
        chunks.append(long.num_computed_tokens - before)
        assert stream.num_output_tokens == tokens + 1  # the stream never waits a step
    assert max(chunks) <= 128 and sum(chunks) == len(long_prompt)
    run(engine)
    assert_all_pages_free(engine)


def test_prompt_logprobs_survive_chunked_prefill_and_preemption(prompts, alone):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    # 20 pages and 64-token chunks: prompts are preempted half-prefilled and computed again
    llm = LLM(dtype="float32", quantization="gguf", kv_cache_memory=20 * 16 * 46080, max_num_batched_tokens=64)
    together = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions >= 1
    for a, b in zip(alone, together, strict=True):
        assert len(b.prompt_logprobs) == len(b.prompt_token_ids) and b.prompt_logprobs[0] is None
        for token, x, y in zip(a.prompt_token_ids[1:], a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert abs(x[token].logprob - y[token].logprob) < NEAR_TIE


# -- scheduling policies and prefill progress on a tiny checkpoint -------------------------

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, one_thread):
    path = tmp_path_factory.mktemp("tiny") / "llama"
    tiny.build("llama", path)
    return str(path)


@pytest.fixture(scope="module")
def tiny_fcfs(tiny_model):
    return EngineCore(EngineConfig(model=tiny_model, dtype="float32", max_num_batched_tokens=32))


def tokens_of(engine: EngineCore) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(t for c in out.outputs for t in c.token_ids)
    return tokens


def test_an_urgent_request_preempts_the_lowest_priority_and_changes_no_result(tiny_model, tiny_fcfs):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = {"low": list(range(10, 40)), "lowest": list(range(50, 80)), "urgent": list(range(100, 130))}
    alone = {}
    for rid, prompt in prompts.items():
        tiny_fcfs.add_request(rid, prompt, params)
        alone |= tokens_of(tiny_fcfs)
    engine = EngineCore(EngineConfig(model=tiny_model, dtype="float32", scheduling_policy="priority", max_num_seqs=2))
    engine.add_request("low", prompts["low"], dataclasses.replace(params, priority=1))
    engine.add_request("lowest", prompts["lowest"], dataclasses.replace(params, priority=2))
    together: dict[str, list[int]] = {}

    def step() -> dict[str, list[int]]:
        news = {out.request_id: [t for c in out.outputs for t in c.token_ids] for out in engine.step()}
        for rid, ids in news.items():
            together.setdefault(rid, []).extend(ids)
        return news

    while len(together.get("lowest", [])) < 4:
        step()
    lowest, low = engine.requests["lowest"].seqs[0], engine.requests["low"].seqs[0]
    engine.add_request("urgent", prompts["urgent"], params)  # priority 0: the most urgent
    assert len(step()["urgent"]) == 1  # its first token comes in the very next step
    assert (lowest.num_preemptions, low.num_preemptions) == (1, 0)
    while engine.has_unfinished():
        step()
    assert together == alone
    assert_all_pages_free(engine)


def test_a_priority_is_refused_where_the_policy_would_ignore_it(tiny_fcfs):
    with pytest.raises(InvalidRequest, match="scheduling policy priority or fair") as refused:
        tiny_fcfs.add_request("r", [5, 6, 7], SamplingParams(priority=-1))
    assert refused.value.param == "priority"


def test_prefill_progress_is_reported_after_every_chunk_of_the_prompt(tiny_fcfs):
    engine = tiny_fcfs
    prompt = list(range(200, 300))
    progress = []
    for rid in ("first", "again"):  # the second finds 96 tokens (6 pages) in the prefix cache
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=2))
        while engine.has_unfinished():
            for out in engine.step():
                if out.prompt_progress is not None:
                    p = out.prompt_progress
                    assert not any(c.token_ids for c in out.outputs) or p.processed == p.total
                    progress.append((rid, p.processed, p.total, p.cached))
    assert progress == [("first", 32, 100, 0), ("first", 64, 100, 0), ("first", 96, 100, 0),
                        ("first", 100, 100, 0), ("again", 100, 100, 96)]


# -- sliding-window attention on a tiny Mistral --------------------------------------------

@pytest.fixture(scope="module")
def mistral(tmp_path_factory, one_thread):
    """transformers' Mistral (the reference) and zhuzi on it: window 12, pages of 4, so pages fall out of the
    window every few tokens; prompts chunked by 16."""
    path = tmp_path_factory.mktemp("mistral") / "mistral"
    hf = tiny.build("mistral", path, sliding_window=12)
    return hf, LLM(str(path), dtype="float32", page_size=4, max_num_batched_tokens=16)


def transformers_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_a_sliding_window_model_holds_only_its_window_and_changes_no_result(mistral):
    """Between steps a sequence at position p holds the pages from p - 11 on: at most 4 pages of 4, however
    long it grows (the KV plan's figure), prefilling in chunks beside other sequences or decoding."""
    hf, engine = mistral[0], mistral[1].engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = {"long": list(range(3, 90, 2)), "short": [5, 17, 300, 42, 9], "mid": list(range(200, 230))}
    bound = engine.kv_plan.sequence_tokens(10 ** 6) // 4
    assert bound == 4
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(t for c in out.outputs for t in c.token_ids)
        assert all(sum(b != FREED for b in s.page_table) <= bound for s in engine.scheduler.running)
    assert tokens == {rid: transformers_greedy(hf, prompt, 40) for rid, prompt in prompts.items()}
    assert_all_pages_free(engine)


def test_a_sliding_window_chat_computes_only_its_new_tokens_on_turn_two(mistral):
    """llama-server recomputes a sliding-window model's whole prompt each turn; here turn 2 finds every whole
    page of turn 1's prompt and reply (its window's pages are still in the pool), and its tokens equal
    transformers' from scratch."""
    hf, llm = mistral
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    first = list(range(301, 345))
    reply = llm.generate([first], params)[0].outputs[0].token_ids
    second = first + reply + [7, 8, 9, 10, 11]
    out = llm.generate([second], params)[0]
    # turn 1 computed the K/V of its prompt and of its reply but the last token
    assert out.num_cached_tokens == (len(first) + len(reply) - 1) // 4 * 4 > len(first)
    assert out.outputs[0].token_ids == transformers_greedy(hf, second, 20)
    assert_all_pages_free(llm.engine)


# -- Gemma 3 --------------------------------------------------------------------------------

def test_gemma3_greedy_is_transformers_with_batching_chunked_prefill_and_prefix_cache(tmp_path_factory):
    """Gemma 3 (local and global layers, sandwich norms) through the whole engine: five prompts batched,
    prefills cut into 32-token chunks, four of them sharing a 40-token prefix the cache holds from a first
    run; every greedy token is transformers'."""

    path = tmp_path_factory.mktemp("gemma3")
    hf = tiny.build("gemma3", path)
    shared = list(range(10, 50))
    prompts = [shared + [600 + i] * (i + 1) for i in range(4)] + [list(range(100, 137))]
    llm = LLM(str(path), dtype="float32", page_size=16, max_num_batched_tokens=32, enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm.generate([shared + [7]], params)
    outs = llm.generate(prompts, params)
    assert [out.num_cached_tokens for out in outs] == [32, 32, 32, 32, 0]  # two whole pages of the prefix
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert out.outputs[0].token_ids == expected[0, len(ids):].tolist()


# -- hybrid models: linear-attention layers with a state per sequence -------------------------

@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5")
    return tiny.build("qwen3_5", path), path


def assert_all_state_slots_free(engine: EngineCore):
    states = engine.pages.states
    assert states.num_free == states.num_slots and not states.holders


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    """Granite 4's shape (three Mamba2 layers, one attention layer without RoPE, experts and the shared MLP), its
    states small enough (a state size of 2) that half of a pool of 9 states holds 4 of them."""
    path = tmp_path_factory.mktemp("granite")
    return tiny.build("granitemoehybrid", path, mamba_d_state=2), path


@pytest.mark.parametrize("model,pages", [("qwen3_5", 10), ("granite", 9)])
def test_a_hybrid_model_under_preemption_gives_transformers_tokens_and_returns_every_slot(model, pages, request):
    """Qwen3.5's shape (three DeltaNet layers, one attention layer) and Granite 4's (three Mamba2 layers, one
    attention layer) in a pool of 4 state slots (two running sequences) and 10 or 9 pages: five prompts in
    32-token chunks preempt each other, resume from their cached states or from scratch, and every greedy token
    is transformers'; every page and slot comes back."""
    hf, path = request.getfixturevalue(model)
    budget = 9 * load_model_config(path).state_bytes  # half of it holds 4 states, the rest the pages
    llm = LLM(str(path), dtype="float32", page_size=16, max_num_batched_tokens=32, kv_cache_memory=budget)
    plan, engine = llm.engine.kv_plan, llm.engine
    assert (plan.num_pages, plan.state_slots) == (pages, 4)
    prompts = [list(range(3, 90, 2)), [5, 17, 300, 42, 9], list(range(200, 240)), list(range(3, 90, 2)) + [7],
               [999] * 3 + [4, 400, 40]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert engine.scheduler.num_preemptions >= 1
    for ids, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == transformers_greedy(hf, ids, 40)
    assert_all_pages_free(engine)
    assert_all_state_slots_free(engine)


@pytest.mark.parametrize("model", ["qwen3_5", "granite"])
def test_a_hybrid_chat_computes_only_its_new_tokens_on_turn_two(model, request):
    """Turn 1's state at the last page boundary of its prompt and reply is kept beside its pages: turn 2
    resumes there, computing only its new tokens, and its tokens equal transformers' from scratch."""
    hf, path = request.getfixturevalue(model)
    llm = LLM(str(path), dtype="float32", page_size=16)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    first = list(range(301, 345))
    reply = llm.generate([first], params)[0].outputs[0].token_ids
    second = first + reply + [7, 8, 9, 10, 11]
    out = llm.generate([second], params)[0]
    assert out.num_cached_tokens == (len(first) + len(reply) - 1) // 16 * 16 > len(first)
    assert out.outputs[0].token_ids == transformers_greedy(hf, second, 20)
    assert_all_pages_free(llm.engine)
    assert_all_state_slots_free(llm.engine)


def test_a_hybrid_chat_resumes_turn_two_from_the_host_tier_after_the_pool_forgot_turn_one(qwen3_5):
    """Other prompts fill a pool of 10 pages and 4 state slots between the turns: turn 1's pages and its state
    went to the host tier, and come back from there."""
    hf, path = qwen3_5
    budget = 9 * load_model_config(path).state_bytes
    llm = LLM(str(path), dtype="float32", page_size=16, kv_cache_memory=budget, kv_offload_memory="8MiB")
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    first = list(range(301, 345))
    reply = llm.generate([first], params)[0].outputs[0].token_ids
    llm.generate([list(range(400 + 50 * i, 444 + 50 * i)) for i in range(4)], params)
    connector = llm.engine.kv.connector
    second = first + reply + [7, 8, 9, 10, 11]
    out = llm.generate([second], params)[0]
    assert out.num_cached_tokens == (len(first) + len(reply) - 1) // 16 * 16
    assert connector.state_host.counts.hit_tokens == 16  # turn 1's last state came from the host tier
    assert out.outputs[0].token_ids == transformers_greedy(hf, second, 20)
    assert_all_pages_free(llm.engine)
    assert_all_state_slots_free(llm.engine)


@pytest.fixture(scope="module", params=["lfm2", "lfm2_moe"])
def lfm2(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return tiny.build(request.param, path), path


def test_lfm2_under_preemption_and_prefix_caching_gives_transformers_tokens(lfm2):
    """LFM2's shape (two short-convolution layers, two attention layers), two sequences at a time in a pool of
    10 pages: five prompts in 32-token chunks preempt each other and every greedy token is transformers'; then
    a second turn resumes from turn 1's convolution state at its last page boundary, computing only its new
    tokens. Every page and slot comes back."""
    hf, path = lfm2
    config = load_model_config(path)
    page = 2 * config.kv_layers * config.num_kv_heads * config.head_dim * 4 * 16  # float32 K and V, 16 tokens
    llm = LLM(str(path), dtype="float32", page_size=16, max_num_batched_tokens=32, max_num_seqs=2,
              kv_cache_memory=6 * config.state_bytes + 10 * page)
    plan, engine = llm.engine.kv_plan, llm.engine
    assert (plan.num_pages, plan.state_slots) == (10, 6)
    prompts = [list(range(3, 90, 2)), [5, 17, 300, 42, 9], list(range(200, 240)), list(range(3, 90, 2)) + [7],
               [999] * 3 + [4, 400, 40]]
    params = SamplingParams(temperature=0, max_tokens=40, min_tokens=40)  # EOS held back, as transformers_greedy
    outs = llm.generate(prompts, params)
    assert engine.scheduler.num_preemptions >= 1
    for ids, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == transformers_greedy(hf, ids, 40)
    first = list(range(301, 345))
    reply = llm.generate([first], params)[0].outputs[0].token_ids
    second = first + reply + [7, 8, 9, 10, 11]
    out = llm.generate([second], params)[0]
    assert out.num_cached_tokens == (len(first) + len(reply) - 1) // 16 * 16 > len(first)
    assert out.outputs[0].token_ids == transformers_greedy(hf, second, 40)
    assert_all_pages_free(engine)
    assert_all_state_slots_free(engine)


# -- Gemma 4 --------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [{}, tiny.GEMMA4_PLAIN, tiny.GEMMA4_MOE], ids=["e2b", "plain", "moe"])
def test_gemma4_greedy_is_transformers_with_batching_chunked_prefill_preemption_prefix_cache_and_tiers(shape,
                                                                                                       tmp_path):
    """Gemma 4 (KV pools of two head sizes; on the E2B shape, layers attending earlier layers' K/V and
    per-layer embeddings; on 26B-A4B's, experts beside each MLP) through the whole engine over a pool of 8
    pages: five prompts batched, prefills cut into 32-token chunks, four sharing a 40-token prefix the cache
    holds from a first run, requests preempted for want of pages; then again, their pages back from the
    host-memory tier (every group's slots of a page). Every greedy token is transformers'."""
    hf = tiny.build("gemma4", tmp_path, **shape)
    per_token = KVShape.of_model(load_model_config(tmp_path)).bytes_per_token(torch.float32)
    shared = list(range(10, 50))
    prompts = [shared + [600 + i] * (i + 1) for i in range(4)] + [list(range(100, 137))]
    llm = LLM(str(tmp_path), dtype="float32", page_size=16, max_num_batched_tokens=32, enable_prefix_caching=True,
              kv_cache_memory=8 * 16 * per_token, kv_offload_memory="4MiB")
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=16)  # as transformers' min_new_tokens
    llm.generate([shared + [7]], params)
    outs = llm.generate(prompts, params)
    assert outs[0].num_cached_tokens == 32 and llm.engine.scheduler.num_preemptions > 0
    again = llm.generate(prompts, params)
    assert llm.engine.kv.connector.stats()["host"].hit_tokens > 0
    for ids, out, out_again in zip(prompts, outs, again):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert out.outputs[0].token_ids == out_again.outputs[0].token_ids == expected[0, len(ids):].tolist()
    assert llm.engine.pages.num_free_pages == llm.engine.pages.num_pages
