"""`zhuzi bench kv`: KV beyond one engine, measured on `zhuzi serve` processes it starts itself.

pd: the long-prompt mix against two colocated replicas and against one prefill and one decode replica
(--kv-role), in the same run. restart: a long system prompt's TTFT cold, warm (in the pool), and after a kill -9
of every process and a restart on the same --kv-offload-dir (the disk tier).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass

from zhuzi.bench import machine_line
from zhuzi.bench import serve as serve_bench
from zhuzi.bench.client import chunk_content
from zhuzi.bench.datasets import load_tokenizer, random_text_conversations
from zhuzi.bench.launch import zhuzi_serve
from zhuzi.bench.scaling import load_args

PD_SETUPS = {"colocated": ["--data-parallel-size", "2"],
             "disaggregated": ["--data-parallel-size", "2", "--kv-role", "prefill,decode"]}
PARTS = ("pd", "restart")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated, from pd, restart (default: both)")
    parser.add_argument("--serve-args", default="--kv-cache-memory 512MiB",
                        help="flags every `zhuzi serve` gets (default: %(default)s)")
    parser.add_argument("--num-prompts", type=int, default=48, help="chat requests per setup (default %(default)s)")
    parser.add_argument("--max-concurrency", type=int, default=16, help="chat streams (default %(default)s)")
    parser.add_argument("--input-len", type=int, default=128, help="chat prompt tokens (default %(default)s)")
    parser.add_argument("--output-len", type=int, default=128, help="chat output tokens (default %(default)s)")
    parser.add_argument("--long-prompt-len", type=int, default=4000, help="(default %(default)s)")
    parser.add_argument("--long-prompt-interval", type=float, default=5.0, help="seconds (default %(default)s)")
    parser.add_argument("--system-prompt-len", type=int, default=2000,
                        help="restart: the system prompt's tokens (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=2, help="restart: rounds (default %(default)s)")
    parser.add_argument("--json-out", default=None, help="also write the report to this JSON file")


@dataclass
class MixResult:
    setup: str
    command: str
    load_before: float  # the 1-minute load average as the setup started: the noise it ran in
    output_tok_s: float
    itl_p50_ms: float
    itl_p99_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    long_ttft_p50_ms: float
    long_ttft_p99_ms: float
    long_answered: int
    failed: int


@dataclass
class RestartResult:
    round: int
    system_tokens: int
    cold_ttft_ms: float
    warm_ttft_ms: float
    restart_ttft_ms: float  # after kill -9 and a restart on the same disk tier
    restart_cached_tokens: int


def serve_args(url: str, args: argparse.Namespace, num_prompts: int, long_len: int) -> argparse.Namespace:
    """The chat load, with a long_len-token prompt every --long-prompt-interval seconds beside it (0: none)."""
    extra = ["--long-prompt-len", str(long_len), "--long-prompt-interval", str(args.long_prompt_interval)]
    return load_args(url, args, num_prompts, args.output_len, *(extra if long_len else []))


def run_mix(name: str, args: argparse.Namespace) -> MixResult:
    flags = [*args.serve_args.split(), *PD_SETUPS[name]]
    load_before = os.getloadavg()[0]
    with zhuzi_serve(flags) as url:
        serve_bench.run(serve_args(url, args, 4, 0))  # warm-up: kernels, allocator, both replicas
        r = serve_bench.run(serve_args(url, args, args.num_prompts, args.long_prompt_len))
    long = r.long_ttft_ms
    assert long is not None
    return MixResult(name, " ".join(["zhuzi serve", *flags]), load_before, r.output_throughput, r.itl_ms.median,
                     r.itl_ms.p99, r.ttft_ms.median, r.ttft_ms.p99, long.median, long.p99, r.long_completed, r.failed)


def first_token(url: str, system: str, question: str) -> tuple[float, int]:
    """TTFT (ms) of a streamed chat with this system prompt, and the prompt tokens it found cached."""
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": 8, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    start, ttft, cached = time.perf_counter(), None, 0
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and any(chunk_content(c) for c in chunk.get("choices") or []):
                ttft = (time.perf_counter() - start) * 1e3
            cached = ((chunk.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens", cached)
    if ttft is None:
        raise SystemExit("zhuzi bench kv: a reply carried no content")
    return ttft, cached


def disk_blocks_written(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith("zhuzi:kv_offload_stored_total") and 'tier="disk"' in line)


def run_restarts(args: argparse.Namespace) -> list[RestartResult]:
    tokenizer = load_tokenizer(None)
    systems = [c.turns[0].user for c in random_text_conversations(tokenizer, args.rounds, args.system_prompt_len,
                                                                    8, 0.0, seed=7)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="zhuzi-kv-") as folder:
        flags = [*args.serve_args.split(), "--kv-offload-dir", folder]
        for n, system in enumerate(systems):
            with zhuzi_serve(flags, crash=True) as url:
                first_token(url, "You are brief.", "Hello!")  # warm-up
                cold, _ = first_token(url, system, "Summarize the text above.")
                warm, _ = first_token(url, system, "Summarize the text above.")
                deadline = time.monotonic() + 120
                while disk_blocks_written(url) < args.system_prompt_len // 16 and time.monotonic() < deadline:
                    time.sleep(0.2)
            with zhuzi_serve(flags) as url:  # the one before ended with a kill -9
                first_token(url, "You are brief.", "Hello!")
                restarted, cached = first_token(url, system, "Summarize the text above.")
            rows.append(RestartResult(n, len(tokenizer.encode(system)), cold, warm, restarted, cached))
            print(f"restart round {n}: {json.dumps(asdict(rows[-1]))}", flush=True)
    return rows


def format_tables(mixes: list[MixResult], restarts: list[RestartResult]) -> str:
    lines = []
    if mixes:
        lines += ["| setup | chat ITL p50 / p99 ms | chat TTFT p50 / p99 ms | long-prompt TTFT p50 / p99 ms "
                  "| long prompts answered | out tok/s | failed | load |", "|---|---|---|---|---|---|---|---|"]
        for m in mixes:
            long = f"{m.long_ttft_p50_ms:.0f} / {m.long_ttft_p99_ms:.0f}" if m.long_answered else "none answered"
            lines.append(f"| {m.setup} | {m.itl_p50_ms:.1f} / {m.itl_p99_ms:.1f} | {m.ttft_p50_ms:.0f} / "
                         f"{m.ttft_p99_ms:.0f} | {long} | {m.long_answered} | {m.output_tok_s:.1f} | {m.failed} "
                         f"| {m.load_before:.2f} |")
    if restarts:
        lines += ["", "| round | system prompt tokens | cold TTFT ms | warm TTFT ms | after kill -9 + restart "
                      "(disk tier) TTFT ms | cached after restart |", "|---|---|---|---|---|---|"]
        lines += [f"| {r.round} | {r.system_tokens} | {r.cold_ttft_ms:.0f} | {r.warm_ttft_ms:.0f} | "
                  f"{r.restart_ttft_ms:.0f} | {r.restart_cached_tokens} |" for r in restarts]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> tuple[list[MixResult], list[RestartResult]]:
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if unknown := [p for p in parts if p not in PARTS]:
        raise SystemExit(f"zhuzi bench kv: unknown part {unknown[0]!r}; choose from {', '.join(PARTS)}")
    print(f"machine: {machine_line()}")
    mixes = []
    if "pd" in parts:
        print(f"mix:     {args.num_prompts} chat requests, {args.max_concurrency} at a time, {args.input_len} prompt "
              f"and {args.output_len} output tokens; a {args.long_prompt_len}-token prompt every "
              f"{args.long_prompt_interval:g} s")
        for name in PD_SETUPS:
            mixes.append(run_mix(name, args))
            print(f"{name}: {json.dumps(asdict(mixes[-1]))}", flush=True)
    restarts = run_restarts(args) if "restart" in parts else []
    print(format_tables(mixes, restarts))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"machine": machine_line(), "mix": [asdict(m) for m in mixes],
                       "restart": [asdict(r) for r in restarts]}, f, indent=2)
    return mixes, restarts
