"""--deterministic: in bfloat16, a request's greedy tokens are the same whether it runs alone, in a batch
of 20 (in either order), with its prefill cut into small chunks, or with its prompt found in the prefix
cache (20 ShareGPT first turns, SmolLM2). Without the flag, on this CPU, most of these answers change
(docs/benchmarks.md); the fixed-order kernel itself is checked bit for bit in tests/model/test_cpu_linear.py."""
from __future__ import annotations

import pytest

from zhuzi import LLM, SamplingParams
from zhuzi.bench.datasets import sharegpt_first_turns

PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer) -> list[list[int]]:
    return sharegpt_first_turns(smollm2_tokenizer, 20, seed=13, length=(40, 200))


def tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def cached_llm() -> LLM:
    return LLM(dtype="bfloat16", deterministic=True)


@pytest.fixture(scope="module")
def alone(prompts, cached_llm) -> list[list[int]]:
    """Each prompt on its own (only the chat template's system prompt is in the prefix cache)."""
    return [tokens(cached_llm, [p])[0] for p in prompts]


def test_batched_in_any_order_changes_no_token(prompts, alone):
    llm = LLM(dtype="bfloat16", deterministic=True, enable_prefix_caching=False)
    assert tokens(llm, prompts) == alone
    assert tokens(llm, prompts[::-1])[::-1] == alone


def test_chunked_prefill_in_a_busy_batch_changes_no_token(prompts, alone):
    llm = LLM(dtype="bfloat16", deterministic=True, enable_prefix_caching=False, max_num_batched_tokens=24)
    assert tokens(llm, prompts) == alone


def test_a_prompt_from_the_prefix_cache_changes_no_token(prompts, alone, cached_llm):
    hits = cached_llm.engine.blocks.prefix_hits
    assert [tokens(cached_llm, [p])[0] for p in prompts] == alone  # every prompt's blocks are cached now
    assert cached_llm.engine.blocks.prefix_hits - hits >= sum(len(p) for p in prompts) // 2


def test_a_seeded_sample_is_the_same_alone_and_batched(prompts):
    llm = LLM(dtype="bfloat16", deterministic=True, enable_prefix_caching=False)
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=24, ignore_eos=True)
    alone = llm.generate(prompts[:1], seeded, use_tqdm=False)[0].outputs[0].token_ids
    batched = llm.generate(prompts[:8], [seeded] + [SamplingParams(temperature=0.8, max_tokens=24)] * 7,
                           use_tqdm=False)[0].outputs[0].token_ids
    assert batched == alone
