"""`zhuzi bench models`: many models behind one server, `zhuzi serve --models-dir D` beside llama-server's router
(`llama-server --models-dir D`) on the same files with the same threads, in the same run.

Each server first loads each model once, untimed (the first read of a file from disk and one-time costs are in no
figure). Then each round the servers take turns, the order swapped every round; in its turn a server answers each
model's first prompt cold (the time to first token counts the load) and a second prompt warm, then `bench serve`'s
load with the models taking the requests in turn (the throughput of the models served at once). The warm-up and
every turn end with the models unloaded through the server's own POST /models/unload, so each turn starts cold
and runs alone. Reported: every turn's figures and each round's zhuzi / llama-server ratios.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import shlex
import statistics
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field

from zhuzi.bench import load_average, machine_line, save_report
from zhuzi.bench import serve as serve_bench
from zhuzi.bench.client import ENDPOINT_PATHS, RequestResult, Target, send_request
from zhuzi.bench.datasets import load_tokenizer, random_text_conversations
from zhuzi.bench.launch import free_port, serving, zhuzi_serve
from zhuzi.bench.llamacpp import find_tool, shown

PROBE_TOKENS = 4  # a probe's reply: its first token is what is timed
UNLOAD_TIMEOUT_S = 60.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models-dir", required=True, help="the folder of GGUF files both servers serve")
    parser.add_argument("--models", default=None,
                        help="comma-separated model ids (file stems) to time (default: every model zhuzi lists)")
    parser.add_argument("--rounds", type=int, default=3, help="turns of each server (default %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="threads of each server (default %(default)s)")
    parser.add_argument("--probe-len", type=int, default=128,
                        help="prompt tokens of the cold and warm first requests (default %(default)s)")
    parser.add_argument("--num-prompts", type=int, default=16,
                        help="requests of the load with the models at once (default %(default)s)")
    parser.add_argument("--max-concurrency", type=int, default=4, help="(default %(default)s)")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens of the load (default %(default)s)")
    parser.add_argument("--output-len", type=int, default=64, help="output tokens of the load (default %(default)s)")
    parser.add_argument("--settle", type=float, default=2.0,
                        help="seconds to wait once a server lists its models unloaded, for their processes to "
                             "exit (default %(default)s)")
    parser.add_argument("--serve-args", default="--kv-cache-memory 256MiB",
                        help="more flags for zhuzi serve, as one string (default: %(default)s)")
    parser.add_argument("--compare", choices=["llama.cpp"], default=None,
                        help="also run llama-server --models-dir on the same folder, with the same threads")
    parser.add_argument("--llama-server-args", default="-c 4096",
                        help="more flags for llama-server, as one string (default: %(default)s)")
    parser.add_argument("--llama-cpp-bin", default=None,
                        help="folder of llama.cpp's llama-server (default: $LLAMA_CPP_BIN, else where "
                             "../shared/tools/build-llamacpp.sh builds it, else the PATH)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts (default %(default)s)")
    parser.add_argument("--json-out", default=None, help="also write the report to this JSON file")


@dataclass
class Turn:
    """One server's turn in one round (milliseconds, tokens per second)."""

    server: str
    round: int
    cold_ttft_ms: dict[str, float]  # model -> its first token after an unload, the load included
    warm_ttft_ms: dict[str, float]  # model -> its first token just after
    output_tok_s: float  # the load with the models at once
    tpot_ms: float  # its median TPOT
    failed: int  # its failed requests
    load: float  # the 1-minute load average as the turn started: the noise it ran in


@dataclass
class ModelsReport:
    machine: str
    models: list[str]
    commands: dict[str, str]  # server -> its command line as shown
    workload: str
    turns: list[Turn] = field(default_factory=list)

    def turn(self, server: str, round_: int) -> Turn | None:
        return next((t for t in self.turns if (t.server, t.round) == (server, round_)), None)

    def to_dict(self) -> dict:
        return asdict(self)


def state(entry: dict) -> str:
    """A model's state as a server lists it: zhuzi's `state`, llama-server's `status.value`."""
    return entry.get("state") or (entry.get("status") or {}).get("value") or "loaded"


