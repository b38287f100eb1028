"""`zhuzi bench accuracy`: what each quantization costs in quality, against bf16 on the same model.

Per variant (bf16, a GGUF's own blocks, int8, int4, the default weights over a q8_0 KV cache, float32): greedy
agreement with bf16 on ShareGPT prompts (the decode path, as served), the mean |logprob difference| of bf16's
tokens scored teacher-forced, and perplexity as llama-perplexity measures it; --compare llama.cpp runs
llama-perplexity on the same GGUF, text and window beside it.
"""
from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from zhuzi.bench import add_compare_arguments, machine_line, model_label, save_report
from zhuzi.bench.datasets import sharegpt_answer_tokens, sharegpt_user_prompts
from zhuzi.bench.llamacpp import find_tool, gguf_of, llama_perplexity
from zhuzi.model import native

VARIANTS = {"float32": {"dtype": "float32"}, "bf16": {"quantization": "none"}, "gguf": {"quantization": "gguf"},
            "int8": {"quantization": "int8"}, "int4": {"quantization": "int4"},
            "kv-q8_0": {"kv_cache_dtype": "q8_0"}, "default": {}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", "-m", default=None, help="HF directory or .gguf file (default: embedded SmolLM2)")
    parser.add_argument("--variants", nargs="+", default=None, choices=list(VARIANTS),
                        help="models to compare with bf16 (default: all; gguf for a .gguf file only; with "
                             "--perplexity: default, the model's default weights, gguf for a .gguf file); "
                             "kv-q8_0: the default weights over a q8_0 KV cache")
    parser.add_argument("--num-prompts", type=int, default=32, help="chat prompts (default %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=64, help="greedy tokens a prompt (default %(default)s)")
    parser.add_argument("--text-tokens", type=int, default=20000,
                        help="tokens of ShareGPT answers for the perplexity (default %(default)s)")
    parser.add_argument("--window", type=int, default=1024, help="perplexity window in tokens (default %(default)s)")
    parser.add_argument("--perplexity", default=None, metavar="FILE.txt",
                        help="only the perplexity of this text file (beside llama-perplexity's with --compare)")
    parser.add_argument("--json-out", default=None, help="also write the report to this JSON file")
    add_compare_arguments(parser)


@dataclass
class Quality:
    variant: str
    perplexity: float
    greedy_agreement: float  # share of greedy tokens before the first difference from bf16
    identical: int  # continuations identical to bf16's
    mean_abs_logprob_diff: float  # nats, over bf16's chosen tokens, teacher-forced


@dataclass
class AccuracyReport:
    machine: str
    model: str
    num_prompts: int
    max_tokens: int
    text_tokens: int
    window: int
    results: list[Quality]

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TextPerplexity:
    """--perplexity FILE: each variant's perplexity of one text, and llama-perplexity's."""

    machine: str
    model: str
    text: str  # the file's name
    tokens: int
    window: int
    windows: int
    results: dict[str, float]  # variant -> perplexity
    llama_cpp: float | None = None
    llama_cpp_windows: int | None = None
    llama_cpp_command: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def perplexity(llm, tokens: list[int], window: int, bos: int | None = None) -> float:
    """llama-perplexity's measure: exp(mean negative log-likelihood) of the second half of each whole window
    of the tokens given its first half; each window's first token is bos, where given."""
    from zhuzi import SamplingParams

    windows = [([bos] if bos is not None else tokens[i:i + 1]) + tokens[i + 1:i + window]
               for i in range(0, len(tokens) - window + 1, window)]
    if not windows:
        raise ValueError(f"the text has {len(tokens)} tokens, fewer than one window of {window}")
    outs = llm.generate(windows, SamplingParams(max_tokens=1, prompt_logprobs=0))
    nll = [-out.prompt_logprobs[j][ids[j]].logprob for out, ids in zip(outs, windows)
           for j in range(window // 2 + 1, window)]
    return math.exp(statistics.fmean(nll))


def greedy(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from zhuzi import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


def continuation_logprobs(llm, prompts: list[list[int]], continuations: list[list[int]]) -> list[list[float]]:
    """Each continuation token's logprob given the prompt and the tokens before it (teacher-forced)."""
    from zhuzi import SamplingParams

    outs = llm.generate([p + c for p, c in zip(prompts, continuations)],
                        SamplingParams(max_tokens=1, prompt_logprobs=0))
    return [[entry[token].logprob for entry, token in zip(out.prompt_logprobs[len(p):], c)]
            for out, p, c in zip(outs, prompts, continuations)]


def agreement(reference: list[list[int]], other: list[list[int]]) -> tuple[float, int]:
    """(share of tokens before the first difference, number of identical continuations)."""
    prefix = [next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), len(r)) for r, o in zip(reference, other)]
    return sum(prefix) / sum(len(r) for r in reference), sum(r == o for r, o in zip(reference, other))


def measure(model: str | None, variants: list[str], prompts: list[list[int]], text: list[int], max_tokens: int,
            window: int) -> list[Quality]:
    """Quality of each variant against bf16 (which is always measured first)."""
    from zhuzi import LLM

    bf16 = LLM(model, **VARIANTS["bf16"])
    reference = greedy(bf16, prompts, max_tokens)
    reference_lp = continuation_logprobs(bf16, prompts, reference)
    results = []
    for variant in variants:
        llm = bf16 if variant == "bf16" else LLM(model, **VARIANTS[variant])
        tokens = reference if variant == "bf16" else greedy(llm, prompts, max_tokens)
        share, identical = agreement(reference, tokens)
        lp = reference_lp if variant == "bf16" else continuation_logprobs(llm, prompts, reference)
        diffs = [abs(a - b) for ra, rb in zip(reference_lp, lp) for a, b in zip(ra, rb)]
        results.append(Quality(variant, perplexity(llm, text, window), share, identical, statistics.fmean(diffs)))
    return results


def run(args: argparse.Namespace) -> AccuracyReport | TextPerplexity:
    from zhuzi.model.loader import default_model_path
    from zhuzi.tokenizer import Tokenizer

    if args.perplexity:
        return run_text(args)
    is_gguf = Path(args.model or default_model_path()).suffix == ".gguf"
    args.variants = args.variants or [v for v in VARIANTS if v != "default" and (v != "gguf" or is_gguf)]
    tokenizer = Tokenizer.load(args.model or default_model_path())
    prompts = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in sharegpt_user_prompts(args.num_prompts)]
    text = sharegpt_answer_tokens(tokenizer.hf, args.text_tokens)
    results = measure(args.model, args.variants, prompts, text, args.max_tokens, args.window)
    report = AccuracyReport(machine_line(native.current()), model_label(args.model),
                            len(prompts), args.max_tokens, len(text), args.window, results)
    print(format_report(report))
    return save_report(report, args.json_out)


def format_report(r: AccuracyReport) -> str:
    lines = [
        "=============== zhuzi bench accuracy ===============",
        f"machine:    {r.machine}",
        f"model:      {r.model}",
        f"greedy:     {r.num_prompts} ShareGPT chat prompts x {r.max_tokens} tokens, against bf16",
        f"perplexity: first {r.text_tokens} tokens of ShareGPT answers, windows of {r.window}",
        f"{'variant':<9} {'perplexity':>10} {'vs bf16':>8} {'greedy agreement':>17} {'identical':>10} "
        f"{'mean |dlogprob|':>16}",
    ]
    bf16 = next((q.perplexity for q in r.results if q.variant == "bf16"), None)
    for q in r.results:
        change = f"{100 * (q.perplexity / bf16 - 1):+7.2f}%" if bf16 else ""
        lines.append(f"{q.variant:<9} {q.perplexity:10.4f} {change:>8} {100 * q.greedy_agreement:16.1f}% "
                     f"{q.identical:>5}/{r.num_prompts:<4} {q.mean_abs_logprob_diff:16.4f}")
    return "\n".join(lines)


def run_text(args: argparse.Namespace) -> TextPerplexity:
    """--perplexity FILE: each variant's perplexity of the file, beside llama-perplexity's."""
    import torch

    from zhuzi import LLM

    # A --compare that cannot run fails before anything else does.
    gguf, tool = (gguf_of(args.model), find_tool("llama-perplexity", args.llama_cpp_bin)) if args.compare \
        else (None, None)
    text = Path(args.perplexity).read_text()
    variants = args.variants or ["default"]
    results, tokens, bos = {}, [], None
    for variant in variants:
        llm = LLM(args.model, **VARIANTS.get(variant, {}))
        if not tokens:  # the text as llama.cpp tokenizes it: BOS first where the tokenizer adds one
            tokens = llm.tokenizer.hf.encode(text)
            bos = tokens[0] if llm.tokenizer.hf.encode("") else None
        results[variant] = perplexity(llm, tokens, args.window, bos)
        del llm
    report = TextPerplexity(machine_line(), model_label(args.model),
                            Path(args.perplexity).name, len(tokens), args.window, len(tokens) // args.window, results)
    if tool is not None:
        report.llama_cpp, report.llama_cpp_windows, report.llama_cpp_command = llama_perplexity(
            tool, gguf, Path(args.perplexity), args.window, torch.get_num_threads())
    print(format_text_report(report))
    return save_report(report, args.json_out)


def format_text_report(r: TextPerplexity) -> str:
    lines = [
        "=============== zhuzi bench accuracy --perplexity ===============",
        f"machine:    {r.machine}",
        f"model:      {r.model}",
        f"text:       {r.text}, {r.tokens:,} tokens: {r.windows} windows of {r.window}, each scored on its second "
        "half (llama-perplexity's measure)",
        f"{'engine':<22} {'perplexity':>10} {'vs llama.cpp':>13} {'vs the first':>13}",
    ]
    first = next(iter(r.results.values()))
    for variant, value in r.results.items():
        change = f"{100 * (value / r.llama_cpp - 1):+12.2f}%" if r.llama_cpp else f"{'':13}"
        lines.append(f"{'zhuzi ' + variant:<22} {value:10.4f} {change} {100 * (value / first - 1):+12.2f}%")
    if r.llama_cpp is not None:
        lines += [f"{'llama.cpp':<22} {r.llama_cpp:10.4f}  ({r.llama_cpp_windows} windows)",
                  f"llama.cpp:  {r.llama_cpp_command}"]
    return "\n".join(lines)
