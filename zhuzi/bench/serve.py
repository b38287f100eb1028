"""`zhuzi bench serve`: an OpenAI-API load generator for any compatible server, in the manner of `vllm bench serve`.

Every request streams (SSE). Per request it measures, from the moment the
request is sent:
  TTFT  time to the first chunk that carries content;
  ITL   the gaps between successive content chunks;
  TPOT  (end-to-end - TTFT) / (output tokens - 1), over requests of 2+ tokens;
  E2E   time to the end of the stream.
Output tokens come from the usage chunk (stream_options.include_usage) when the
server sends one, else from the number of content chunks; prompt tokens from
usage, else from a local count of the messages' text.

A workload is a list of conversations: `random` gives one-turn conversations
of random tokens; `sharegpt` replays real multi-turn chats turn by turn, each
next turn carrying the whole history including the server's previous answer,
so a prefix cache pays off. --request-rate is the Poisson arrival rate of
conversations; --max-concurrency caps the conversations (and so the requests)
in flight. --poll GETs a path every --poll-interval seconds while the load runs (the inspector page
polls /inspect/engine so): run with and without it to see what watching costs the streams.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from zhuzi.bench import machine_line, save_report, served_kernels
from zhuzi.bench.datasets import Conversation, load_tokenizer, random_text_conversations, sharegpt_conversations

ENDPOINT_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--endpoint", choices=sorted(ENDPOINT_PATHS), default="chat",
                        help="/v1/chat/completions or /v1/completions (default %(default)s)")
    parser.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
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
    parser.add_argument("--json-out", default=None, help="also write the report to this JSON file")


@dataclass
class Target:
    """Where and how requests are sent."""

    url: str
    endpoint: str
    model: str
    headers: dict[str, str]
    options: dict  # extra request fields: temperature, ignore_eos
    render_template: bool  # completions endpoint: send the chat rendered through the chat template


@dataclass
class RequestResult:
    conversation: int
    turn: int
    success: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass
class Stat:
    """Milliseconds."""

    mean: float
    median: float
    p99: float

    @classmethod
    def of(cls, seconds: list[float]) -> Stat:
        if not seconds:
            return cls(0.0, 0.0, 0.0)
        ms = np.asarray(seconds) * 1e3
        return cls(float(ms.mean()), float(np.median(ms)), float(np.percentile(ms, 99)))


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


def chunk_content(choice: dict) -> str:
    """The text a streamed choice carries; servers differ in where (and whether) they put it."""
    delta = choice.get("delta") or choice.get("message") or {}
    parts = (delta.get("content"), delta.get("reasoning_content"), delta.get("reasoning"), choice.get("text"))
    return "".join(part for part in parts if isinstance(part, str))


def sse_data(line: str) -> str | None:
    """The data of one SSE line, or None for comments, other fields and blank lines."""
    if not line.startswith("data:"):
        return None
    return line[5:].strip()


def request_body(target: Target, messages: list[dict], max_tokens: int, tokenizer) -> dict:
    body = {"model": target.model, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, **target.options}
    if target.endpoint == "chat":
        body["messages"] = messages
    elif target.render_template:
        body["prompt"] = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        body["prompt"] = messages[-1]["content"]
    return body


async def send_request(client, target: Target, body: dict, result: RequestResult) -> None:
    """Stream one request into `result`, timing every content chunk."""
    start = time.perf_counter()
    last = start
    chunks = 0
    try:
        async with client.stream("POST", target.url, json=body, headers=target.headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:200]}"
                return
            async for line in response.aiter_lines():
                data = sse_data(line.strip())
                if not data:
                    continue
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    result.error = f"stream error: {json.dumps(chunk['error'])[:200]}"
                    return
                usage = chunk.get("usage") or {}
                result.output_tokens = usage.get("completion_tokens") or result.output_tokens
                result.prompt_tokens = usage.get("prompt_tokens") or result.prompt_tokens
                text = "".join(chunk_content(choice) for choice in chunk.get("choices") or [])
                if not text:
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last, chunks = now, chunks + 1
                result.text += text
    except Exception as error:  # any failure of one request is data, not a crash of the run
        result.error = f"{type(error).__name__}: {error}"
        return
    result.latency = time.perf_counter() - start
    result.output_tokens = result.output_tokens or chunks
    result.success = chunks > 0
    if not result.success:
        result.error = "the stream carried no content"


async def run_conversation(client, target: Target, index: int, conversation: Conversation, start_at: float,
                           limit: asyncio.Semaphore, tokenizer, progress) -> list[RequestResult]:
    """Replay one conversation turn by turn, feeding back the server's own answers."""
    await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
    results = []
    messages = [{"role": "system", "content": conversation.system}] if conversation.system else []
    async with limit:
        for turn_index, turn in enumerate(conversation.turns):
            messages.append({"role": "user", "content": turn.user})
            result = RequestResult(index, turn_index)
            await send_request(client, target, request_body(target, messages, turn.max_tokens, tokenizer), result)
            if result.success and not result.prompt_tokens:
                result.prompt_tokens = count_tokens(tokenizer, messages)
            results.append(result)
            progress.update(1)
            if not result.success:
                break
            messages.append({"role": "assistant", "content": result.text})
    for turn_index in range(len(results), len(conversation.turns)):
        results.append(RequestResult(index, turn_index, error="an earlier turn of its conversation failed"))
        progress.update(1)
    return results


