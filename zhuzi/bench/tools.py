"""`zhuzi bench tools`: tool calling, scored by the Berkeley Function Calling Leaderboard (bfcl-eval), with
llama-server --jinja on the same GGUF in the same run.

BFCL's non-live single-turn categories (simple = simple_python, multiple, parallel, parallel_multiple,
irrelevance) go through the OpenAI chat API the way BFCL's OpenAI function-calling handler sends them: the
functions as `tools` ('.' in a name becomes '_', Gorilla's types become JSON Schema's), and the reply's
`tool_calls` scored by bfcl-eval's own AST checker (irrelevance: right when no call comes back). Every server
gets the same requests, greedy. --limit takes the same evenly spread cases of each category on every server.

Each failure is sorted into a server error (an HTTP error, a call whose arguments are not a JSON object, or a
call left in `content` as text: the server failed to parse what the model wrote) or a model error (a well-formed
answer the checker rejects). --json-out keeps every failure, to read.

bfcl-eval pins old versions of what zhuzi runs on (numpy 1.26) and pulls every vendor's SDK; only its data and
checker are used here, so it is installed without its dependencies (`pip install --no-deps bfcl-eval`; make
install does).
"""
from __future__ import annotations

import argparse
import copy
import importlib.metadata
import importlib.resources
import json
import logging
import re
import sys
import types
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from zhuzi.bench import machine_line, model_label, save_report
from zhuzi.bench.launch import free_port, serving, zhuzi_serve
from zhuzi.bench.llamacpp import find_tool, shown

CATEGORIES = {"simple": "simple_python", "multiple": "multiple", "parallel": "parallel",
              "parallel_multiple": "parallel_multiple", "irrelevance": "irrelevance"}
MODEL_NAME = "zhuzi-bench-FC"  # the name bfcl's checker is told; its one flag: names had '.' turned into '_'
MAX_TOKENS = 512
# Call syntax of the formats zhuzi parses: seen in `content`, the server left a call the model wrote as text.
CALL_MARKERS = ("<tool_call>", "</tool_call>", "<function=", "[TOOL_CALLS]", "<|python_tag|>",
                "<|tool_call_start|>", "<|channel|>commentary")
FENCED_JSON = re.compile(r"^\s*(?:```(?:json)?\s*)?(\{.*\}|\[.*\])\s*(?:```)?\s*$", re.S)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="the GGUF file both servers load")
    parser.add_argument("--categories", default=",".join(CATEGORIES),
                        help="comma-separated, of " + ", ".join(CATEGORIES) + " (default: all)")
    parser.add_argument("--limit", type=int, default=0,
                        help="cases per category, evenly spread over it (default 0: every case)")
    parser.add_argument("--threads", type=int, default=2, help="threads of each server (default %(default)s)")
    parser.add_argument("--concurrency", type=int, default=4,
                        help="requests in flight, and llama-server's slots (default %(default)s)")
    parser.add_argument("--serve-args", default="", help="more flags for zhuzi serve, as one string")
    parser.add_argument("--compare", choices=["llama.cpp"], default=None,
                        help="also run llama-server --jinja on the same GGUF, with the same threads and slots")
    parser.add_argument("--llama-cpp-bin", default=None,
                        help="folder of llama.cpp's llama-server (default: $LLAMA_CPP_BIN, else where "
                             "../shared/tools/build-llamacpp.sh builds it, else the PATH)")
    parser.add_argument("--json-out", default=None, help="also write the report, every failure included, here")


@dataclass
class Case:
    id: str
    category: str  # CATEGORIES' key
    messages: list[dict]
    functions: list[dict]  # as BFCL writes them: the checker's reference
    answer: list[dict] | None  # bfcl's possible answers; None for irrelevance


@dataclass
class Failure:
    id: str
    kind: str  # "server" or "model"
    why: str
    reply: Any  # the calls, or the text, that came back


@dataclass
class CategoryScore:
    category: str
    cases: int
    correct: int
    failures: list[Failure] = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        return self.correct / self.cases if self.cases else float("nan")

    def errors(self, kind: str) -> int:
        return sum(f.kind == kind for f in self.failures)


@dataclass
class ServerScore:
    server: str
    command: str
    categories: list[CategoryScore]


