"""Speculative decoding through the real engine: prompt lookup proposes what the definition says; greedy
output with speculation is the output without it (fp32, several K, alone and batched); a stop string, stop
token or max_tokens inside an accepted run ends the output exactly where it ends without speculation;
logprobs come for every token; sampled outputs keep the target's distribution (chi-square on a tiny model,
with a draft model and with prompt lookup); grammars hold; and every KV page comes back however a
speculating request ends."""
from __future__ import annotations

import itertools
import json
import re
import shutil

import numpy as np
import pytest
import tiny
import torch
from chi_square import chi_square_p
from safetensors.torch import load_file, save_file

from zhuzi import LLM, SamplingParams, StructuredOutputsParams
from zhuzi.config import EngineConfig
from zhuzi.engine.core.engine_core import EngineCore
from zhuzi.engine.core.spec_decode import lookup
from zhuzi.llm import merge
from zhuzi.outputs import SpecDecodingStats
from zhuzi.sample.sampler import SamplingRow, sampling_probs

pytestmark = pytest.mark.long  # a minute or more: handed out first (tests/conftest.py)

NEAR_TIE = 1e-4


def ngram(k: int, **extra) -> dict:
    # A large step budget, so that batched steps speculate too (the default 8 suits the CPU kernels).
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
            "max_step_tokens": 512, **extra}


# ------------------------------------------------------------------ prompt lookup

def reference_lookup(tokens: list[int], k: int, low: int, high: int) -> list[int]:
    """The definition, spelled out: n from high down to low, the latest earlier start, copy k tokens one by one
    (the source may be what was just copied)."""
    for n in range(high, low - 1, -1):
        if len(tokens) <= n:
            continue
        starts = [s for s in range(len(tokens) - n) if tokens[s:s + n] == tokens[-n:]]
        if starts:
            copied = list(tokens)
            for i in range(k):
                copied.append(copied[starts[-1] + n + i])
            return copied[len(tokens):]
    return []


def test_lookup_follows_the_latest_longest_match():
    # vLLM's example: [4, 2, 3] has no earlier match, [2, 3] does; the copy runs on through what it copied
    assert lookup([1, 2, 3, 4, 2, 3], 4, 2, 3) == [4, 2, 3, 4]
    tokens = [7, 1, 2, 3, 50, 51, 9, 2, 3, 60, 1, 2, 3]
    assert lookup(tokens, 2, 2, 3) == [50, 51]  # [1, 2, 3] beats the later, shorter [2, 3]
    assert lookup(tokens, 2, 2, 2) == [60, 1]
    assert lookup([5, 6, 10, 11, 5, 6, 20, 21, 5, 6], 2, 2, 2) == [20, 21]  # the latest occurrence
    assert lookup([1, 2, 3, 4, 5, 6, 4], 3, 2, 4) == [] and lookup([1, 2, 3, 4, 5, 6, 4], 3, 1, 4) == [5, 6, 4]
    assert lookup([7, 1, 2, 3, 1, 2, 3, 1, 2, 3], 5, 2, 3) == [1, 2, 3, 1, 2]  # a loop proposes itself
    assert lookup([], 3, 2, 4) == [] and lookup([9, 9], 3, 2, 4) == []


def test_lookup_matches_the_definition_on_random_sequences():
    rng = np.random.default_rng(0)
    for _ in range(1500):
        tokens = rng.integers(0, int(rng.integers(2, 8)), size=int(rng.integers(0, 40))).tolist()
        k, low = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        high = low + int(rng.integers(0, 4))
        assert lookup(tokens, k, low, high) == reference_lookup(tokens, k, low, high), (tokens, k, low, high)
    long = rng.integers(0, 49152, size=8192)
    long[-300:] = long[1000:1300]  # an 8k context whose tail copies a stretch of it
    assert lookup(long, 5, 2, 4) == long[1300:1305].tolist()


# ------------------------------------------------------------------ SmolLM2, fp32: greedy identity

