"""What the KV connector and pin tests share: a pool of 12 pages for the tiny float32 model, prompts of
random ids, and pressure that takes every page of that pool."""
from __future__ import annotations

import random

from zhuzi import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PAGE = 16
PAGE_BYTES = PAGE * 512  # the tiny model's K/V take 512 bytes a token in float32
POOL = 12 * PAGE_BYTES


def ids(seed: int, n: int = 64) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def llm(model: str, **options) -> LLM:
    return LLM(model, dtype=options.pop("dtype", "float32"), kv_cache_memory=options.pop("kv_cache_memory", POOL),
               **options)


def push_out(engine: LLM) -> None:
    """Two other prompts, one after the other, take every page of the pool."""
    for seed in (1, 2):
        engine.generate([ids(seed, 96)], GREEDY)
