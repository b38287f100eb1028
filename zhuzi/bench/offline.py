"""`zhuzi bench offline`: many requests through LLM.generate, then the same ones through transformers
and, with --compare llama.cpp, llama-batched-bench on the same GGUF with the same threads.

The workload is nano-vllm's, scaled to a small CPU: random-token prompts and outputs of random lengths, with
ignore_eos. Every engine gets the same prompt ids and a warm-up first; with --rounds N they take turns, and each
round's prompts start with a token of their own, so that no round is served from an earlier one's prefix cache.
"""
from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict, dataclass

from zhuzi.bench import add_compare_arguments, load_average, load_llm, machine_line, model_label, save_report
from zhuzi.bench.datasets import TokenRequest, hf_source, random_token_requests, sampleable_token_ids
from zhuzi.bench.llamacpp import BatchedRun, batched_bench, find_tool, gguf_of
from zhuzi.config import EngineConfig
from zhuzi.model import native


def add_arguments(parser: argparse.ArgumentParser) -> None:
    EngineConfig.add_cli_args(parser)
    parser.add_argument("--num-prompts", type=int, default=64, help="requests (default %(default)s)")
    parser.add_argument("--min-input", type=int, default=64, help="shortest prompt in tokens (default %(default)s)")
    parser.add_argument("--max-input", type=int, default=512, help="longest prompt in tokens (default %(default)s)")
    parser.add_argument("--min-output", type=int, default=64, help="fewest output tokens (default %(default)s)")
    parser.add_argument("--max-output", type=int, default=512, help="most output tokens (default %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.6, help="(default %(default)s)")
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers run")
    parser.add_argument("--hf-batch-size", type=int, default=16,
                        help="requests per transformers generate call (default %(default)s)")
    parser.add_argument("--hf-num-prompts", type=int, default=None,
                        help="run transformers on the first N requests only, rounded up to whole "
                             "batches (default: all)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="zhuzi passes over the workload, each followed by llama-batched-bench with --compare; "
                             "each engine's best round counts (default %(default)s)")
    parser.add_argument("--json-out", default=None, help="also write the report to this JSON file")
    add_compare_arguments(parser)


@dataclass
class EngineRun:
    """One engine's pass over (part of) the workload; load time is kept out of the rate."""

    engine: str
    num_requests: int
    output_tokens: int
    wall_s: float
    load_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s


@dataclass
class OfflineReport:
    machine: str
    model: str
    dtype: str
    quantization: str | None
    num_prompts: int
    input_tokens: int
    requested_output_tokens: int
    zhuzi: EngineRun
    transformers: EngineRun | None
    comparison: str  # what the ratio compares, in words
    threads: int
    load: tuple[float, float]  # 1-minute load average at the start and at the end
    zhuzi_rounds: list[float]  # zhuzi's output tokens/s of each round
    llama_cpp_rounds: list[BatchedRun]
    llama_cpp_command: str | None = None

    @property
    def llama_cpp(self) -> BatchedRun | None:
        """llama-batched-bench's best round."""
        return max(self.llama_cpp_rounds, key=lambda r: r.output_tokens_per_s, default=None)

    @property
    def ratio(self) -> float | None:
        return self.zhuzi.tokens_per_s / self.transformers.tokens_per_s if self.transformers else None

    @property
    def llama_cpp_ratio(self) -> float | None:
        return self.zhuzi.tokens_per_s / self.llama_cpp.output_tokens_per_s if self.llama_cpp else None

    def to_dict(self) -> dict:
        data = asdict(self)
        data["zhuzi"]["tokens_per_s"] = self.zhuzi.tokens_per_s
        if self.transformers:
            data["transformers"]["tokens_per_s"] = self.transformers.tokens_per_s
        if self.llama_cpp:
            data["llama_cpp"] = asdict(self.llama_cpp) | {"output_tokens_per_s": self.llama_cpp.output_tokens_per_s}
        data["ratio"], data["llama_cpp_ratio"] = self.ratio, self.llama_cpp_ratio
        return data


def load_zhuzi(args: argparse.Namespace) -> tuple:
    """(the LLM, the workload, load seconds), after a short warm-up request."""
    from zhuzi import SamplingParams

    start = time.perf_counter()
    llm = load_llm(args)
    load_s = time.perf_counter() - start
    requests = make_workload(args, llm.tokenizer.hf, llm.model_config.vocab_size)
    llm.generate([requests[0].prompt_token_ids[:8]], SamplingParams(max_tokens=4), use_tqdm=False)
    return llm, requests, load_s


def run_zhuzi(llm, requests: list[TokenRequest], temperature: float, first_token: int, load_s: float) -> EngineRun:
    """One pass over the workload, every prompt starting with `first_token` (a round's own)."""
    from zhuzi import SamplingParams

    params = [SamplingParams(temperature=temperature, max_tokens=r.max_tokens, ignore_eos=True)
              for r in requests]
    start = time.perf_counter()
    outputs = llm.generate([[first_token] + r.prompt_token_ids[1:] for r in requests], params, use_tqdm=True)
    wall_s = time.perf_counter() - start
    tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
    return EngineRun("zhuzi", len(requests), tokens, wall_s, load_s)


def make_workload(args: argparse.Namespace, tokenizer, vocab_size: int) -> list[TokenRequest]:
    return random_token_requests(tokenizer, args.num_prompts, (args.min_input, args.max_input),
                                 (args.min_output, args.max_output), args.seed, vocab_size)


def hf_subset_size(args: argparse.Namespace) -> int:
    wanted = args.num_prompts if args.hf_num_prompts is None else args.hf_num_prompts
    return min(args.num_prompts, math.ceil(wanted / args.hf_batch_size) * args.hf_batch_size)


def run_transformers(args: argparse.Namespace, requests: list[TokenRequest]) -> EngineRun:
    """transformers' generate in left-padded batches, each running to its longest requested output."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, GgufConfig

    start = time.perf_counter()
    directory, gguf_file = hf_source(args.model)
    # Dense weights, as transformers users run it: its packed-GGUF path unpacks every weight on
    # every forward pass without a hub kernel, which would make the baseline a strawman.
    quantization = GgufConfig(dequantize=True) if gguf_file else None
    # zhuzi's activations' dtype (dtype auto resolved for this CPU), so both compute alike.
    dtype = EngineConfig.from_cli_args(args).precision.compute
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file, dtype=dtype,
                                                 quantization_config=quantization)
    model.to(args.device).eval()  # on zhuzi's device: a GPU's run beside a GPU's
    load_s = time.perf_counter() - start
    pad_id = model.generation_config.pad_token_id or model.generation_config.eos_token_id or 0
    pad_id = pad_id[0] if isinstance(pad_id, list) else pad_id
    generate_batch(model, [TokenRequest(requests[0].prompt_token_ids[:8], 4)], pad_id, args.temperature)
    torch.manual_seed(args.seed)
    batches = [requests[i:i + args.hf_batch_size] for i in range(0, len(requests), args.hf_batch_size)]
    counted = sum(r.max_tokens for r in requests)
    start = time.perf_counter()
    with tqdm(total=counted, desc="transformers", unit="tok") as bar:
        for batch in batches:
            generate_batch(model, batch, pad_id, args.temperature)
            bar.update(sum(r.max_tokens for r in batch))
    wall_s = time.perf_counter() - start
    return EngineRun("transformers", len(requests), counted, wall_s, load_s)


def generate_batch(model, batch: list[TokenRequest], pad_id: int, temperature: float) -> None:
    import torch

    width = max(len(r.prompt_token_ids) for r in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, request in enumerate(batch):
        input_ids[row, width - len(request.prompt_token_ids):] = torch.tensor(request.prompt_token_ids)
        attention_mask[row, width - len(request.prompt_token_ids):] = 1
    longest = max(r.max_tokens for r in batch)
    # min_new_tokens = max_new_tokens: EOS cannot end the batch early (ignore_eos).
    model.generate(input_ids=input_ids.to(model.device), attention_mask=attention_mask.to(model.device), do_sample=True,
                   temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=longest,
                   min_new_tokens=longest, pad_token_id=pad_id)


def comparison_note(num_prompts: int, hf_run: EngineRun | None, batch_size: int) -> str:
    if hf_run is None:
        return "transformers not run"
    batches = f"{math.ceil(hf_run.num_requests / batch_size)} transformers batch(es) of up to {batch_size}"
    if hf_run.num_requests == num_prompts:
        return f"both engines ran all {num_prompts} requests ({batches})"
    return (f"transformers ran the first {hf_run.num_requests} of {num_prompts} requests ({batches}); "
            f"its batches run one after another on the same length distribution, so its tokens/s over "
            f"whole batches estimates the full run's, and the ratio compares that with zhuzi over all "
            f"{num_prompts}")


def run(args: argparse.Namespace) -> OfflineReport:
    import torch

    load_at_start = load_average()
    # A --compare that cannot run fails before anything else does.
    gguf, tool = ((gguf_of(args.model), find_tool("llama-batched-bench", args.llama_cpp_bin)) if args.compare
                  else (None, None))
    llm, requests, load_s = load_zhuzi(args)
    mean_in, mean_out = (round(sum(lengths) / len(requests)) for lengths in zip(
        *((len(r.prompt_token_ids), r.max_tokens) for r in requests)))
    first_tokens = sampleable_token_ids(llm.tokenizer.hf, llm.model_config.vocab_size)[:args.rounds].tolist()
    zhuzi_runs, peer_runs, command = [], [], None
    for first in first_tokens:
        zhuzi_runs.append(run_zhuzi(llm, requests, args.temperature, first, load_s))
        if tool is not None:
            run_, command = batched_bench(tool, gguf, torch.get_num_threads(), mean_in, mean_out, len(requests))
            peer_runs.append(run_)
    del llm  # transformers gets the memory to itself
    hf_run = None if args.no_transformers else run_transformers(args, requests[:hf_subset_size(args)])
    report = OfflineReport(
        machine=machine_line(native.current()), model=model_label(args.model),
        dtype=args.dtype, quantization=args.quantization, num_prompts=len(requests),
        input_tokens=sum(len(r.prompt_token_ids) for r in requests),
        requested_output_tokens=sum(r.max_tokens for r in requests),
        zhuzi=max(zhuzi_runs, key=lambda r: r.tokens_per_s), transformers=hf_run,
        comparison=comparison_note(len(requests), hf_run, args.hf_batch_size),
        threads=torch.get_num_threads(), load=(load_at_start, 0.0),
        zhuzi_rounds=[r.tokens_per_s for r in zhuzi_runs], llama_cpp_rounds=peer_runs,
        llama_cpp_command=command)
    report.load = (load_at_start, load_average())
    print(format_report(report, args))
    return save_report(report, args.json_out)


def format_report(report: OfflineReport, args: argparse.Namespace) -> str:
    lines = [
        "=============== zhuzi bench offline ===============",
        f"machine:  {report.machine}",
        f"load:     1-minute load average {report.load[0]:.2f} at the start, {report.load[1]:.2f} at the end",
        f"model:    {report.model}, {report.dtype}, quantization {report.quantization or 'none'}, "
        f"{report.threads} threads",
        f"workload: {report.num_prompts} requests, prompts U[{args.min_input}, {args.max_input}] "
        f"({report.input_tokens} tokens), outputs U[{args.min_output}, {args.max_output}] "
        f"({report.requested_output_tokens} tokens), ignore_eos, temperature {args.temperature}, seed {args.seed}",
    ]
    for run_ in (report.zhuzi, report.transformers):
        if run_:
            lines.append(f"{run_.engine:<13} {run_.num_requests:>4} requests  {run_.output_tokens:>7} output tokens  "
                         f"{run_.wall_s:8.2f} s  {run_.tokens_per_s:9.1f} output tokens/s  (load {run_.load_s:.1f} s)")
    if (peer := report.llama_cpp) is not None:
        lines.append(f"{'llama.cpp':<13} {peer.pl:>4} seqs      {peer.output_tokens:>7} output tokens  "
                     f"{peer.total_s:8.2f} s  {peer.output_tokens_per_s:9.1f} output tokens/s  "
                     f"(llama-batched-bench: {peer.pl} x {peer.pp} prompt + {peer.tg} output tokens; prefill "
                     f"{peer.prefill_tokens_per_s:.1f} tokens/s, decode {peer.decode_tokens_per_s:.1f} tokens/s)")
    if report.ratio is not None:
        lines.append(f"zhuzi / transformers: {report.ratio:.2f}x output tokens/s")
    if report.llama_cpp_ratio is not None:
        lines.append(f"zhuzi / llama.cpp:    {report.llama_cpp_ratio:.2f}x output tokens/s")
    lines.append(f"compared:  {report.comparison}")
    if report.llama_cpp_command:
        lines.append(f"llama.cpp: {report.llama_cpp_command}")
    if len(report.zhuzi_rounds) > 1:
        peer = " ".join(f"{r.output_tokens_per_s:.1f}" for r in report.llama_cpp_rounds)
        lines.append("rounds:    output tokens/s by round (each engine's best counts): zhuzi "
                     + " ".join(f"{x:.1f}" for x in report.zhuzi_rounds) + (f", llama.cpp {peer}" if peer else ""))
    return "\n".join(lines)
