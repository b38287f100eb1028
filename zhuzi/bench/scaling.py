"""`zhuzi bench scaling`: what each way of running `zhuzi serve` costs and buys, side by side.

Each setup (SETUPS: its flags) is started, warmed up and given the same `bench serve` load (16 streams) while a
prober process GETs /health and /v1/models every 10 ms: the front's latency while the engine works.
--collectives also times what tensor parallelism adds to a layer against what it saves (collectives.py).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time
import urllib.request
from dataclasses import asdict, dataclass

from zhuzi.bench import machine_line
from zhuzi.bench import serve as serve_bench
from zhuzi.bench.launch import zhuzi_serve
from zhuzi.model import native

SETUPS = {
    "in-process": ["--no-engine-process"],
    "engine-process": [],
    # Against tp1-1t, the engine process's cost alone (on a busy machine 2 OpenMP threads can run many times
    # slower than 1).
    "in-process-1t": ["--no-engine-process", "--num-threads", "1"],
    "dp2-mp": ["--data-parallel-size", "2"],
    "dp2-ray": ["--data-parallel-size", "2", "--data-parallel-backend", "ray"],
    "tp1-1t": ["--num-threads", "1"],  # tp2's reference: one rank's share of the cores
    "tp2": ["--tensor-parallel-size", "2"],
}
PROBE_PERIOD_S = 0.010


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--setups", default=",".join(SETUPS),
                        help=f"comma-separated, from {', '.join(SETUPS)} (default: all)")
    parser.add_argument("--serve-args", default="--kv-cache-memory 256MiB",
                        help="flags every `zhuzi serve` gets (default: %(default)s)")
    parser.add_argument("--num-prompts", type=int, default=16, help="requests per setup (default %(default)s)")
    parser.add_argument("--max-concurrency", type=int, default=16, help="(default %(default)s)")
    parser.add_argument("--input-len", type=int, default=80, help="prompt tokens (default %(default)s)")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens (default %(default)s)")
    parser.add_argument("--collectives", action="store_true",
                        help="also time a gloo all-reduce against a layer's compute (2 local ranks)")
    parser.add_argument("--json-out", default=None, help="also write the report to this JSON file")


@dataclass
class SetupResult:
    setup: str
    command: str
    load_before: float  # the 1-minute load average as the setup started: the noise it ran in
    output_tok_s: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    ttft_p50_ms: float
    failed: int
    health_p50_ms: float
    health_p99_ms: float
    models_p50_ms: float
    models_p99_ms: float
    probes: int


def probe(url: str, started, stop, results) -> None:
    """GET /health and /v1/models in turn until told to stop; each answer's latency in ms."""
    latencies: dict[str, list[float]] = {"/health": [], "/v1/models": []}
    paths = list(latencies)
    n = 0
    while not stop.is_set() or n < 2:  # both paths at least once
        if n == 2:
            started.set()
        path = paths[n % 2]
        start = time.perf_counter()
        with urllib.request.urlopen(url + path, timeout=30) as answer:
            answer.read()
        latencies[path].append((time.perf_counter() - start) * 1e3)
        n += 1
        time.sleep(PROBE_PERIOD_S)
    results.put(latencies)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] if ordered else float("nan")


def load_args(url: str, args: argparse.Namespace, num_prompts: int, output_len: int,
              *extra: str) -> argparse.Namespace:
    """`zhuzi bench serve`'s arguments for this load: random prompts, every reply its full length; extra: more of
    its flags."""
    parser = argparse.ArgumentParser()
    serve_bench.add_arguments(parser)
    return parser.parse_args(["--base-url", url, "--num-prompts", str(num_prompts), "--max-concurrency",
                              str(args.max_concurrency), "--random-input-len", str(args.input_len),
                              "--random-output-len", str(output_len), "--ignore-eos", "--disable-tqdm", *extra])


def run_setup(name: str, args: argparse.Namespace) -> SetupResult:
    flags = [*args.serve_args.split(), *SETUPS[name]]
    load_before = os.getloadavg()[0]
    with zhuzi_serve(flags) as url:
        serve_bench.run(load_args(url, args, 2, 8))  # warm-up: kernels, allocator, Ray's first calls
        context = multiprocessing.get_context("spawn")
        started, stop, results = context.Event(), context.Event(), context.Queue()
        prober = context.Process(target=probe, args=(url, started, stop, results))
        prober.start()
        started.wait()
        report = serve_bench.run(load_args(url, args, args.num_prompts, args.output_len))
        stop.set()
        latencies = results.get()
        prober.join()
    health, models = latencies["/health"], latencies["/v1/models"]
    return SetupResult(name, " ".join(["zhuzi serve", *flags]), load_before, report.output_throughput,
                       report.tpot_ms.median, report.tpot_ms.p99, report.ttft_ms.median, report.failed,
                       percentile(health, 50), percentile(health, 99), percentile(models, 50),
                       percentile(models, 99), len(health) + len(models))


def format_table(rows: list[SetupResult]) -> str:
    lines = ["| setup | out tok/s | TPOT p50 / p99 ms | TTFT p50 ms | /health p50 / p99 ms | /v1/models p50 / p99 ms "
             "| failed | load |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.setup} | {r.output_tok_s:.1f} | {r.tpot_p50_ms:.1f} / {r.tpot_p99_ms:.1f} | "
                     f"{r.ttft_p50_ms:.0f} | {r.health_p50_ms:.1f} / {r.health_p99_ms:.1f} | "
                     f"{r.models_p50_ms:.1f} / {r.models_p99_ms:.1f} | {r.failed} | {r.load_before:.2f} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> list[SetupResult]:
    names = [n.strip() for n in args.setups.split(",") if n.strip()]
    if unknown := [n for n in names if n not in SETUPS]:
        raise SystemExit(f"zhuzi bench scaling: unknown setup {unknown[0]!r}; choose from {', '.join(SETUPS)}")
    print(f"machine: {machine_line(native.resolve(native.default_choice()))}")
    print(f"load:    {args.num_prompts} requests, {args.max_concurrency} at a time, {args.input_len} prompt tokens, "
          f"{args.output_len} output tokens, ignore_eos; prober every {PROBE_PERIOD_S * 1e3:.0f} ms")
    rows = []
    for name in names:
        rows.append(run_setup(name, args))
        print(f"{name}: {json.dumps(asdict(rows[-1]))}", flush=True)
    print(format_table(rows))
    collectives = None
    if args.collectives:
        from zhuzi.bench import collectives as coll

        collectives = coll.measure()
        print(coll.format_report(collectives))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"machine": machine_line(native.resolve(native.default_choice())),
                       "setups": [asdict(r) for r in rows],
                       "collectives": collectives and asdict(collectives)}, f, indent=2)
    return rows