@dataclass
class ToolsReport:
    machine: str
    model: str
    limit: int
    servers: list[ServerScore]

    def to_dict(self) -> dict:
        return asdict(self) | {"accuracy": {s.server: {c.category: c.accuracy for c in s.categories}
                                            for s in self.servers}}


def bfcl():
    """bfcl-eval's checker module and data folder. Its checker reads one flag (underscore_to_dot) from a model table
    whose import loads every vendor's SDK: it is given a table of its own, which says names had '.' turned into
    '_', as they were here."""
    try:
        data = importlib.resources.files("bfcl_eval") / "data"
    except ModuleNotFoundError:
        raise SystemExit("zhuzi bench tools needs bfcl-eval: pip install --no-deps bfcl-eval") from None
    table = types.ModuleType("bfcl_eval.constants.model_config")
    table.MODEL_CONFIG_MAPPING = {MODEL_NAME: types.SimpleNamespace(underscore_to_dot=True)}
    sys.modules.setdefault("bfcl_eval.constants.model_config", table)
    from bfcl_eval.eval_checker.ast_eval import ast_checker

    return ast_checker, Path(str(data))


def spread(rows: list, limit: int) -> list:
    """limit rows evenly spread over rows (all of them when limit is 0 or more than there are)."""
    if not limit or limit >= len(rows):
        return rows
    return [rows[i * len(rows) // limit] for i in range(limit)]


def load_cases(data: Path, category: str, limit: int) -> list[Case]:
    name = CATEGORIES[category]
    rows = [json.loads(line) for line in (data / f"BFCL_v4_{name}.json").read_text().splitlines() if line]
    answers = {}
    if category != "irrelevance":
        answers = {a["id"]: a["ground_truth"] for a in map(json.loads, (
            data / "possible_answer" / f"BFCL_v4_{name}.json").read_text().splitlines())}
    return [Case(r["id"], category, r["question"][0], r["function"], answers.get(r["id"]))
            for r in spread(rows, limit)]


def json_schema(properties: dict, types_: dict[str, str]) -> dict:
    """Gorilla's parameter types as JSON Schema's ("dict" -> "object", "float" -> "number", ...), nested."""
    for value in properties.values():
        value["type"] = types_.get(value.get("type", "string"), "string")
        if "properties" in value:
            json_schema(value["properties"], types_)
        items = value.get("items")
        if isinstance(items, dict) and "type" in items:
            json_schema({"items": items}, types_)
    return properties


def openai_tools(functions: list[dict]) -> list[dict]:
    from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI

    tools = []
    for function in copy.deepcopy(functions):
        function["name"] = function["name"].replace(".", "_")
        function["parameters"]["type"] = "object"
        json_schema(function["parameters"].get("properties", {}), GORILLA_TO_OPENAPI)
        tools.append({"type": "function", "function": function})
    return tools


def leaked_call(content: str) -> bool:
    """Whether text holds a tool call the server should have parsed: a format's call syntax, or nothing but a JSON
    call object (fenced or bare) with a name and arguments, as Hermes-style models write one."""
    if any(marker in content for marker in CALL_MARKERS):
        return True
    whole = FENCED_JSON.match(content)
    if not whole:
        return False
    try:
        value = json.loads(whole.group(1))
    except ValueError:
        return False
    calls = value if isinstance(value, list) else [value]
    return bool(calls) and all(isinstance(c, dict) and "name" in c and ("arguments" in c or "parameters" in c)
                               for c in calls)


def ask(client, url: str, model: str, case: Case) -> tuple[int, dict | str]:
    """(HTTP status, the answer's message or the error text)."""
    body = {"model": model, "messages": case.messages, "tools": openai_tools(case.functions),
            "temperature": 0, "max_tokens": MAX_TOKENS}
    try:
        answer = client.post(url + "/v1/chat/completions", json=body, timeout=900)
    except Exception as e:  # noqa: BLE001 - a dropped connection is the server's failure, scored as such
        return 0, f"{type(e).__name__}: {e}"
    if answer.status_code != 200:
        return answer.status_code, answer.text[:500]
    return 200, answer.json()["choices"][0]["message"]


def score(checker, case: Case, status: int, reply: dict | str) -> Failure | None:
    """None when the reply is right, else why not."""
    if status != 200:
        return Failure(case.id, "server", f"HTTP {status}", reply)
    calls, content = reply.get("tool_calls") or [], reply.get("content") or ""
    decoded = []
    for call in calls:
        try:
            arguments = json.loads(call["function"]["arguments"])
        except (ValueError, TypeError):
            return Failure(case.id, "server", "arguments are not JSON", calls)
        if not isinstance(arguments, dict):
            return Failure(case.id, "server", "arguments are not an object", calls)
        decoded.append({call["function"]["name"]: arguments})
    if not calls and leaked_call(content):
        return Failure(case.id, "server", "a call left in content", content)
    if case.category == "irrelevance":
        return Failure(case.id, "model", "called a function", decoded) if decoded else None
    if not decoded:
        return Failure(case.id, "model", "answered without a call", content)
    from bfcl_eval.constants.enums import Language

    verdict = checker.ast_checker(case.functions, decoded, case.answer, Language.PYTHON, CATEGORIES[case.category],
                                  MODEL_NAME)
    return None if verdict["valid"] else Failure(case.id, "model", "; ".join(map(str, verdict["error"])), decoded)


def run_server(name: str, command: str, url: str, cases: dict[str, list[Case]], checker,
               concurrency: int) -> ServerScore:
    import httpx

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    scores = []
    with httpx.Client() as client, ThreadPoolExecutor(concurrency) as pool:
        model = client.get(url + "/v1/models").json()["data"][0]["id"]
        for category, rows in cases.items():
            answers = list(pool.map(lambda case: ask(client, url, model, case), rows))
            failures = [f for case, (status, reply) in zip(rows, answers)
                        if (f := score(checker, case, status, reply)) is not None]
            scores.append(CategoryScore(category, len(rows), len(rows) - len(failures), failures))
            print(f"{name} {category}: {scores[-1].correct}/{len(rows)}, server errors "
                  f"{scores[-1].errors('server')}", flush=True)
    return ServerScore(name, command, scores)


def llama_server_command(args: argparse.Namespace, port: int) -> list[str]:
    return [str(find_tool("llama-server", args.llama_cpp_bin)), "-m", args.model, "--jinja", "-t", str(args.threads),
            "-np", str(args.concurrency), "-c", str(8192 * args.concurrency), "--port", str(port)]


def format_table(report: ToolsReport) -> str:
    categories = [c.category for c in report.servers[0].categories]
    lines = ["| server | " + " | ".join(categories) + " | server errors |",
             "|---|" + "---|" * (len(categories) + 1)]
    for s in report.servers:
        cells = [f"{c.accuracy:.1%} ({c.correct}/{c.cases})" for c in s.categories]
        lines.append(f"| {s.server} | " + " | ".join(cells) + f" | {sum(c.errors('server') for c in s.categories)} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> ToolsReport:
    from zhuzi.model import native

    checker, data = bfcl()
    names = [c.strip() for c in args.categories.split(",") if c.strip()]
    if unknown := [c for c in names if c not in CATEGORIES]:
        raise SystemExit(f"zhuzi bench tools: unknown category {unknown[0]!r}; choose from {', '.join(CATEGORIES)}")
    cases = {c: load_cases(data, c, args.limit) for c in names}
    machine = machine_line(native.resolve(native.default_choice()))
    print(f"machine: {machine}")
    print(f"model:   {model_label(args.model)}; bfcl-eval {importlib.metadata.version('bfcl-eval')}, "
          f"{sum(map(len, cases.values()))} cases, greedy, max_tokens {MAX_TOKENS}")
    flags = [args.model, "--num-threads", str(args.threads), *args.serve_args.split()]
    servers = []
    with zhuzi_serve(flags) as url:
        servers.append(run_server("zhuzi", shown(["zhuzi", "serve", *flags]), url, cases, checker,
                                  args.concurrency))
    if args.compare:
        port = free_port()
        command = llama_server_command(args, port)
        with serving(command, port) as url:
            servers.append(run_server("llama-server", shown(command), url, cases,
                                      checker, args.concurrency))
    report = ToolsReport(machine, model_label(args.model), args.limit, servers)
    print(format_table(report))
    for server in servers:
        kinds = Counter(f"{f.kind}: {f.why}" for c in server.categories for f in c.failures)
        print(f"{server.server} failures: " + "; ".join(f"{n} x {why}" for why, n in kinds.most_common(8)))
    return save_report(report, args.json_out)