TEXT = ("The river ran through the old city, past the market and the stone bridge, and every morning "
        "the fishermen pulled their boats onto the sand before the sun rose over the hills.")
CODE = "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n"
ASKS = [f"Repeat this sentence word for word: {TEXT}",
        f"Fix the typos: {TEXT.replace('river', 'rievr').replace('morning', 'mornign')}",
        f"Add a comment to each line of this function:\n```python\n{CODE}```",
        f"Quote the first half of this text exactly.\n\n{TEXT}"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, logprobs=2)


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer) -> list[list[int]]:
    tokenizer = smollm2_tokenizer
    chats = [tokenizer.encode_chat([{"role": "user", "content": a}]) for a in ASKS]
    loop = tokenizer.encode("one two three four five six seven one two three four five six seven one two")
    return chats + [loop]


@pytest.fixture(scope="module")
def base() -> LLM:
    """fp32 without speculation (nor a prefix cache): the reference, shared by the tests."""
    return LLM(dtype="float32", quantization="gguf", enable_prefix_caching=False)


@pytest.fixture(scope="module")
def speculating():
    """speculating(k): one fp32 LLM with prompt lookup of k tokens, shared by the tests that use that k (a model
    load each saved); they read its counts as what changed over their own requests (counts_since)."""
    llms: dict[int, LLM] = {}

    def get(k: int) -> LLM:
        if k not in llms:
            llms[k] = LLM(dtype="float32", quantization="gguf", speculative_config=ngram(k))
        return llms[k]
    return get


def counts_since(llm: LLM, before: SpecDecodingStats) -> SpecDecodingStats:
    """What llm's speculation counted since `before` (an earlier llm.engine.stats().spec_decoding)."""
    now = llm.engine.stats().spec_decoding
    per_pos = [a - b for a, b in itertools.zip_longest(now.num_accepted_tokens_per_pos,
                                                       before.num_accepted_tokens_per_pos, fillvalue=0)]
    return SpecDecodingStats(now.num_drafts - before.num_drafts, now.num_draft_tokens - before.num_draft_tokens,
                             now.num_accepted_tokens - before.num_accepted_tokens, per_pos)


@pytest.fixture(scope="module")
def plain(prompts, base):
    return [base.generate([p], GREEDY)[0] for p in prompts]


def assert_same_greedy(plain_outs, spec_outs):
    """Token for token; a difference only where the plain run's two best tokens were within NEAR_TIE (fp32
    matmuls of 1 and of k + 1 rows may round differently), and the chosen tokens' logprobs agree."""
    for a, b in zip(plain_outs, spec_outs):
        ta, tb = a.outputs[0], b.outputs[0]
        assert len(tb.logprobs) == len(tb.token_ids)  # a logprob entry for every emitted token
        for i, (x, y) in enumerate(zip(ta.token_ids, tb.token_ids)):
            if x != y:
                ranked = sorted(ta.logprobs[i].values(), key=lambda lp: lp.rank)
                assert ranked[0].logprob - ranked[1].logprob < NEAR_TIE, f"token {i} differs and is no near-tie"
                break
            assert abs(ta.logprobs[i][x].logprob - tb.logprobs[i][y].logprob) < NEAR_TIE
            assert set(ta.logprobs[i]) == set(tb.logprobs[i])
        else:
            assert (ta.token_ids, ta.text, ta.finish_reason) == (tb.token_ids, tb.text, tb.finish_reason)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_output_is_the_same_with_speculation_alone_and_batched(prompts, plain, speculating, k):
    llm = speculating(k)
    before = llm.engine.stats().spec_decoding
    alone = [llm.generate([p], GREEDY)[0] for p in prompts]
    assert_same_greedy(plain, alone)
    batched = llm.generate(prompts, GREEDY)
    assert_same_greedy(plain, batched)
    if k == 3:  # prompts in 32-token chunks beside speculating decodes
        chunked = LLM(dtype="float32", quantization="gguf", max_num_batched_tokens=32, speculative_config=ngram(k))
        assert_same_greedy(plain, chunked.generate(prompts, GREEDY))
        assert chunked.engine.stats().spec_decoding.num_accepted_tokens > 0
    stats = counts_since(llm, before)
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
    assert len(stats.num_accepted_tokens_per_pos) == k
    assert llm.engine.pages.num_free_pages == llm.engine.pages.num_pages


