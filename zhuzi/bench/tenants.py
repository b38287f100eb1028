"""`zhuzi bench serve --tenants`: several API keys on one server at once, each with a load of its own (a SPEC
of FIELDS, see --help), and what each measured key's requests see beside the others against alone: each
measured tenant runs alone on the idle server first, then all together; background tenants (no requests=N)
keep their streams busy until the measured ones are done.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import time
from dataclasses import asdict, dataclass, field

from zhuzi.bench import load_average, machine_line, save_report
from zhuzi.bench.client import ENDPOINT_PATHS, RequestResult, Stat, Target, discover_model, run_conversation
from zhuzi.bench.datasets import Conversation, load_tokenizer, random_text_conversations

FIELDS = {"key": str, "name": str, "streams": int, "requests": int, "turns": int, "priority": int,
          "delay": float, "input": int, "output": int}


@dataclass
class TenantSpec:
    name: str
    key: str | None
    streams: int = 1
    requests: int | None = None  # None: background load
    turns: int = 1
    priority: int | None = None
    delay: float = 0.0
    input: int = 256
    output: int = 128

    @classmethod
    def parse(cls, text: str, index: int, args: argparse.Namespace) -> TenantSpec:
        values: dict = {"name": f"t{index + 1}", "key": args.api_key, "input": args.random_input_len,
                        "output": args.random_output_len}
        for item in text.split(","):
            name, sep, value = item.partition("=")
            if not sep or name not in FIELDS:
                raise SystemExit(f"--tenants {text!r}: {item!r} is not one of {', '.join(f + '=' for f in FIELDS)}")
            try:
                values[name] = FIELDS[name](value)
            except ValueError:
                kind = {int: "an integer", float: "a number"}[FIELDS[name]]
                raise SystemExit(f"--tenants {text!r}: {name} takes {kind}, got {value!r}") from None
        spec = cls(**values)
        if min(spec.streams, spec.turns, spec.input, spec.output, spec.requests or 1) < 1 or spec.delay < 0:
            raise SystemExit(f"--tenants {text!r}: counts must be at least 1 and delay at least 0")
        return spec

    @property
    def measured(self) -> bool:
        return self.requests is not None


@dataclass
class TenantResult:
    """One measured tenant in one phase (milliseconds)."""

    tenant: str
    phase: str  # alone | together
    completed: int
    failed: int
    ttft_ms: Stat
    tpot_ms: Stat
    errors: list[str]
    load: float  # the 1-minute load average as the phase started: the noise it ran in


@dataclass
class TenantsReport:
    machine: str
    base_url: str
    model: str
    tenants: list[TenantSpec]
    results: list[TenantResult] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


class Quiet:
    """The progress bar run_conversation updates: none here, the phases are short."""

    def update(self, n: int) -> None:
        pass


def workload(tokenizer, spec: TenantSpec, seed: int) -> list[Conversation]:
    """Its conversations: enough for its requests (measured) or for a long while (background)."""
    count = math.ceil(spec.requests / spec.turns) if spec.measured else 64 * spec.streams
    singles = random_text_conversations(tokenizer, count * spec.turns, spec.input, spec.output, 0.0, seed)
    chats = [Conversation([c.turns[0] for c in singles[i:i + spec.turns]]) for i in range(0, len(singles), spec.turns)]
    if spec.measured:
        extra = count * spec.turns - spec.requests
        chats[-1].turns = chats[-1].turns[:spec.turns - extra]
    return chats


async def run_tenant(client, spec: TenantSpec, target: Target, chats: list[Conversation],
                     tokenizer, start: float) -> list[RequestResult]:
    """Its conversations, spec.streams at a time (each stream takes the next one); a background tenant goes
    round them until cancelled."""
    pending = iter(enumerate(chats)) if spec.measured else itertools.cycle(enumerate(chats))
    results: list[RequestResult] = []

    async def stream() -> None:
        for index, chat in pending:
            results.extend(await run_conversation(client, target, index, chat, start,
                                                              asyncio.Semaphore(1), tokenizer, Quiet()))

    await asyncio.gather(*(stream() for _ in range(spec.streams)))
    return results


async def phase(client, specs: list[TenantSpec], targets: dict[str, Target],
                chats: dict[str, list[Conversation]], tokenizer) -> dict[str, list[RequestResult]]:
    """Run the tenants at once until every measured one is done; background load is then hung up. A
    tenant's delay counts only beside others."""
    start = time.perf_counter()
    tasks = {s.name: asyncio.create_task(run_tenant(client, s, targets[s.name], chats[s.name], tokenizer,
                                                    start + (s.delay if len(specs) > 1 else 0.0)))
             for s in specs}
    measured = [tasks[s.name] for s in specs if s.measured]
    results = dict(zip([s.name for s in specs if s.measured], await asyncio.gather(*measured)))
    for task in tasks.values():
        task.cancel()
    await asyncio.gather(*tasks.values(), return_exceptions=True)
    return results


