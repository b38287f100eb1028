"""`zhuzi bench serve`: an OpenAI-API load generator for any compatible server, in the manner of `vllm bench serve`.

Every request streams and is timed as client.py says. A workload is a list of conversations: `random` one-turn
prompts of random tokens, `sharegpt` real multi-turn chats replayed with the server's own answers in the history
(so a prefix cache pays off). --poll, --tenants and --long-prompt-len add polling, several API keys' loads
(tenants.py) and the long-prompt mix.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from zhuzi.bench import machine_line, save_report, served_kernels, tenants
from zhuzi.bench.client import (
    ENDPOINT_PATHS,
    RequestResult,
    Stat,
    Target,
    discover_model,
    request_body,
    run_conversation,
    send_request,
)
from zhuzi.bench.datasets import Conversation, load_tokenizer, random_text_conversations, sharegpt_conversations

LONG_OUTPUT_TOKENS = 16  # each long prompt of the mix gets a short reply


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--endpoint", choices=sorted(ENDPOINT_PATHS), default="chat",
                        help="/v1/chat/completions or /v1/completions (default %(default)s)")
    parser.add_argument("--model", default=None,
                        help="model name to send; several, comma-separated, take the conversations in turn (a "
                             "server of many models) (default: the first of GET /v1/models)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="bearer token (default: $OPENAI_API_KEY)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer directory or .gguf file that builds the prompts "
                             "(default: the embedded SmolLM2's)")
    parser.add_argument("--dataset", choices=["random", "sharegpt"], default="random", help="(default %(default)s)")
    parser.add_argument("--num-prompts", type=int, default=100,
                        help="requests in all; for sharegpt, turns (default %(default)s)")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="most conversations, and so requests, in flight (default: no limit)")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="conversations started per second, Poisson arrivals; inf starts all at once "
                             "(default %(default)s)")
    parser.add_argument("--random-input-len", type=int, default=256, help="prompt tokens (default %(default)s)")
    parser.add_argument("--random-output-len", type=int, default=128, help="max_tokens (default %(default)s)")
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="lengths uniform in [len * (1 - r), len * (1 + r)] (default %(default)s)")
    parser.add_argument("--sharegpt-max-context", type=int, default=2048,
                        help="end a conversation before its history would pass this many tokens (default %(default)s)")
    parser.add_argument("--sharegpt-output-len", type=int, default=None,
                        help="max_tokens of every turn (default: the token length of the dataset's answer)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="send ignore_eos, so every request generates max_tokens (vLLM, zhuzi, llama-server)")
    parser.add_argument("--temperature", type=float, default=0.0, help="(default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the dataset and the arrivals (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds a request may wait for its next chunk (default %(default)s)")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    parser.add_argument("--poll", action="append", default=None,
                        help="also GET this path during the run, e.g. '/inspect/engine?steps=128' as the "
                             "inspector page does while its engine view is open (repeat it: each path polled "
                             "on its own)")
    parser.add_argument("--poll-interval", type=float, default=0.25,
                        help="seconds between the end of one poll and the next (default %(default)s: the page's "
                             "rate while a reply streams)")
    parser.add_argument("--tenants", nargs="+", default=None, metavar="SPEC",
                        help="several API keys at once, each SPEC comma-separated fields of a tenant: key (its API "
                             "key), name, streams, requests (how many are measured; without it, background load), "
                             "turns (a chat's), priority, delay (s), input, output (tokens); each measured tenant "
                             "runs alone, then all together, e.g. key=A,streams=32 key=B,requests=16,turns=4")
    parser.add_argument("--long-prompt-len", type=int, default=0,
                        help="also send a new prompt of this many tokens every --long-prompt-interval seconds while "
                             "the load runs, reported apart (default: none)")
    parser.add_argument("--long-prompt-interval", type=float, default=5.0, help="(default %(default)s)")
    parser.add_argument("--long-prompts", type=int, default=64, help="at most this many long prompts (default "
                                                                     "%(default)s)")
    parser.add_argument("--json-out", default=None, help="also write the report to this JSON file")


@dataclass
class ServeReport:
    machine: str
    base_url: str
    endpoint: str
    model: str
    dataset: str
    num_prompts: int
    max_concurrency: int | None
    request_rate: float
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    ttft_ms: Stat
    tpot_ms: Stat
    itl_ms: Stat
    e2el_ms: Stat
    errors: list[str]  # the first few distinct failure messages
    requests: list[RequestResult] = field(repr=False)
    poll_ms: Stat | None = None  # --poll: the polls' latencies
    polls: int = 0
    long_ttft_ms: Stat | None = None  # --long-prompt-len: the long prompts' TTFT
    long_completed: int = 0

    @property
    def request_throughput(self) -> float:
        return self.completed / self.duration_s

    @property
    def output_throughput(self) -> float:
        return self.total_output_tokens / self.duration_s

    @property
    def total_token_throughput(self) -> float:
        return (self.total_input_tokens + self.total_output_tokens) / self.duration_s

    def to_dict(self) -> dict:
        data = asdict(self)
        data["requests"] = [{k: v for k, v in r.items() if k not in ("itl", "text")} for r in data["requests"]]
        data["request_rate"] = str(self.request_rate)  # JSON has no inf
        return data | {name: getattr(self, name) for name in (
            "request_throughput", "output_throughput", "total_token_throughput")}


def arrival_offsets(count: int, rate: float, seed: int) -> np.ndarray:
    """Start times (s) of a Poisson process of `rate` per second; all zero for an infinite rate."""
    if rate == float("inf"):
        return np.zeros(count)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=count)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])


def build_workload(args: argparse.Namespace, tokenizer) -> list[Conversation]:
    if args.dataset == "sharegpt":
        return sharegpt_conversations(tokenizer, args.num_prompts, args.seed, args.sharegpt_max_context,
                                      args.sharegpt_output_len)
    return random_text_conversations(tokenizer, args.num_prompts, args.random_input_len,
                                     args.random_output_len, args.random_range_ratio, args.seed)


async def benchmark(args: argparse.Namespace) -> ServeReport:
    import httpx
    from tqdm import tqdm

    tokenizer = load_tokenizer(args.tokenizer)
    conversations = build_workload(args, tokenizer)
    base_url = args.base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as client:
        models = args.model.split(",") if args.model else [await discover_model(client, base_url, headers)]
        options = {"temperature": args.temperature} | ({"ignore_eos": True} if args.ignore_eos else {})
        targets = [Target(base_url + ENDPOINT_PATHS[args.endpoint], args.endpoint, model, headers, options,
                          render_template=args.dataset == "sharegpt") for model in models]
        limit = asyncio.Semaphore(args.max_concurrency or len(conversations))
        total = sum(len(c.turns) for c in conversations)
        polls: list[float] = []
        pollers = {path: asyncio.create_task(poll(client, base_url + path, headers, args.poll_interval, polls))
                   for path in args.poll or []}
        longs: list[RequestResult] = []
        load_done = asyncio.Event()
        sender = asyncio.create_task(send_long_prompts(client, targets[0], args, tokenizer, load_done, longs)) \
            if args.long_prompt_len else None
        with tqdm(total=total, desc="requests", disable=args.disable_tqdm) as progress:
            start = time.perf_counter()
            offsets = arrival_offsets(len(conversations), args.request_rate, args.seed)
            per_conversation = await asyncio.gather(*(
                run_conversation(client, targets[i % len(targets)], i, c, start + offsets[i], limit, tokenizer,
                                 progress)
                for i, c in enumerate(conversations)))
            duration = time.perf_counter() - start
            load_done.set()
            if sender is not None:
                await sender
        for path, poller in pollers.items():
            poller.cancel()
            (outcome,) = await asyncio.gather(poller, return_exceptions=True)
            if isinstance(outcome, Exception):
                raise RuntimeError(f"--poll {path} failed: {outcome}") from outcome
    results = [r for rs in per_conversation for r in rs]
    report = summarize(args, base_url, ",".join(models), results, duration, served_kernels(base_url, headers))
    if args.poll:
        report.poll_ms, report.polls = Stat.of(polls), len(polls)
    if args.long_prompt_len:
        done = [r for r in longs if r.success]
        report.long_ttft_ms, report.long_completed = Stat.of([r.ttft for r in done]), len(done)
    return report


async def send_long_prompts(client, target: Target, args: argparse.Namespace, tokenizer, load_done: asyncio.Event,
                            results: list[RequestResult]) -> None:
    """The long-prompt mix: a new long prompt (no prefix cache helps) every interval until the load is done;
    returns when those sent are answered."""
    conversations = random_text_conversations(tokenizer, args.long_prompts, args.long_prompt_len,
                                              LONG_OUTPUT_TOKENS, 0.0, args.seed + 1)
    tasks = []
    for index, conversation in enumerate(conversations):
        turn = conversation.turns[0]
        results.append(RequestResult(-1, index))
        body = request_body(target, [{"role": "user", "content": turn.user}], turn.max_tokens, tokenizer)
        tasks.append(asyncio.create_task(send_request(client, target, body, results[-1])))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(load_done.wait(), args.long_prompt_interval)
        if load_done.is_set():
            break
    await asyncio.gather(*tasks)


async def poll(client, url: str, headers: dict[str, str], interval: float, latencies: list[float]) -> None:
    """GET url every interval seconds until cancelled, keeping each answer's latency."""
    while True:
        start = time.perf_counter()
        response = await client.get(url, headers=headers)
        response.raise_for_status()
        latencies.append(time.perf_counter() - start)
        await asyncio.sleep(interval)