async def listed(client, url: str) -> dict[str, str]:
    """Model id -> state, from the server's GET /v1/models."""
    response = await client.get(f"{url}/v1/models")
    response.raise_for_status()
    return {entry["id"]: state(entry) for entry in response.json()["data"]}


async def unload_all(client, url: str, models: list[str], settle: float) -> None:
    """Unload every model through the server's POST /models/unload; back once it lists them all unloaded and
    `settle` seconds have passed."""
    states = await listed(client, url)
    for model in models:
        if states[model] != "unloaded":
            (await client.post(f"{url}/models/unload", json={"model": model})).raise_for_status()
    deadline = time.monotonic() + UNLOAD_TIMEOUT_S
    while any(states[m] != "unloaded" for m in models):
        await asyncio.sleep(0.1)
        states = await listed(client, url)
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not unload {', '.join(models)} within {UNLOAD_TIMEOUT_S:.0f} s")
    await asyncio.sleep(settle)


async def first_token_ms(client, url: str, model: str, prompt: str) -> float:
    """The time to first token of one streamed chat request."""
    target = Target(url + ENDPOINT_PATHS["chat"], "chat", model, {}, {"temperature": 0.0}, render_template=False)
    result = RequestResult(0, 0)
    await send_request(client, target, {"model": model, "messages": [{"role": "user", "content": prompt}],
                                        "max_tokens": PROBE_TOKENS, "stream": True, "temperature": 0.0}, result)
    if not result.success:
        raise RuntimeError(f"{url}: model {model} failed its first request: {result.error}")
    return result.ttft * 1e3


def load_args(url: str, models: list[str], args: argparse.Namespace) -> argparse.Namespace:
    """`bench serve`'s flags for the load: every model at once, each request generating --output-len tokens."""
    parser = argparse.ArgumentParser()
    serve_bench.add_arguments(parser)
    return parser.parse_args(["--base-url", url, "--model", ",".join(models), "--num-prompts", str(args.num_prompts),
                              "--max-concurrency", str(args.max_concurrency), "--random-input-len",
                              str(args.input_len), "--random-output-len", str(args.output_len), "--ignore-eos",
                              "--seed", str(args.seed), "--disable-tqdm"])


async def turn(server: str, url: str, round_: int, models: list[str], prompts: dict[tuple[str, str], str],
               args: argparse.Namespace) -> Turn:
    import httpx

    load = load_average()
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        cold, warm = {}, {}
        for model in models:
            cold[model] = await first_token_ms(client, url, model, prompts[model, "cold"])
            warm[model] = await first_token_ms(client, url, model, prompts[model, "warm"])
        report = await serve_bench.benchmark(load_args(url, models, args))
        await unload_all(client, url, models, args.settle)  # the next turn, the other server's, runs alone
    return Turn(server, round_, cold, warm, report.output_throughput, report.tpot_ms.median, report.failed, load)


def probe_prompts(models: list[str], rounds: int, length: int, seed: int) -> list[dict[tuple[str, str], str]]:
    """Each round's prompt of each model, cold and warm: the same for every server, different everywhere else
    (no prefix cache answers a warm probe)."""
    texts = iter(c.turns[0].user for c in random_text_conversations(
        load_tokenizer(None), 2 * len(models) * rounds, length, PROBE_TOKENS, 0.0, seed))
    return [{(model, kind): next(texts) for model in models for kind in ("cold", "warm")} for _ in range(rounds)]


async def warm_up(url: str, models: list[str], settle: float) -> None:
    """One request to each model, untimed; then they are unloaded, so the first turn finds them cold."""
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        for model in models:
            await first_token_ms(client, url, model, "Hello")
        await unload_all(client, url, models, settle)


def ratios(report: ModelsReport, round_: int) -> list[float] | None:
    """zhuzi / llama-server in the round: each model's cold TTFT, each one's warm TTFT, the throughput; None
    without llama-server."""
    ours, theirs = report.turn("zhuzi", round_), report.turn("llama-server", round_)
    if ours is None or theirs is None:
        return None
    return [ours.cold_ttft_ms[m] / theirs.cold_ttft_ms[m] for m in report.models] + \
        [ours.warm_ttft_ms[m] / theirs.warm_ttft_ms[m] for m in report.models] + \
        [ours.output_tok_s / theirs.output_tok_s]