def summarize(name: str, phase_name: str, results: list[RequestResult], load: float) -> TenantResult:
    ok = [r for r in results if r.success]
    return TenantResult(name, phase_name, len(ok), len(results) - len(ok), Stat.of([r.ttft for r in ok]),
                        Stat.of([r.tpot for r in ok if r.tpot is not None]),
                        list(dict.fromkeys(r.error for r in results if r.error))[:3], load)


async def benchmark(args: argparse.Namespace) -> TenantsReport:
    import httpx

    specs = [TenantSpec.parse(text, i, args) for i, text in enumerate(args.tenants)]
    if len({s.name for s in specs}) < len(specs) or not any(s.measured for s in specs):
        raise SystemExit("--tenants: names must differ, and at least one tenant needs requests=N to be measured")
    tokenizer = load_tokenizer(args.tokenizer)
    base_url = args.base_url.rstrip("/").removesuffix("/v1")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as client:
        first_key = {"Authorization": f"Bearer {specs[0].key}"} if specs[0].key else {}
        model = args.model or await discover_model(client, base_url, first_key)
        targets, chats = {}, {}
        for i, spec in enumerate(specs):
            options = {"temperature": args.temperature} | ({"ignore_eos": True} if args.ignore_eos else {})
            options |= {"priority": spec.priority} if spec.priority is not None else {}
            headers = {"Authorization": f"Bearer {spec.key}"} if spec.key else {}
            targets[spec.name] = Target(base_url + ENDPOINT_PATHS[args.endpoint],
                                                    args.endpoint, model, headers, options, render_template=False)
            chats[spec.name] = workload(tokenizer, spec, args.seed + i)
        report = TenantsReport(machine_line(), base_url, model, specs)
        for spec in (s for s in specs if s.measured):
            load = load_average()
            alone = await phase(client, [spec], targets, chats, tokenizer)
            report.results.append(summarize(spec.name, "alone", alone[spec.name], load))
        load = load_average()
        together = await phase(client, specs, targets, chats, tokenizer)
        report.results += [summarize(name, "together", results, load) for name, results in together.items()]
    return report


def format_report(report: TenantsReport) -> str:
    lines = [report.machine, f"{report.base_url} (model {report.model})",
             "tenants: " + "; ".join(
                 f"{s.name}: {s.streams} stream(s), " + (f"{s.requests} requests" if s.measured else "background")
                 + (f", {s.turns} turns a chat" if s.turns > 1 else "") + f", {s.input} in / {s.output} out"
                 + (f", priority {s.priority}" if s.priority is not None else "")
                 + (f", from {s.delay:g} s" if s.delay else "") for s in report.tenants),
             f"{'tenant':<12} {'phase':<10} {'ok':>4} {'failed':>6} {'TTFT p50 ms':>12} {'TPOT p50 ms':>12} "
             f"{'load':>6}"]
    by = {(r.tenant, r.phase): r for r in report.results}
    for spec in (s for s in report.tenants if s.measured):
        alone, together = by[(spec.name, "alone")], by[(spec.name, "together")]
        for r in (alone, together):
            lines.append(f"{r.tenant:<12} {r.phase:<10} {r.completed:>4} {r.failed:>6} {r.ttft_ms.median:>12.1f} "
                         f"{r.tpot_ms.median:>12.1f} {r.load:>6.1f}")

        def ratio(a: float, b: float) -> str:
            return f"{b / a:.2f}x" if a else "-"

        ttft, tpot = ratio(alone.ttft_ms.median, together.ttft_ms.median), ratio(alone.tpot_ms.median,
                                                                                 together.tpot_ms.median)
        lines.append(f"{spec.name:<12} {'together/alone':<22} {ttft:>12} {tpot:>12}")
        lines += [f"error ({r.phase}): {e}" for r in (alone, together) for e in r.errors]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> TenantsReport:
    report = asyncio.run(benchmark(args))
    print(format_report(report))
    return save_report(report, args.json_out)