def test_outputs_and_step_records_say_which_tokens_were_drafts(prompts, speculating):
    llm = speculating(3)
    before, last_step = llm.engine.stats().spec_decoding, max((s.index for s in llm.engine.recent_steps), default=-1)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    stats, marks = counts_since(llm, before), [o.outputs[0] for o in outs]
    for c in marks:
        assert len(c.draft_accepted) == len(c.drafts_rejected) == len(c.token_ids) == 24
        for i, rejected in enumerate(c.drafts_rejected):
            assert rejected is None or not c.draft_accepted[i]  # the model's own token closes a checked run
            assert not rejected or c.token_ids[i] != rejected[0]  # it replaced the first draft rejected
    assert sum(sum(c.draft_accepted) for c in marks) == stats.num_accepted_tokens > 0
    assert sum(r is not None for c in marks for r in c.drafts_rejected) == stats.num_drafts
    assert sum(len(r or []) for c in marks for r in c.drafts_rejected) == \
        stats.num_draft_tokens - stats.num_accepted_tokens > 0
    steps = [step for step in llm.engine.recent_steps if step.index > last_step]  # this test's steps
    assert steps[0].index == last_step + 1  # all of them
    rows = [row for step in steps for row in step.rows]
    verify = [r for r in rows if r.kind == "verify"]
    assert len(verify) == stats.num_drafts and sum(r.accepted for r in verify) == stats.num_accepted_tokens
    assert all(r.tokens == r.drafts + 1 for r in verify)
    assert sum(r.tokens for r in rows if r.kind == "prefill") == \
        sum(len(p) for p in prompts) - sum(o.num_cached_tokens for o in outs)


def run_steps(engine: EngineCore, prompt: list[int], params: SamplingParams) -> tuple[list[list[int]], object]:
    """The token ids each step emitted for one request, and its merged output."""
    engine.add_request("r", prompt, params)
    steps, total = [], None
    while engine.has_unfinished():
        for out in engine.step():
            steps.append(out.outputs[0].token_ids)
            total = merge(total, out)
    return steps, total


def test_stops_and_max_tokens_inside_an_accepted_run_end_the_output_there(prompts, speculating, base):
    spec, base = speculating(5).engine, base.engine
    prompt = prompts[0]  # "repeat this sentence": long accepted runs
    params = dict(temperature=0, max_tokens=40, ignore_eos=True)
    steps, full = run_steps(spec, prompt, SamplingParams(**params))
    before, run = next((sum(map(len, steps[:i])), s) for i, s in enumerate(steps) if len(s) >= 4)
    tokens = full.outputs[0].token_ids
    stop_token = next(t for t in run[1:3] if t not in tokens[:before])  # first seen inside the run
    text_before = spec.tokenizer.decode(tokens[:before + 1])
    stop_string = spec.tokenizer.decode(tokens[:before + 3])[len(text_before) - 2:]  # spans into the run
    cases = [dict(stop_token_ids=[stop_token]), dict(stop=[stop_string]), dict(max_tokens=before + 2),
             dict(stop=[stop_string], include_stop_str_in_output=True)]
    for case in cases:
        with_spec = run_steps(spec, prompt, SamplingParams(**{**params, **case}))[1].outputs[0]
        without = run_steps(base, prompt, SamplingParams(**{**params, **case}))[1].outputs[0]
        assert (with_spec.token_ids, with_spec.text) == (without.token_ids, without.text), case
        assert (with_spec.finish_reason, with_spec.stop_reason) == (without.finish_reason, without.stop_reason)
        assert len(with_spec.token_ids) < before + len(run)  # the run was cut short
    for engine in (spec, base):
        assert engine.pages.num_free_pages == engine.pages.num_pages