def count_tokens(tokenizer, messages: list[dict]) -> int:
    return sum(len(tokenizer.encode(m["content"], add_special_tokens=False)) for m in messages)


def arrival_offsets(count: int, rate: float, seed: int) -> np.ndarray:
    """Start times (s) of a Poisson process of `rate` per second; all zero for an infinite rate."""
    if rate == float("inf"):
        return np.zeros(count)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=count)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])


async def discover_model(client, base_url: str, headers: dict[str, str]) -> str:
    try:
        response = await client.get(f"{base_url}/v1/models", headers=headers)
        response.raise_for_status()
        models = response.json().get("data") or []
    except Exception as error:
        raise SystemExit(f"cannot list the models at {base_url}/v1/models ({error}); "
                         f"is the server up? Or pass --model") from error
    if not models:
        raise SystemExit(f"{base_url}/v1/models lists no model; pass --model")
    return models[0]["id"]


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
        model = args.model or await discover_model(client, base_url, headers)
        options = {"temperature": args.temperature} | ({"ignore_eos": True} if args.ignore_eos else {})
        target = Target(base_url + ENDPOINT_PATHS[args.endpoint], args.endpoint, model, headers, options,
                        render_template=args.dataset == "sharegpt")
        limit = asyncio.Semaphore(args.max_concurrency or len(conversations))
        total = sum(len(c.turns) for c in conversations)
        polls: list[float] = []
        pollers = {path: asyncio.create_task(poll(client, base_url + path, headers, args.poll_interval, polls))
                   for path in args.poll or []}
        with tqdm(total=total, desc="requests", disable=args.disable_tqdm) as progress:
            start = time.perf_counter()
            offsets = arrival_offsets(len(conversations), args.request_rate, args.seed)
            per_conversation = await asyncio.gather(*(
                run_conversation(client, target, i, c, start + offsets[i], limit, tokenizer, progress)
                for i, c in enumerate(conversations)))
            duration = time.perf_counter() - start
        for path, poller in pollers.items():
            poller.cancel()
            (outcome,) = await asyncio.gather(poller, return_exceptions=True)
            if isinstance(outcome, Exception):
                raise RuntimeError(f"--poll {path} failed: {outcome}") from outcome
    results = [r for rs in per_conversation for r in rs]
    report = summarize(args, base_url, model, results, duration, served_kernels(base_url, headers))
    if args.poll:
        report.poll_ms, report.polls = Stat.of(polls), len(polls)
    return report


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
    if r.poll_ms is not None:
        lines += [rule("Polling (--poll)", "-"), row("Polls:", r.polls),
                  row("Median poll latency (ms):", r.poll_ms.median), row("P99 poll latency (ms):", r.poll_ms.p99)]
    lines.append("=" * 50)
    lines += [f"error: {e}" for e in r.errors]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> ServeReport:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request would bury the table
    report = asyncio.run(benchmark(args))
    print(format_report(report))
    return save_report(report, args.json_out)
