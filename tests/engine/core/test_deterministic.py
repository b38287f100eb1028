"""--deterministic: in bfloat16, a request's greedy tokens are the same whether it runs alone, in a batch
of 12 (in either order), with its prefill cut into small chunks, or with its prompt found in the prefix
cache (12 ShareGPT first turns, SmolLM2); so are the bits of a context's logits alone and batched. The
control: without the flag the same batching changes those bits (docs/benchmarks.md counts the answers that
change); the fixed-order kernel itself is checked bit for bit in tests/model/test_cpu_linear.py."""
from __future__ import annotations

import itertools

import pytest
import torch

from zhuzi import LLM, SamplingParams
from zhuzi.bench.datasets import sharegpt_first_turns
from zhuzi.engine.sequence import Probe

pytestmark = pytest.mark.long  # a minute or more: handed out first (tests/conftest.py)

PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


# Dense bf16 weights: batching changes bits in torch's GEMMs there (the control below shows it), the path the
# flag exists for; the GGUF blocks' kernels compute each row alone.
DENSE = "none"


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer) -> list[list[int]]:
    return sharegpt_first_turns(smollm2_tokenizer, 12, seed=13, length=(40, 200))


def tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def cached_llm() -> LLM:
    return LLM(dtype="bfloat16", deterministic=True, quantization=DENSE)


@pytest.fixture(scope="module")
def uncached_llm() -> LLM:
    """Without a prefix cache: what changes with the batch comes from the batch alone."""
    return LLM(dtype="bfloat16", deterministic=True, enable_prefix_caching=False, quantization=DENSE)


@pytest.fixture(scope="module")
def alone(prompts, cached_llm) -> list[list[int]]:
    """Each prompt on its own (only the chat template's system prompt is in the prefix cache)."""
    return [tokens(cached_llm, [p])[0] for p in prompts]


def test_batched_in_any_order_changes_no_token(prompts, alone, uncached_llm):
    assert tokens(uncached_llm, prompts) == alone
    assert tokens(uncached_llm, prompts[::-1])[::-1] == alone


def test_chunked_prefill_in_a_busy_batch_changes_no_token(prompts, alone):
    llm = LLM(dtype="bfloat16", deterministic=True, enable_prefix_caching=False, max_num_batched_tokens=24,
              quantization=DENSE)
    assert tokens(llm, prompts) == alone


def test_a_prompt_from_the_prefix_cache_changes_no_token(prompts, alone, cached_llm):
    hits = cached_llm.engine.pages.prefix_hits
    assert [tokens(cached_llm, [p])[0] for p in prompts] == alone  # every prompt's pages are cached now
    assert cached_llm.engine.pages.prefix_hits - hits >= sum(len(p) for p in prompts) // 2


def test_a_seeded_sample_is_the_same_alone_and_batched(prompts, uncached_llm):
    llm = uncached_llm
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=24, ignore_eos=True)
    alone = llm.generate(prompts[:1], seeded, use_tqdm=False)[0].outputs[0].token_ids
    batched = llm.generate(prompts[:8], [seeded] + [SamplingParams(temperature=0.8, max_tokens=24)] * 7,
                           use_tqdm=False)[0].outputs[0].token_ids
    assert batched == alone


def next_token_logits(llm: LLM, contexts: list[list[int]], together: bool) -> list[torch.Tensor]:
    """The raw logits after each context, read through the step loop (inspections): all contexts in one
    run of steps, batched as the scheduler batches them, or each alone."""
    engine, ids = llm.engine, itertools.count()
    readings: list[torch.Tensor] = []
    for group in [contexts] if together else [[c] for c in contexts]:
        names = [f"probe-{next(ids)}" for _ in group]
        for name, context in zip(names, group):
            engine.add_probe(name, context, Probe())
        done = {out.request_id: out.inspection.logits for step in iter(engine.step, []) for out in step
                if out.finished}
        readings += [done[name] for name in names]
    return readings


def short(prompts: list[list[int]]) -> list[list[int]]:
    """Six tokens from the middle of each prompt: alone, a prefill of 6 rows, which the small-batch kernel
    serves; together, 72 rows, which torch's GEMM serves."""
    return [p[len(p) // 2:len(p) // 2 + 6] for p in prompts]


@pytest.mark.parametrize("deterministic,contexts", [(True, "prompts"), (True, "short"), (False, "short")],
                         ids=["with-the-flag", "with-the-flag-short", "without-it-short"])
def test_a_contexts_logits_keep_their_bits_in_a_batch_only_with_the_flag(prompts, uncached_llm, deterministic,
                                                                         contexts):
    """With the flag every context's logits are the same bits alone and batched; without it, batching short
    contexts changes the bits of some (alone each goes through the small-batch kernel, together through
    torch's GEMM): the control that shows the comparisons above can fail. (Whole prompts are no control on
    every CPU: alone and together both go to torch's GEMM, whose bits follow the shape on some CPUs, AMX's,
    and not on others.)"""
    llm = uncached_llm if deterministic else LLM(dtype="bfloat16", enable_prefix_caching=False, quantization=DENSE)
    contexts = prompts if contexts == "prompts" else short(prompts)
    alone, together = next_token_logits(llm, contexts, False), next_token_logits(llm, contexts, True)
    same = [torch.equal(a, b) for a, b in zip(alone, together)]
    assert all(same) if deterministic else not all(same)