def test_streamed_deltas_carry_several_tokens_and_add_up_to_the_output(prompts, speculating):
    spec = speculating(5).engine
    steps, full = run_steps(spec, prompts[0], SamplingParams(temperature=0, max_tokens=40, stop=["hills"]))
    assert max(map(len, steps)) >= 3
    assert sum(steps, []) == full.outputs[0].token_ids


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def test_structured_output_with_speculation_is_the_output_without_it(speculating, base):
    ask = [{"role": "user", "content": "Give three people as JSON, each with a name and an age."}]
    schema = {"type": "array", "items": PERSON, "minItems": 3, "maxItems": 3}
    params = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=schema)),
              SamplingParams(temperature=0.8, seed=5, max_tokens=60,
                             structured_outputs=StructuredOutputsParams(json=schema))]
    expected = base.chat(ask, params[0])[0].outputs[0]
    spec = speculating(5)
    before = spec.engine.stats().spec_decoding
    greedy = spec.chat(ask, params[0])[0].outputs[0]
    assert greedy.token_ids == expected.token_ids and len(json.loads(greedy.text)) == 3
    assert counts_since(spec, before).num_accepted_tokens > 0  # the keys repeat: drafts were accepted
    sampled = spec.chat(ask, params[1])[0].outputs[0]
    assert len(json.loads(sampled.text)) == 3 and spec.chat(ask, params[1])[0].outputs[0].text == sampled.text


# ------------------------------------------------------------------ tiny models: draft model, distributions

@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """A tiny target, and drafts sharing its tokenizer: itself, and a noisy copy."""
    root = tmp_path_factory.mktemp("spec")
    hf = tiny.build("llama", root / "target")
    noisy = root / "noisy"
    shutil.copytree(root / "target", noisy)
    weights = load_file(noisy / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    save_file({name: w + 0.05 * torch.randn(w.shape, generator=gen) for name, w in weights.items()},
              noisy / "model.safetensors", metadata={"format": "pt"})
    return hf, root


def draft(root, name: str, k: int) -> dict:
    return {"method": "draft_model", "model": str(root / name), "num_speculative_tokens": k, "max_step_tokens": 4096}


TINY_PROMPTS = [[5, 6, 7, 8, 9, 10] * 3, [100, 200, 300], list(range(20, 60)), [7] * 5]


def test_a_draft_model_changes_no_greedy_token(tiny_models):
    _, root = tiny_models
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(str(root / "target"), dtype="float32").generate(TINY_PROMPTS,
                                                                                                      params)]
    rates = {}
    for name in ("target", "noisy"):
        llm = LLM(str(root / "target"), dtype="float32", speculative_config=draft(root, name, 3))
        assert [o.outputs[0].token_ids for o in llm.generate(TINY_PROMPTS, params)] == expected
        assert [llm.generate([p], params)[0].outputs[0].token_ids for p in TINY_PROMPTS] == expected
        stats = llm.engine.stats().spec_decoding
        rates[name] = stats.num_accepted_tokens / stats.num_draft_tokens
        assert not llm.engine.proposer.shadows
        assert llm.engine.proposer.pages.num_free_pages == llm.engine.proposer.pages.num_pages
    assert rates["target"] == 1.0 and 0 < rates["noisy"] < 1.0


def test_a_draft_model_with_another_tokenizer_is_refused(tiny_models, tmp_path):
    _, root = tiny_models
    other = tmp_path / "other"
    tiny.build("llama", other, vocab_size=1200)
    with pytest.raises(ValueError, match="does not share the target's tokenizer"):
        LLM(str(root / "target"), dtype="float32", speculative_config=draft(other.parent, "other", 2))