def summarize(args: argparse.Namespace, base_url: str, model: str, results: list[RequestResult],
              duration: float, kernels: str | None = None) -> ServeReport:
    ok = [r for r in results if r.success]
    return ServeReport(
        machine=machine_line(kernels), base_url=base_url, endpoint=args.endpoint, model=model, dataset=args.dataset,
        num_prompts=len(results), max_concurrency=args.max_concurrency, request_rate=args.request_rate,
        completed=len(ok), failed=len(results) - len(ok), duration_s=duration,
        total_input_tokens=sum(r.prompt_tokens for r in ok), total_output_tokens=sum(r.output_tokens for r in ok),
        ttft_ms=Stat.of([r.ttft for r in ok]), tpot_ms=Stat.of([r.tpot for r in ok if r.tpot is not None]),
        itl_ms=Stat.of([gap for r in ok for gap in r.itl]), e2el_ms=Stat.of([r.latency for r in ok]),
        errors=list(dict.fromkeys(r.error for r in results if r.error))[:5], requests=results)


def format_report(r: ServeReport) -> str:
    def row(name: str, value) -> str:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        return f"{name:<40} {text:<10}"

    def rule(title: str, fill: str) -> str:
        return f"{title:{fill}^50}"

    lines = [rule(" Serving Benchmark Result ", "="),
             row("Target:", f"{r.base_url} ({r.endpoint}, model {r.model})"),
             row("Dataset:", r.dataset),
             row("Traffic request rate:", str(r.request_rate)),
             row("Maximum request concurrency:", str(r.max_concurrency or "unlimited")),
             row("Successful requests:", r.completed),
             row("Failed requests:", r.failed),
             row("Benchmark duration (s):", r.duration_s),
             row("Total input tokens:", r.total_input_tokens),
             row("Total generated tokens:", r.total_output_tokens),
             row("Request throughput (req/s):", r.request_throughput),
             row("Output token throughput (tok/s):", r.output_throughput),
             row("Total token throughput (tok/s):", r.total_token_throughput)]
    for title, short, stat in (("Time to First Token", "TTFT", r.ttft_ms),
                               ("Time per Output Token (excl. 1st token)", "TPOT", r.tpot_ms),
                               ("Inter-token Latency", "ITL", r.itl_ms),
                               ("End-to-end Latency", "E2EL", r.e2el_ms)):
        lines += [rule(title, "-"), row(f"Mean {short} (ms):", stat.mean),
                  row(f"Median {short} (ms):", stat.median), row(f"P99 {short} (ms):", stat.p99)]
    if r.long_ttft_ms is not None:
        lines += [rule("Long prompts (--long-prompt-len)", "-"), row("Long prompts answered:", r.long_completed),
                  row("Median long-prompt TTFT (ms):", r.long_ttft_ms.median),
                  row("P99 long-prompt TTFT (ms):", r.long_ttft_ms.p99)]
    if r.poll_ms is not None:
        lines += [rule("Polling (--poll)", "-"), row("Polls:", r.polls),
                  row("Median poll latency (ms):", r.poll_ms.median), row("P99 poll latency (ms):", r.poll_ms.p99)]
    lines.append("=" * 50)
    lines += [f"error: {e}" for e in r.errors]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> ServeReport | tenants.TenantsReport:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request would bury the table
    if args.tenants:
        return tenants.run(args)
    report = asyncio.run(benchmark(args))
    print(format_report(report))
    return save_report(report, args.json_out)
