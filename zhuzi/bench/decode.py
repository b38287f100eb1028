"""`zhuzi bench decode`: one stream's prefill and decode speed against the memory-bandwidth roofline
(bandwidth over the weight bytes a step reads; a MoE step's active experts only) and, with --compare llama.cpp,
against llama-bench on the same GGUF and threads, the engines taking turns round by round.

Decode tokens/s count the whole step loop (scheduler, model, sampler, detokenizer); llama-bench's tg counts its
model calls. With --speculative-config it compares decoding with and without speculation (speculative.py).
"""
from __future__ import annotations

import argparse
import resource
import statistics
from dataclasses import asdict, dataclass, field

from zhuzi.bench import (
    add_compare_arguments,
    load_average,
    load_llm,
    machine_line,
    model_label,
    save_report,
    speculative,
)
from zhuzi.bench.datasets import random_token_requests
from zhuzi.bench.llamacpp import BenchTest, find_tool, gguf_of, llama_bench
from zhuzi.bench.speculative import SpecDecodeReport
from zhuzi.config import EngineConfig
from zhuzi.engine.worker.model_runner import measure_read_bandwidth, torch_sum_bandwidth
from zhuzi.model import native

BANDWIDTH_BUFFER_BYTES = 1 << 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    EngineConfig.add_cli_args(parser)
    parser.add_argument("--prompt-len", type=int, default=128,
                        help="prompt tokens; 512 measures prefill at length (default %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens to generate (default %(default)s)")
    parser.add_argument("--runs", type=int, default=3,
                        help="measured runs after one warm-up, each followed by a llama-bench run with --compare; "
                             "each figure is the best run's (default %(default)s)")
    parser.add_argument("--bandwidth-repeats", type=int, default=5,
                        help="reads of the bandwidth buffer; the fastest counts (default %(default)s)")
    parser.add_argument("--json-out", default=None, help="also write the report to this JSON file")
    add_compare_arguments(parser)
    parser.add_argument("--workload", choices=["random", "grounded"], default="random",
                        help="with --speculative-config: random-token prompts of --prompt-len, or chat requests "
                             "whose answers repeat their prompt (fix typos, comment code, quote)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="with --speculative-config: sampling temperature (default greedy, %(default)s)")
    parser.add_argument("--num-prompts", type=int, default=8,
                        help="with --speculative-config: prompts, each run with and without (default %(default)s)")


@dataclass
class LlamaCppDecode:
    """llama-bench's prompt processing (pp) and generation (tg) tests of the same lengths: the best of its
    rounds, and each round's."""

    command: str
    rounds: list[tuple[BenchTest, BenchTest]]

    @property
    def prefill(self) -> BenchTest:
        return max((pp for pp, _ in self.rounds), key=lambda t: t.tokens_per_s)

    @property
    def decode(self) -> BenchTest:
        return max((tg for _, tg in self.rounds), key=lambda t: t.tokens_per_s)


@dataclass
class DecodeReport:
    machine: str
    model: str
    dtype: str
    quantization: str | None
    threads: int
    prompt_tokens: int
    output_tokens: int
    prefill_s: float
    decode_step_s: float  # mean seconds per decode step in the best run
    bandwidth_bytes_per_s: float
    weight_bytes_per_step: int
    model_step_s: float  # mean seconds of the model runner's part of a decode step
    load: tuple[float, float]  # 1-minute load average at the start and at the end
    decode_rounds: list[float]  # decode tokens/s of each measured run
    sum_bandwidth_bytes_per_s: float = 0.0  # one torch.sum over the same buffer: the ceiling used before
    barrier_wait_s: float | None = None  # best run: mean s a thread waited at the fused step's barriers a step
    llama_cpp: LlamaCppDecode | None = None
    parameters: tuple[int, int] = (0, 0)  # (active, total): a Mixture-of-Experts step runs the top-k experts only
    experts: tuple[int, int] | None = None  # (top-k, experts) of a sparse model
    state_bytes_per_step: int = 0  # a hybrid model's recurrent state, read and written once a decode step
    prefill_rounds: list[float] = field(default_factory=list)  # prefill tokens/s of each measured run
    peak_rss_bytes: int = 0  # the process's resident memory at its peak, loading and runs (not llama.cpp's)
    rss_before_load_bytes: int = 0  # the same before the model loads: the runtime (Python, torch)

    @property
    def loaded_rss_bytes(self) -> int:
        """What loading and running the model added to the resident memory: its weights, KV cache, buffers."""
        return self.peak_rss_bytes - self.rss_before_load_bytes

    @property
    def bytes_per_step(self) -> int:
        """What a decode step of one stream must move: its weights, and a hybrid model's states."""
        return self.weight_bytes_per_step + self.state_bytes_per_step

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s

    @property
    def decode_tokens_per_s(self) -> float:
        return 1.0 / self.decode_step_s

    @property
    def roofline_tokens_per_s(self) -> float:
        return self.bandwidth_bytes_per_s / self.bytes_per_step

    @property
    def roofline_fraction(self) -> float:
        return self.decode_tokens_per_s / self.roofline_tokens_per_s

    @property
    def llama_cpp_roofline_fraction(self) -> float | None:
        """llama-bench's tg against the same roofline (it reads the same file's blocks a step)."""
        return self.llama_cpp.decode.tokens_per_s / self.roofline_tokens_per_s if self.llama_cpp else None

    @property
    def step_overhead_s(self) -> float:
        """A decode step's time beyond moving its bytes at the measured bandwidth (norms, attention, Python...)."""
        return self.decode_step_s - self.bytes_per_step / self.bandwidth_bytes_per_s

    @property
    def ratios(self) -> tuple[float, float] | None:
        """zhuzi / llama.cpp tokens/s: (prefill, decode)."""
        if self.llama_cpp is None:
            return None
        return (self.prefill_tokens_per_s / self.llama_cpp.prefill.tokens_per_s,
                self.decode_tokens_per_s / self.llama_cpp.decode.tokens_per_s)

    @property
    def decode_ratios_by_round(self) -> list[float] | None:
        """zhuzi / llama.cpp decode tokens/s of each round (the two runs of a round are neighbours in time)."""
        if self.llama_cpp is None:
            return None
        return [ours / tg.tokens_per_s for ours, (_, tg) in zip(self.decode_rounds, self.llama_cpp.rounds)]

    @property
    def prefill_ratios_by_round(self) -> list[float] | None:
        """zhuzi / llama.cpp prefill tokens/s of each round."""
        if self.llama_cpp is None:
            return None
        return [ours / pp.tokens_per_s for ours, (pp, _) in zip(self.prefill_rounds, self.llama_cpp.rounds)]

    def to_dict(self) -> dict:
        return asdict(self) | {name: getattr(self, name) for name in (
            "prefill_tokens_per_s", "decode_tokens_per_s", "roofline_tokens_per_s", "roofline_fraction",
            "llama_cpp_roofline_fraction", "ratios", "step_overhead_s", "decode_ratios_by_round",
            "prefill_ratios_by_round", "loaded_rss_bytes")}


def decode_step_seconds(metrics, output_tokens: int) -> float:
    """Mean seconds per generated token after the first: the whole step loop."""
    return (metrics.last_token_time - metrics.first_token_time) / max(1, output_tokens - 1)


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (Linux counts it in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10


def run(args: argparse.Namespace) -> DecodeReport | SpecDecodeReport:
    if args.speculative_config:
        return speculative.run(args)
    import torch

    from zhuzi import SamplingParams

    load_at_start = load_average()
    # A --compare that cannot run fails before anything else does.
    gguf, tool = (gguf_of(args.model), find_tool("llama-bench", args.llama_cpp_bin)) if args.compare else (None, None)
    rss_before_load = peak_rss_bytes()
    llm = load_llm(args)
    # A fresh prompt per run: a repeated one would be served from the prefix cache, not prefilled.
    requests = random_token_requests(llm.tokenizer.hf, args.runs + 1, (args.prompt_len, args.prompt_len),
                                     (args.max_tokens, args.max_tokens), args.seed,
                                     llm.model_config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate([requests[0].prompt_token_ids], params, use_tqdm=False)  # warm-up: first-call costs
    fused = llm.engine.runner.model.fused
    barrier_rounds = []  # each run's mean barrier wait a step
    prefill_s, model_s, rounds, prefill_rounds, peer_rounds = float("inf"), float("inf"), [], [], []
    for request in requests[1:]:
        if fused is not None:
            fused.time_barriers()
        output = llm.generate([request.prompt_token_ids], params, use_tqdm=False)[0]
        barrier_rounds.append(fused.barrier_wait_per_step if fused is not None and fused.steps else None)
        prefill_s = min(prefill_s, output.metrics.prefill_time)
        prefill_rounds.append(len(request.prompt_token_ids) / output.metrics.prefill_time)
        rounds.append(1 / decode_step_seconds(output.metrics, len(output.outputs[0].token_ids)))
        model_s = min(model_s, statistics.fmean(output.metrics.decode_step_times or [float("nan")]))
        if tool is not None:
            *tests, command = llama_bench(tool, gguf, torch.get_num_threads(), len(request.prompt_token_ids),
                                          len(output.outputs[0].token_ids), 1)
            peer_rounds.append(tuple(tests))
    peak_rss = peak_rss_bytes()  # before the bandwidth buffer
    c = llm.model_config
    buffer = torch.ones(BANDWIDTH_BUFFER_BYTES // 4, device=args.device)
    report = DecodeReport(
        machine=machine_line(native.current()), model=model_label(args.model),
        dtype=args.dtype, quantization=llm.engine.weight_format, threads=torch.get_num_threads(),
        prompt_tokens=len(request.prompt_token_ids), output_tokens=len(output.outputs[0].token_ids),
        prefill_s=prefill_s, decode_step_s=1 / max(rounds),
        bandwidth_bytes_per_s=measure_read_bandwidth(args.device, BANDWIDTH_BUFFER_BYTES, args.bandwidth_repeats),
        weight_bytes_per_step=llm.weight_bytes_per_decode_step, model_step_s=model_s, load=(load_at_start, 0.0),
        decode_rounds=rounds, sum_bandwidth_bytes_per_s=torch_sum_bandwidth(buffer, args.bandwidth_repeats),
        barrier_wait_s=barrier_rounds[rounds.index(max(rounds))],
        llama_cpp=LlamaCppDecode(command, peer_rounds) if tool else None,
        parameters=(c.active_parameters, c.num_parameters),
        experts=(c.num_experts_per_tok, c.num_experts) if c.num_experts else None,
        state_bytes_per_step=2 * c.state_bytes, prefill_rounds=prefill_rounds, peak_rss_bytes=peak_rss,
        rss_before_load_bytes=rss_before_load)
    report.load = (load_at_start, load_average())
    print(format_report(report, args))
    return save_report(report, args.json_out)


def format_report(r: DecodeReport, args: argparse.Namespace) -> str:
    lines = [
        "=============== zhuzi bench decode ===============",
        f"machine:    {r.machine}",
        f"load:       1-minute load average {r.load[0]:.2f} at the start, {r.load[1]:.2f} at the end",
        f"model:      {r.model}, {r.dtype}, quantization {r.quantization or 'none'}, {r.threads} threads",
        f"request:    one stream, {r.prompt_tokens}-token prompt, {r.output_tokens} new tokens, greedy, "
        f"ignore_eos; best of {args.runs} runs after a warm-up",
        f"prefill:    {r.prefill_tokens_per_s:10.1f} tokens/s  "
        f"({r.prompt_tokens} tokens in {r.prefill_s * 1e3:.1f} ms)",
        f"decode:     {r.decode_tokens_per_s:10.1f} tokens/s  ({r.decode_step_s * 1e3:.2f} ms a token, the whole "
        f"step loop; the model runner's part {r.model_step_s * 1e3:.2f} ms)",
        f"bandwidth:  {r.bandwidth_bytes_per_s / 1e9:10.1f} GB/s    (STREAM-style read of "
        f"{BANDWIDTH_BUFFER_BYTES >> 20} MiB, each thread its slice, best of {args.bandwidth_repeats}; one torch.sum: "
        f"{r.sum_bandwidth_bytes_per_s / 1e9:.1f} GB/s)",
        f"weights:    {r.weight_bytes_per_step / 1e6:10.1f} MB a decode step" + (
            f" (the active parameters, {r.parameters[0] / 1e6:.1f} M of {r.parameters[1] / 1e6:.1f} M: "
            f"top-{r.experts[0]} of {r.experts[1]} experts a sparse layer)" if r.experts else ""),
        *([f"states:     {r.state_bytes_per_step / 1e6:10.1f} MB a decode step (the recurrent layers' states, "
           "read and written: in the roofline)"] if r.state_bytes_per_step else []),
        f"roofline:   {r.roofline_tokens_per_s:10.1f} tokens/s  -> decode at "
        f"{100 * r.roofline_fraction:.1f} % of roofline",
        f"overhead:   {r.step_overhead_s * 1e3:10.2f} ms a step beside reading the weights at that bandwidth",
        f"memory:     {r.peak_rss_bytes / 2**20:10.0f} MiB resident at the peak, {r.loaded_rss_bytes / 2**20:.0f} MiB "
        "of it added by the model's load and runs (weights, KV cache, buffers)",
    ]
    if r.barrier_wait_s is not None:
        lines.append(f"barriers:   {r.barrier_wait_s * 1e3:10.3f} ms a step a thread waits at the fused step's "
                     f"barriers ({100 * r.barrier_wait_s / r.decode_step_s:.1f} % of the step; best run)")
    if r.llama_cpp:
        peer, (prefill_ratio, decode_ratio) = r.llama_cpp, r.ratios
        lines += [
            f"llama.cpp:  {peer.command}",
            f"            build {peer.decode.build}, {peer.decode.model_type}, {peer.decode.n_threads} threads",
            f"  {peer.prefill.name + ':':<9} {peer.prefill.tokens_per_s:10.1f} tokens/s  (best round)"
            f"   zhuzi / llama.cpp prefill: {prefill_ratio:.2f}x",
            f"  {peer.decode.name + ':':<9} {peer.decode.tokens_per_s:10.1f} tokens/s  (best round)"
            f"   zhuzi / llama.cpp decode:  {decode_ratio:.2f}x",
            f"roofline:   zhuzi decodes at {100 * r.roofline_fraction:.1f} %, llama.cpp at "
            f"{100 * r.llama_cpp_roofline_fraction:.1f} % of it",
            f"rounds:     zhuzi, then llama-bench -r 1, {len(peer.rounds)} times; decode tokens/s by round: zhuzi "
            + " ".join(f"{x:.1f}" for x in r.decode_rounds) + ", llama.cpp "
            + " ".join(f"{tg.tokens_per_s:.1f}" for _, tg in peer.rounds) + "; ratios "
            + " ".join(f"{x:.2f}" for x in r.decode_ratios_by_round),
        ]
    return "\n".join(lines)
