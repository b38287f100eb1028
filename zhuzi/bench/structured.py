"""`zhuzi bench structured`: what structured output costs a decode step.

The same batch decodes twice per round: every row free, then every row under a JSON schema (an
array of at least 64 small objects, so no row's grammar ends within the measured steps). The
figure is the median decode step of each run, the best of the rounds, and their ratio: the cost
of filling each row's token mask, applying the masks and advancing the matchers.
"""
from __future__ import annotations

import argparse
import os
import statistics
from dataclasses import asdict, dataclass

from zhuzi.bench import load_llm, machine_line, save_report
from zhuzi.config import EngineConfig
from zhuzi.model import native

SCHEMA = {"type": "array", "minItems": 64, "items": {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0},
                   "city": {"enum": ["Paris", "London", "Tokyo", "Lima"]}},
    "required": ["name", "age", "city"], "additionalProperties": False}}
TOPICS = ["friends", "painters", "pilots", "teachers", "sailors", "doctors", "cooks", "poets"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    EngineConfig.add_cli_args(parser)
    parser.add_argument("--batch", type=int, default=16, help="rows decoding together (default %(default)s)")
    parser.add_argument("--steps", type=int, default=128, help="decode steps per run (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="free and constrained runs, interleaved after a warm-up; the best counts "
                             "(default %(default)s)")
    parser.add_argument("--json-out", default=None, help="also write the report to this JSON file")


@dataclass
class StructuredReport:
    machine: str
    model: str
    dtype: str
    threads: int
    batch: int
    steps: int
    rounds: int
    free_step_s: float  # median decode step with no row constrained, best round
    constrained_step_s: float  # the same with every row under the schema
    load_before: float  # 1-minute load average before the model was loaded, and at the end (this run included)
    load_after: float

    @property
    def ratio(self) -> float:
        return self.constrained_step_s / self.free_step_s

    def to_dict(self) -> dict:
        return asdict(self) | {"ratio": self.ratio}


def median_step_seconds(llm, prompts: list[list[int]], params) -> float:
    """The median decode step of one batched run (every request sees the same steps)."""
    outputs = llm.generate(prompts, params)
    assert all(len(o.outputs[0].token_ids) == params.max_tokens for o in outputs), "a row ended early"
    return statistics.median(outputs[0].metrics.decode_step_times)


def run(args: argparse.Namespace) -> StructuredReport:
    import torch

    from zhuzi import SamplingParams
    from zhuzi.sampling_params import StructuredOutputsParams

    load_before = os.getloadavg()[0]
    llm = load_llm(args)
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": f"List {TOPICS[i % len(TOPICS)]} as JSON "
                                                                      f"(list {i})."}])
               for i in range(args.batch)]

    def params(steps: int, constrained: bool) -> SamplingParams:
        schema = StructuredOutputsParams(json=SCHEMA) if constrained else None
        return SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, structured_outputs=schema)

    for constrained in (False, True):  # warm-up: first-call costs, the grammar's tokenizer view and compile
        llm.generate(prompts, params(8, constrained))
    free, constrained = params(args.steps, False), params(args.steps, True)
    free_s, constrained_s = [], []
    for _ in range(args.rounds):
        free_s.append(median_step_seconds(llm, prompts, free))
        constrained_s.append(median_step_seconds(llm, prompts, constrained))
    report = StructuredReport(
        machine=machine_line(native.current()), model=args.model or "SmolLM2-135M-Instruct (embedded GGUF)",
        dtype=args.dtype,
        threads=torch.get_num_threads(), batch=args.batch, steps=args.steps, rounds=args.rounds,
        free_step_s=min(free_s), constrained_step_s=min(constrained_s), load_before=load_before,
        load_after=os.getloadavg()[0])
    print(format_report(report))
    return save_report(report, args.json_out)


def format_report(r: StructuredReport) -> str:
    return "\n".join([
        "=============== zhuzi bench structured ===============",
        f"machine:      {r.machine}",
        f"model:        {r.model}, {r.dtype}, {r.threads} threads",
        f"workload:     batch {r.batch}, {r.steps} decode steps, greedy; every row free, then every row under a "
        f"JSON schema; median step, best of {r.rounds} interleaved rounds",
        f"free:         {r.free_step_s * 1e3:8.2f} ms a decode step",
        f"constrained:  {r.constrained_step_s * 1e3:8.2f} ms a decode step",
        f"ratio:        {r.ratio:8.3f} x   (target <= 1.15)",
        f"load:         1-minute load average {r.load_before:.2f} at the start, {r.load_after:.2f} at the end "
        f"(this run's {r.threads} threads included)",
    ])
