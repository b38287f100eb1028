"""Benchmark tools, `zhuzi bench offline | decode | sweep | structured | serve | polling | scaling | accuracy | tools |
kv | models`:
each times the whole request path and starts its report with the machine line (docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import platform

TOOLS = {
    "offline": "throughput of many requests through LLM.generate, against transformers",
    "decode": "single-stream prefill and decode speed, and the share of the bandwidth roofline",
    "sweep": "decode beside llama.cpp on many files and named stand-ins, one table with the ratio of each round",
    "structured": "the cost of structured output: a batch's decode step constrained vs free",
    "serve": "load-test an OpenAI-compatible server (TTFT, TPOT, ITL, end-to-end latency)",
    "polling": "what the inspector's polling costs: serve's load quiet vs polled, alternating on one server",
    "scaling": "zhuzi serve's process layouts (engine process, data and tensor parallel) under one load",
    "accuracy": "greedy agreement, logprob differences and perplexity of each quantization against bf16",
    "tools": "tool calling scored by the Berkeley Function Calling Leaderboard, beside llama-server",
    "kv": "prefill/decode replicas against colocated ones under long prompts, and TTFT after a restart (disk tier)",
    "models": "many models behind one server: cold and warm first tokens and models at once, beside llama-server",
}


def register(subparsers) -> None:
    """Add `bench offline | ... | models` (TOOLS) to the zhuzi command line."""
    bench = subparsers.add_parser("bench", help="run a benchmark", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    tools = bench.add_subparsers(dest="bench_tool", required=True, metavar="{" + ",".join(TOOLS) + "}")
    for name, summary in TOOLS.items():
        # Each tool module imports its heavy dependencies (torch, transformers) only when it runs.
        module = importlib.import_module(f"zhuzi.bench.{name}")
        parser = tools.add_parser(name, help=summary, description=module.__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(parser)
        parser.set_defaults(func=module.run)


def load_llm(args: argparse.Namespace):
    """An LLM built from the engine flags (EngineConfig.add_cli_args)."""
    from zhuzi import LLM
    from zhuzi.config import EngineConfig

    return LLM(**vars(EngineConfig.from_cli_args(args)))


def model_label(model: str | None) -> str:
    """The model as a report names it: its file or folder name, never this machine's path."""
    return os.path.basename(os.path.normpath(model)) if model else "SmolLM2-135M-Instruct (embedded GGUF)"


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compare", choices=["llama.cpp"], default=None,
                        help="also run this peer on the same GGUF with the same threads, and print the ratio")
    parser.add_argument("--llama-cpp-bin", default=None,
                        help="folder of llama.cpp's llama-bench / llama-batched-bench (default: $LLAMA_CPP_BIN, "
                             "else where ../shared/tools/build-llamacpp.sh builds them, else the PATH)")


def save_report(report, path: str | None):
    """Write a tool's report as JSON where --json-out asks; the report, for the caller to return."""
    if path:
        with open(path, "w") as f:
            json.dump(report.to_dict(), f, indent=2)
    return report


def load_average() -> float:
    """The 1-minute load average: on a shared machine, every figure needs it beside it."""
    return os.getloadavg()[0]


def machine_line(kernels: str | None = None) -> str:
    """CPU model, family and flags of note, cores, torch version, and the CPU kernel variant zhuzi ran (when
    known): the context every figure needs."""
    from zhuzi.model.native import cpu_info

    info = cpu_info()
    family = f" (family {info['cpu family']}, model {info['model']})" if "cpu family" in info else ""
    flags = set(info.get("flags", "").split())
    noted = [f for f in ("avx512_bf16", "avx512_vnni", "amx_tile") if f in flags]
    absent = ", no AMX" if flags and "amx_tile" not in flags else ""
    return (f"{info.get('model name') or platform.processor() or platform.machine()}{family}, {os.cpu_count()} cores, "
            f"{' '.join(noted) or 'no AVX512-BF16/VNNI'}{absent}, torch {importlib.metadata.version('torch')}"
            + (f", {kernels} kernels" if kernels else ""))


def served_kernels(base_url: str, headers: dict[str, str] | None = None) -> str | None:
    """The CPU kernel variant of the zhuzi server at base_url (its /inspect/engine), or None for another server."""
    import httpx

    try:
        answer = httpx.get(f"{base_url.rstrip('/').removesuffix('/v1')}/inspect/engine?steps=0", headers=headers,
                           timeout=30)
        return answer.json()["model"]["cpu_kernels"]["variant"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
