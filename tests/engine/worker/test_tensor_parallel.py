"""Tensor parallelism: two local processes (gloo) produce the greedy tokens one process does, in fp32, on the
default model (9 query / 3 KV heads: an uneven split, 2 KV heads and 1), on a tiny Qwen3-MoE (q/k norms; each
rank a slice of every expert), on a tiny Qwen3.5 (each rank one DeltaNet key head, its value heads and their
states), on a tiny gpt-oss (each rank its heads' sinks; the O and down biases added once), on a tiny
LFM2-MoE (each rank half of each short convolution's channels and of its state), on a tiny Gemma 4
(per-layer embeddings whole on every rank, shared K/V, MLPs of two widths split, and experts beside them, each
rank a slice of both, summed in one all-reduce) and on a tiny Granite 4 (each rank half of each Mamba2 layer's
heads and of their states: with experts and the one group of the released models, whose B and C each rank holds
and whose gated norm sums its squares across ranks; without experts, two groups, one a rank)."""
from __future__ import annotations

import pytest
import tiny

from zhuzi import LLM, SamplingParams
from zhuzi.model.parallel import split

PROMPTS = [list(range(3, 40)), [5, 9, 13] * 7, [42, 7]]  # token ids within both vocabularies


def greedy(model: str | None, tp: int) -> list[list[int]]:
    llm = LLM(model, dtype="float32", kv_cache_memory="32MiB", tensor_parallel_size=tp, num_threads=1)
    try:
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        outs = llm.generate(PROMPTS, params)
        return [out.outputs[0].token_ids for out in outs]
    finally:
        llm.engine.shutdown()


LAYERS = {"qwen3_moe": 3, "qwen3_5": 4, "gpt_oss": 3, "lfm2_moe": 4, "gemma4": 3,  # Qwen3.5: 3 DeltaNet, 1 attention
          "granitemoehybrid": 4}
CASES = [("smollm2", {}), ("qwen3_moe", {}), ("qwen3_5", {}), ("gpt_oss", {}), ("lfm2_moe", {}),
         ("gemma4", dict(vocab_size_per_layer_input=1001, **tiny.GEMMA4_EXPERTS)),
         ("granitemoehybrid", dict(mamba_n_groups=1)), ("granitemoehybrid", dict(num_local_experts=0))]


@pytest.mark.parametrize("arch, extra", CASES, ids=[arch + ("-dense" if extra.get("num_local_experts") == 0 else "")
                                                    for arch, extra in CASES])
def test_tp2_greedy_equals_tp1_in_fp32(arch, extra, tmp_path):
    model = None if arch == "smollm2" else str(tmp_path)
    if arch != "smollm2":  # an odd vocabulary: unequal LM-head slices
        tiny.build(arch, tmp_path, layers=LAYERS[arch], vocab_size=1001, **extra)
    assert greedy(model, 2) == greedy(model, 1)


def test_split_gives_the_remainder_to_the_first_parts():
    assert [split(3, 2, r) for r in range(2)] == [range(0, 2), range(2, 3)]
    assert [len(split(49152, 3, r)) for r in range(3)] == [16384] * 3
    assert [split(5, 3, r) for r in range(3)] == [range(0, 2), range(2, 4), range(4, 5)]