# A random tiny model's logits are flat and change with every token, so no proposer would ever guess right:
# the bias keeps the output in {10, 11, 12} (top_k drops the rest), which the prompt holds in every order.
SAMPLED = dict(temperature=1.0, top_k=3, repetition_penalty=1.3, presence_penalty=0.4,
               logit_bias={10: 8.0, 11: 8.0, 12: 8.0}, max_tokens=4, ignore_eos=True)
CHI_PROMPT = [5, 6, 7, 10, 11, 12, 10, 12, 11, 5, 6, 7]


def exact_distribution(hf) -> dict[tuple[int, ...], float]:
    """P(each output) from the transformers model's logits and zhuzi's own processing of them."""
    params = SamplingParams(**SAMPLED)

    def probs(output: tuple[int, ...]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(torch.tensor([CHI_PROMPT + list(output)])).logits[0, -1:].float()
        return sampling_probs(logits, [SamplingRow(params, list(output), CHI_PROMPT, None, [2])])[0]

    out: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(SAMPLED["max_tokens"]):
        out = {seq + (t,): p * float(q[t]) for seq, p in out.items() for q in [probs(seq)]
               for t in q.nonzero().flatten().tolist()}
    return out


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_sampled_outputs_keep_the_target_distribution(tiny_models, method):
    hf, root = tiny_models
    config = draft(root, "noisy", 3) if method == "draft_model" else ngram(3, prompt_lookup_min=1)
    llm = LLM(str(root / "target"), dtype="float32", max_num_seqs=128, max_num_batched_tokens=1024,
              speculative_config={**config, "max_step_tokens": 1024})
    # Seeded (request j's sample i draws from seed 1000 j + i): the verdict is the same on every run.
    outs = llm.generate([CHI_PROMPT] * 24, [SamplingParams(n=128, seed=1000 * j, **SAMPLED) for j in range(24)])
    samples = [tuple(c.token_ids) for o in outs for c in o.outputs]
    stats = llm.engine.stats().spec_decoding
    assert stats.num_accepted_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens
    assert chi_square_p(samples, exact_distribution(hf)) > 1e-3


def test_a_regex_holds_with_a_draft_model(tiny_models):
    _, root = tiny_models
    regex = r"[0-9]{3}-[0-9]{4}"
    llm = LLM(str(root / "target"), dtype="float32", speculative_config=draft(root, "target", 4))
    greedy = SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=regex))
    sampled = SamplingParams(temperature=1.0, seed=11, n=4, max_tokens=20,
                             structured_outputs=StructuredOutputsParams(regex=regex))
    base = LLM(str(root / "target"), dtype="float32").generate(TINY_PROMPTS, greedy)
    outs = llm.generate(TINY_PROMPTS, greedy)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
    texts = [c.text for o in llm.generate(TINY_PROMPTS, sampled) for c in o.outputs]
    assert all(re.fullmatch(regex, t) for t in texts) and len(set(texts)) > 1
    assert llm.engine.stats().spec_decoding.num_accepted_tokens > 0


# ------------------------------------------------------------------ every page comes back

