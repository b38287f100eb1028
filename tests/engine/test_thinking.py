"""thinking_token_budget on a tiny random Qwen3 that thinks (<think> and </think> are its added tokens): the
engine writes </think> once the thought holds the budget's tokens, and only then."""
from __future__ import annotations

from pathlib import Path

import pytest
import tiny

from zhuzi import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> tuple[LLM, int, int]:
    directory: Path = tmp_path_factory.mktemp("thinker")
    open_id, close_id = tiny.build_thinking(directory)
    return LLM(str(directory), dtype="float32", kv_cache_memory="16MiB"), open_id, close_id


def run(llm: LLM, prompt: list[int], **params) -> list[int]:
    sampling = SamplingParams(**{"temperature": 0, "max_tokens": 12, "ignore_eos": True, **params})
    return llm.generate([prompt], sampling)[0].outputs[0].token_ids


def test_the_thought_ends_with_the_closing_tag_after_the_budget_and_the_answer_follows(thinker) -> None:
    llm, open_id, close_id = thinker
    prompt = [1, 2000, 3000, open_id]  # the prompt opened the thought
    free = run(llm, prompt)
    assert close_id not in free  # a random model never closes its thought on its own
    budgeted = run(llm, prompt, thinking_token_budget=5)
    assert budgeted[:5] == free[:5] and budgeted[5] == close_id
    assert close_id not in budgeted[6:] and len(budgeted) == 12  # the answer goes on after it
    assert run(llm, prompt, thinking_token_budget=0)[0] == close_id


def test_the_budget_counts_only_tokens_inside_a_thought(thinker) -> None:
    llm, open_id, close_id = thinker
    closed = [1, open_id, 2000, close_id, 3000]  # a finished thought in the prompt: no thought is open
    assert run(llm, closed, thinking_token_budget=2) == run(llm, closed)
    # A thought the model opens itself counts from its <think> (here a bias makes it write one at every step).
    assert run(llm, [1, 2000], logit_bias={open_id: 100}, thinking_token_budget=0, max_tokens=4) == \
        [open_id, close_id] * 2


def test_the_written_tag_has_logprob_zero(thinker) -> None:
    llm, open_id, close_id = thinker
    sampling = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, thinking_token_budget=2, logprobs=3)
    out = llm.generate([[1, 2000, open_id]], sampling)[0].outputs[0]
    assert out.token_ids[2] == close_id
    assert {t: lp.logprob for t, lp in out.logprobs[2].items()} == {close_id: 0.0}
    assert len(out.logprobs[1]) >= 3  # the sampled tokens keep their distribution's logprobs


def test_with_prompt_lookup_the_budget_ends_the_thought_where_it_ends_without(thinker) -> None:
    """Speculation emits runs of accepted drafts; a </think> written inside one drops the rest of the run, and
    the answer after it is the answer without speculation, whichever token of a run the budget falls on."""
    llm, open_id, close_id = thinker
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
            "max_step_tokens": 512}
    fast = LLM(str(llm.engine.model_path), dtype="float32", kv_cache_memory="16MiB",
               speculative_config=spec)
    # The thought goes on repeating one token (this random model's habit), so that lookup's drafts of it are
    # accepted in runs: each budget below falls inside one.
    prompt = [1, 2000, 3000, open_id, 25538, 35088, 34975, 34975, 34975]
    budgets = list(range(1, 11))
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, thinking_token_budget=b) for b in budgets]
    plain = [out.outputs[0].token_ids for out in llm.generate([prompt] * len(budgets), params)]
    assert [ids[b] for ids, b in zip(plain, budgets)] == [close_id] * len(budgets)
    assert [out.outputs[0].token_ids for out in fast.generate([prompt] * len(budgets), params)] == plain
    assert fast.engine.spec_stats.num_accepted_tokens > 0