def format_report(report: ModelsReport, rounds: int) -> str:
    names = {model: f"m{i + 1}" for i, model in enumerate(report.models)}
    header = ["round", "server"] + [f"cold TTFT ms {n}" for n in names.values()] + \
        [f"warm TTFT ms {n}" for n in names.values()] + ["tok/s at once", "TPOT ms", "failed", "load"]
    lines = [f"machine:  {report.machine}", *(f"{n}:       {model}" for model, n in names.items()),
             *(f"{server}: {command}" for server, command in report.commands.items()),
             f"workload: {report.workload}", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    by_round = []
    for round_ in range(rounds):
        for t in (t for t in report.turns if t.round == round_):
            cells = [f"{t.cold_ttft_ms[m]:.0f}" for m in report.models] + \
                [f"{t.warm_ttft_ms[m]:.0f}" for m in report.models]
            lines.append(f"| {round_} | {t.server} | " + " | ".join(cells) +
                         f" | {t.output_tok_s:.1f} | {t.tpot_ms:.1f} | {t.failed} | {t.load:.1f} |")
        if (row := ratios(report, round_)) is not None:
            by_round.append(row)
            lines.append(f"| {round_} | zhuzi / llama-server | " + " | ".join(f"{x:.2f}x" for x in row) + " | | | |")
    if by_round:
        medians = [statistics.median(column) for column in zip(*by_round)]
        lines += ["", "median of the rounds' zhuzi / llama-server (TTFT: below 1 zhuzi is faster; tok/s: above 1): "
                  + ", ".join(f"{h} {m:.2f}x" for h, m in zip(header[2:], medians))]
    return "\n".join(lines)


def llama_server_command(args: argparse.Namespace, models: int) -> list[str]:
    """llama-server's router on the folder, room for every model timed; without its port."""
    return [str(find_tool("llama-server", args.llama_cpp_bin)), "--models-dir", args.models_dir,
            "--models-max", str(models), "-t", str(args.threads), *shlex.split(args.llama_server_args)]


async def chosen_models(url: str, wanted: str | None) -> list[str]:
    """The --models ids (default: all), each one zhuzi lists."""
    import httpx

    async with httpx.AsyncClient() as client:
        there = list(await listed(client, url))
    models = wanted.split(",") if wanted else there
    if missing := [m for m in models if m not in there]:
        raise SystemExit(f"--models: {', '.join(missing)} not in the folder; its models: {', '.join(there)}")
    return models


def run(args: argparse.Namespace) -> ModelsReport:
    from zhuzi.model import native

    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.compare:
        find_tool("llama-server", args.llama_cpp_bin)  # missing: said before anything starts
    flags = ["--models-dir", args.models_dir, "--num-threads", str(args.threads), *shlex.split(args.serve_args)]
    with ExitStack() as servers:
        urls = {"zhuzi": servers.enter_context(zhuzi_serve(flags))}
        models = asyncio.run(chosen_models(urls["zhuzi"], args.models))
        commands = {"zhuzi": shown(["zhuzi", "serve", *flags])}
        if args.compare:
            port = free_port()
            command = llama_server_command(args, len(models))
            urls["llama-server"] = servers.enter_context(serving(command + ["--port", str(port)], port))
            commands["llama-server"] = shown(command)
        report = ModelsReport(machine_line(native.resolve(native.default_choice())), models, commands,
                              f"probes {args.probe_len} tokens in, first token timed; at once: {args.num_prompts} "
                              f"requests, {args.max_concurrency} streams, {args.input_len} in / {args.output_len} "
                              f"out, the models in turn")
        prompts = probe_prompts(models, args.rounds, args.probe_len, args.seed)
        for url in urls.values():
            asyncio.run(warm_up(url, models, args.settle))
        order = list(urls)
        for round_ in range(args.rounds):
            for server in order if round_ % 2 == 0 else order[::-1]:
                report.turns.append(asyncio.run(turn(server, urls[server], round_, models, prompts[round_], args)))
                t = report.turns[-1]
                print(f"round {round_} {server}: cold TTFT " + ", ".join(f"{t.cold_ttft_ms[m]:.0f}" for m in models)
                      + f" ms; {t.output_tok_s:.1f} tok/s at once", flush=True)
    print(format_report(report, args.rounds))
    return save_report(report, args.json_out)