@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_every_page_returns_however_a_speculating_request_ends(tiny_models, method):
    """Finished, stopped by a stop token or string inside a run, cut by max_tokens, aborted mid-stream,
    preempted and resumed, n > 1: afterwards both pools are whole, and preemption changed no greedy token."""
    _, root = tiny_models
    config = ngram(4) if method == "ngram" else draft(root, "noisy", 4)
    greedy = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    loop = TINY_PROMPTS[0]
    expected = LLM(str(root / "target"), dtype="float32").generate([loop], greedy)[0].outputs[0].token_ids
    # 12 pages of 16 tokens (fp32 tiny model: 512 bytes a token): the requests cannot all fit, so some are preempted
    engine = EngineCore(EngineConfig(str(root / "target"), dtype="float32", kv_cache_memory=12 * 16 * 512,
                                 speculative_config=config))
    requests = {
        "finish": (loop, greedy),
        "stop-token": (loop, SamplingParams(temperature=0, max_tokens=60, stop_token_ids=[expected[9]])),  # in a run
        "stop-string": (loop, SamplingParams(temperature=0, max_tokens=60,
                                             stop=[engine.tokenizer.decode(expected[5:7])])),
        "length": (loop, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)),
        "abort": (loop, greedy),
        "n": (TINY_PROMPTS[2], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=50, ignore_eos=True)),
        "resumed": (loop, greedy),
    }
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    results, steps = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            results[out.request_id] = merge(results.get(out.request_id), out)
        steps += 1
        if steps == 6:
            results["abort"] = merge(results.get("abort"), engine.abort("abort"))
    assert engine.scheduler.num_preemptions >= 1
    assert results["finish"].outputs[0].token_ids == results["resumed"].outputs[0].token_ids == expected
    assert results["stop-token"].outputs[0].token_ids == expected[:expected.index(expected[9]) + 1]
    assert results["length"].outputs[0].token_ids == expected[:7]
    assert results["abort"].outputs[0].finish_reason == "abort"
    assert engine.pages.num_free_pages == engine.pages.num_pages
    if method == "draft_model":
        proposer = engine.proposer
        assert not proposer.shadows and proposer.pages.num_free_pages == proposer.pages.num_pages
    assert engine.stats().spec_decoding.num_accepted_tokens > 0


# ------------------------------------------------------------------ hybrid models: states after each draft

# Per family, how much its embeddings are scaled up: enough that the next token is mostly the cycle's next one (below),
# so that prompt lookup's drafts are often accepted, and not so much that they always are.
EMBEDDING_SCALE = {"qwen3_5": 20.0, "lfm2": 2.0, "granitemoehybrid": 5.0}


def build_repetitive(arch: str, path) -> dict[str, torch.Tensor]:
    """A tiny hybrid (gated DeltaNet, short convolution or Mamba2 layers beside attention) that tends to loop: its
    LM head reads the embeddings (untied: row t of each five is embedding t + 1's, so the loop has period five), and
    the embeddings are scaled up to outweigh what the layers add. Returns its tensors."""
    tiny.build(arch, path, **({"mamba_d_state": 2} if arch == "granitemoehybrid" else {}))
    weights = load_file(path / "model.safetensors")
    embeddings = weights["model.embed_tokens.weight"]
    if "lm_head.weight" in weights:
        weights["lm_head.weight"] = embeddings.view(-1, 5, embeddings.shape[1]).roll(-1, 1).flatten(0, 1).clone()
    weights["model.embed_tokens.weight"] = embeddings * EMBEDDING_SCALE[arch]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return weights


# Pages of 8 tokens, prompts prefilled in chunks; a few MiB of KV, since building a page table of the default's
# hundreds of thousands of pages costs more than these tests' tokens.
SMALL = {"dtype": "float32", "page_size": 8, "max_num_batched_tokens": 16, "kv_cache_memory": "4MiB"}


