"""`zhuzi bench polling`: what watching a server costs the streams it serves.

One `bench serve` workload (the same flags) against one server twice a round, quiet and with --poll at the
inspector page's rate (/inspect/engine and /inspect/batch by default), the order swapped every round. Reported:
the best run of each arm (outside disturbances only add time; the polling's cost is in every polled run) and
the median of the rounds' ratios.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
from dataclasses import asdict, dataclass, field

from zhuzi.bench import machine_line, save_report, served_kernels
from zhuzi.bench import serve as serve_bench

# The page's polls while its batch view is open (its engine view polls /inspect/engine?steps=128 alone).
PAGE_POLLS = ["/inspect/engine?steps=0", "/inspect/batch?steps=48"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    serve_bench.add_arguments(parser)
    parser.add_argument("--rounds", type=int, default=5,
                        help="quiet and polled runs per round, order swapped each round (default %(default)s)")
    parser.set_defaults(max_concurrency=16, num_prompts=16, ignore_eos=True, disable_tqdm=True)


@dataclass
class ServeRun:
    round: int
    arm: str  # "quiet" or "polled"
    tpot_ms: float  # the run's median TPOT
    output_throughput: float
    polls: int
    poll_ms: float | None  # the polls' median latency
    load: float  # 1-minute load average at the end of the run


@dataclass
class PollingReport:
    machine: str
    base_url: str
    poll: list[str]
    poll_interval: float
    streams: int
    output_len: int
    rounds: int
    load_before: float
    runs: list[ServeRun] = field(default_factory=list)

    def tpots(self, arm: str) -> list[float]:
        return [r.tpot_ms for r in self.runs if r.arm == arm]

    @property
    def best_ratio(self) -> float:
        return min(self.tpots("polled")) / min(self.tpots("quiet"))

    @property
    def median_ratio(self) -> float:
        return statistics.median(p / q for p, q in zip(self.tpots("polled"), self.tpots("quiet")))

    def to_dict(self) -> dict:
        return asdict(self) | {"best_ratio": self.best_ratio, "median_ratio": self.median_ratio}


def measure(args: argparse.Namespace, round_: int, arm: str) -> ServeRun:
    """One `bench serve` run, quiet or polled."""
    report = asyncio.run(serve_bench.benchmark(argparse.Namespace(**vars(args) | {
        "poll": args.poll if arm == "polled" else None})))
    if report.failed:
        raise RuntimeError(f"{report.failed} requests failed: {report.errors}")
    return ServeRun(round_, arm, report.tpot_ms.median, report.output_throughput, report.polls,
               report.poll_ms.median if report.poll_ms else None, os.getloadavg()[0])


def run(args: argparse.Namespace) -> PollingReport:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args.poll = args.poll or list(PAGE_POLLS)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    report = PollingReport(machine_line(served_kernels(args.base_url, headers)), args.base_url, args.poll,
                           args.poll_interval, args.max_concurrency or args.num_prompts, args.random_output_len,
                           args.rounds, os.getloadavg()[0])
    measure(args, -1, "polled")  # warm-up: first-call costs, and the engine measures its bandwidth once
    print(f"{'round':>5} {'arm':>6} {'TPOT ms':>8} {'tok/s':>7} {'polls':>5} {'poll ms':>7} {'load':>5}")
    for i in range(args.rounds):
        for arm in ("quiet", "polled") if i % 2 == 0 else ("polled", "quiet"):
            r = measure(args, i, arm)
            report.runs.append(r)
            poll_ms = f"{r.poll_ms:.1f}" if r.poll_ms is not None else "-"
            print(f"{i:>5} {arm:>6} {r.tpot_ms:>8.2f} {r.output_throughput:>7.1f} {r.polls:>5} {poll_ms:>7} "
                  f"{r.load:>5.2f}", flush=True)
    print(f"{report.machine}; load {report.load_before:.2f} at the start\n"
          f"{report.streams} streams, GET {' and '.join(report.poll)} every {report.poll_interval} s in the polled"
          " runs\n"
          f"best median TPOT: quiet {min(report.tpots('quiet')):.2f} ms, polled {min(report.tpots('polled')):.2f} ms"
          f" -> polled/quiet {report.best_ratio:.3f}\n"
          f"median of the {args.rounds} rounds' polled/quiet: {report.median_ratio:.3f}")
    return save_report(report, args.json_out)
