"""--deterministic: how often greedy answers change with the batch around them without it, and what it costs.

    OMP_NUM_THREADS=1 python benchmarks/deterministic.py [--max-tokens 64] [--json-out det.json]

20 ShareGPT first turns (SmolLM2, bf16, greedy), flag off and on: alone, in one batch, the batch in 24-token
steps (prefill chunks beside decodes), and again from the prefix cache; counts answers that differ from alone,
and times them in output tokens per CPU-second (on a shared machine CPU time does not count waits for a core).
"""
import argparse
import json
import os
import time

import torch

from zhuzi import LLM, SamplingParams
from zhuzi.bench import machine_line
from zhuzi.bench.datasets import sharegpt_first_turns
from zhuzi.model.loader import default_model_path
from zhuzi.tokenizer import Tokenizer


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], float]:
    start = time.process_time()
    outs = llm.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outs], time.process_time() - start


def measure(deterministic: bool, prompts: list[list[int]], params: SamplingParams) -> dict:
    llm = LLM(dtype="bfloat16", deterministic=deterministic)
    generate(llm, [prompts[0][:16]], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    alone, alone_s = [], 0.0
    for p in prompts:
        tokens, seconds = generate(llm, [p], params)
        alone += tokens
        alone_s += seconds
    batched, batched_s = generate(LLM(dtype="bfloat16", deterministic=deterministic, enable_prefix_caching=False),
                                  prompts, params)
    chunked = generate(LLM(dtype="bfloat16", deterministic=deterministic, enable_prefix_caching=False,
                           max_num_batched_tokens=24), prompts, params)[0]
    cached = [generate(llm, [p], params)[0][0] for p in prompts]  # alone, every prompt now in the cache
    n = sum(map(len, alone))

    def differ(outputs: list[list[int]]) -> int:
        return sum(a != b for a, b in zip(alone, outputs))

    return {"differ_batched": differ(batched), "differ_chunked": differ(chunked), "differ_cached": differ(cached),
            "alone_tokens_per_s": n / alone_s, "batched_tokens_per_s": n / batched_s}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json-out")
    args = ap.parse_args()
    prompts = sharegpt_first_turns(Tokenizer.load(default_model_path()), 20, seed=13)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    load = os.getloadavg()[0]
    result = {"machine": machine_line(), "threads": torch.get_num_threads(), "load_average_before": load,
              "off": measure(False, prompts, params), "on": measure(True, prompts, params),
              "load_average_after": os.getloadavg()[0]}
    print(f"machine: {result['machine']}, {result['threads']} threads, 1-minute load {load:.2f} before, "
          f"{result['load_average_after']:.2f} after")
    print(f"20 ShareGPT prompts, greedy, {args.max_tokens} tokens; answers differing from the prompt alone:")
    print("flag   batched  chunked  cached   alone tokens/CPU-s  batch-20 tokens/CPU-s")
    for name in ("off", "on"):
        r = result[name]
        print(f"{name:5s} {r['differ_batched']:5d}/20 {r['differ_chunked']:5d}/20 {r['differ_cached']:5d}/20 "
              f"{r['alone_tokens_per_s']:18.1f} {r['batched_tokens_per_s']:22.1f}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