@pytest.fixture(scope="module", params=list(EMBEDDING_SCALE))
def repetitive_hybrid(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    build_repetitive(request.param, path)
    return path


def test_a_hybrid_model_with_prompt_lookup_gives_the_tokens_it_gives_without(repetitive_hybrid):
    """A verify runs the last token and k drafts through the recurrent layers, which leave their state after each
    draft in a slot of its own; the state after the tokens that stand goes on. Greedy tokens (fp32) equal those of
    a run without speculation, alone and batched, in chunks of a prompt, with drafts both accepted and rejected and
    pages of 8 tokens (verifies cross page boundaries); a second turn resumes from the state a verify left at a
    boundary. Every slot comes back."""
    path = str(repetitive_hybrid)
    prompts = [[5, 17, 300, 42, 9] * 3, list(range(200, 230)), [7, 8, 9, 10, 11, 7, 8, 12, 13] * 2]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    base = LLM(path, **SMALL, enable_prefix_caching=False)
    spec = LLM(path, **SMALL, speculative_config=ngram(3, prompt_lookup_min=1, prompt_lookup_max=3))

    def assert_same(want, got):  # the tokens, and their logprobs but for the rounding of 1 row vs k + 1
        a, b = want.outputs[0], got.outputs[0]
        assert b.token_ids == a.token_ids
        assert all(abs(x[t].logprob - y[t].logprob) < NEAR_TIE for x, y, t in zip(a.logprobs, b.logprobs, a.token_ids))

    expected = base.generate(prompts, params)
    for want, alone, batched in zip(expected, [spec.generate([p], params)[0] for p in prompts],
                                    spec.generate(prompts, params)):
        assert_same(want, alone)
        assert_same(want, batched)
    stats = spec.engine.stats().spec_decoding
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    second = prompts[0] + expected[0].outputs[0].token_ids + [7, 8, 9]
    out = spec.generate([second], params)[0]
    assert out.num_cached_tokens == (len(prompts[0]) + 40 - 1) // 8 * 8
    assert_same(base.generate([second], params)[0], out)
    states = spec.engine.pages.states
    assert states.num_free == states.num_slots and not states.holders


# ------------------------------------------------------------------ Qwen3.5's multi-token-prediction layer

def mtp(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k, "max_step_tokens": 512}


def test_the_mtp_layer_proposes_and_changes_no_greedy_token(tmp_path):
    """A looping Qwen3.5 whose MTP layer mostly passes the next token's embedding on: its guess at the token after
    next is then the loop's, and drafts are accepted (and some rejected); greedy tokens equal those without it,
    alone and batched, in chunks. Every page of the layer's pool comes back."""
    tiny.add_mtp(tmp_path, build_repetitive("qwen3_5", tmp_path), fc_scale=20.0)
    prompts = [[5, 17, 300, 42, 9] * 3, list(range(200, 230)), [7, 8, 9, 10, 11, 7, 8, 12, 13] * 2]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    base = LLM(str(tmp_path), **SMALL, enable_prefix_caching=False)
    spec = LLM(str(tmp_path), **SMALL, speculative_config=mtp(2))
    expected = [o.outputs[0].token_ids for o in base.generate(prompts, params)]
    assert [spec.generate([p], params)[0].outputs[0].token_ids for p in prompts] == expected
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == expected
    stats = spec.engine.stats().spec_decoding  # a guess from the wrong position's token is accepted 1 time in 50
    assert stats.num_draft_tokens / 4 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert all(stats.num_accepted_tokens_per_pos)  # the second guess too, from the layer's own output
    proposer = spec.engine.proposer
    assert not proposer.shadows and proposer.pages.num_free_pages == proposer.pages.num_pages


def test_a_checkpoint_without_the_mtp_layer_is_refused_in_one_line(tmp_path):
    tiny.build("qwen3_5", tmp_path)
    with pytest.raises(ValueError, match=r"no multi-token-prediction layer .*mtp_num_hidden_layers is 0 or absent"):
        LLM(str(tmp_path), **SMALL, speculative_config=mtp(2))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"mtp_num_hidden_layers": 1}))
    with pytest.raises(ValueError, match=r"no multi-token-prediction layer .*tensor mtp\.\S+ is missing"):
        LLM(str(tmp_path), **SMALL, speculative_config=mtp(2))


def test_unknown_or_bad_speculative_settings_are_refused_in_one_line():
    for bad, words in [({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
                       ({"method": "ngram"}, "num_speculative_tokens is required"),
                       (ngram(3, prompt_lookup_min=5), "exceeds prompt_lookup_max"),
                       ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a model"),
                       ('{"method": "ngram", ', "not valid JSON")]:
        with pytest.raises(ValueError, match=words):
            EngineConfig(speculative_config=bad)
