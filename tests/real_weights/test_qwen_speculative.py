"""The real draft/target pair: Qwen2.5-Coder-0.5B-Instruct drafting for 1.5B-Instruct (the same tokenizer), both
on their GGUF blocks. With --deterministic (every row's arithmetic independent of the rows beside it: the
verification pass computes a decode row's bits) greedy speculation writes exactly the 1.5B's own tokens."""
import pytest

from zhuzi import LLM, SamplingParams

pytestmark = pytest.mark.models

QUESTIONS = ["Write a Python function that checks whether a number is prime.",
             "Explain what a hash map is in two sentences."]


def test_the_small_model_drafting_for_the_large_one_leaves_its_greedy_output(qwen_small, qwen_large):
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    prompts = [[{"role": "user", "content": q}] for q in QUESTIONS]
    plain = LLM(str(qwen_large), kv_cache_memory="128MiB", deterministic=True)
    expected = [out.outputs[0].token_ids for out in plain.chat(prompts, params)]
    del plain
    spec = LLM(str(qwen_large), kv_cache_memory="128MiB", deterministic=True, speculative_config={
        "method": "draft_model", "model": str(qwen_small), "num_speculative_tokens": 3})
    assert [out.outputs[0].token_ids for out in spec.chat(prompts, params)] == expected
    stats = spec.engine.stats().spec_decoding
    assert stats.num_drafts > 0 and stats.num_accepted_tokens / stats.num_draft_tokens > 0.3  # real proposals
