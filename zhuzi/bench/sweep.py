"""`zhuzi bench sweep`: `zhuzi bench decode --compare llama.cpp` on every file given and every stand-in named
(standins.py; made once from --standin-source into zhuzi's cache), one table of them all: decode and prefill
beside llama-bench with the ratio of each round (the engines take turns: zhuzi, llama-bench, zhuzi, ...), zhuzi's
peak resident memory, and what the model's load and runs added to it against the file's size. Each file runs in
a process of its own, so its memory is its own and no file's pages stay behind for the next.
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from zhuzi.bench import load_average
from zhuzi.bench.standins import SHAPES, synthesize


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="*", help="GGUF files to run")
    parser.add_argument("--standins", default="",
                        help=f"stand-ins to run too, comma-separated, or 'all': {', '.join(SHAPES)}")
    parser.add_argument("--standin-source", type=Path, default=None,
                        help="a Q4_K_M GGUF (Q4_K and Q6_K blocks, a BPE tokenizer) the stand-ins are made of")
    parser.add_argument("--num-threads", type=int, default=2, help="threads of both engines (default %(default)s)")
    parser.add_argument("--prompt-len", type=int, default=512, help="prompt tokens (default %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens to generate (default %(default)s)")
    parser.add_argument("--runs", type=int, default=3, help="rounds a file (default %(default)s)")
    parser.add_argument("--llama-cpp-bin", default=None, help="folder of llama.cpp's llama-bench")
    parser.add_argument("--decode-args", default="",
                        help="more flags for each `zhuzi bench decode`, e.g. \"--cpu-kernels avx2\"")
    parser.add_argument("--json-out", default=None, help="also write every file's decode report to this JSON file")


@dataclass
class SweepRow:
    """One file's decode report (decode.py's JSON) and the file's size."""

    report: dict
    file_bytes: int

    def cells(self) -> list[str]:
        r, peer = self.report, self.report["llama_cpp"]["rounds"]
        prefill_ratio, decode_ratio = r["ratios"]
        return [r["model"], f"{self.file_bytes / 2**20:,.0f}",
                f"{r['decode_tokens_per_s']:.1f}", f"{max(tg['tokens_per_s'] for _, tg in peer):.1f}",
                f"{decode_ratio:.2f}x", _ratios(r["decode_ratios_by_round"]),
                f"{r['prefill_tokens_per_s']:.1f}", f"{max(pp['tokens_per_s'] for pp, _ in peer):.1f}",
                f"{prefill_ratio:.2f}x", _ratios(r["prefill_ratios_by_round"]),
                f"{r['peak_rss_bytes'] / 2**20:,.0f}", f"{r['loaded_rss_bytes'] / self.file_bytes:.2f}x"]


def _ratios(by_round: list[float]) -> str:
    return " ".join(f"{x:.2f}" for x in by_round)


HEADER = ["model", "file MiB", "decode tok/s", "tg", "ratio", "by round", "prefill tok/s", "pp", "ratio", "by round",
          "peak RSS MiB", "loaded RSS / file"]


def format_table(rows: list[SweepRow]) -> str:
    """The sweep as docs/benchmarks.md keeps it: the machine, llama.cpp's build, and a row a file."""
    first = rows[0].report
    peer = first["llama_cpp"]["rounds"][0][1]
    lines = [f"machine:   {first['machine']}",
             f"llama.cpp: build {peer['build']}, {first['threads']} threads; each file {first['prompt_tokens']}-token "
             f"prompts, {first['output_tokens']} new tokens, {len(first['decode_rounds'])} rounds in turns",
             "", "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row.cells()) + " |" for row in rows]
    return "\n".join(lines)


def standin_file(name: str, source: Path | None) -> Path:
    """The named stand-in, made once into zhuzi's cache (keyed by its source)."""
    from zhuzi.disk_cache import atomic_write, cache_path, file_identity, one_maker

    if source is None:
        raise SystemExit("--standins needs --standin-source: a Q4_K_M GGUF, e.g. `make test-models`' "
                         "Qwen2.5-Coder-1.5B (python -m tests.real_models prints where it is)")
    path = cache_path("standins", name, SHAPES[name], *file_identity(source), suffix=".gguf")
    with one_maker(path):
        if not path.is_file():
            with atomic_write(path) as tmp:
                synthesize(SHAPES[name], source, tmp)
    return path


def decode_report(model: Path, args: argparse.Namespace) -> dict | None:
    """`zhuzi bench decode --compare llama.cpp` on the file, in a process of its own; None where it failed (its
    error above)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "decode.json"
        command = [sys.executable, "-m", "zhuzi.cli", "bench", "decode", "--model", str(model),
                   "--num-threads", str(args.num_threads), "--prompt-len", str(args.prompt_len),
                   "--max-tokens", str(args.max_tokens), "--runs", str(args.runs), "--compare", "llama.cpp",
                   "--json-out", str(out), *shlex.split(args.decode_args)]
        if args.llama_cpp_bin:
            command += ["--llama-cpp-bin", args.llama_cpp_bin]
        done = subprocess.run(command)
        return json.loads(out.read_text()) if done.returncode == 0 else None


def run(args: argparse.Namespace) -> list[SweepRow]:
    names = list(SHAPES) if args.standins == "all" else [n for n in args.standins.split(",") if n]
    unknown = set(names) - set(SHAPES)
    if unknown:
        raise SystemExit(f"no stand-in named {', '.join(sorted(unknown))}; the stand-ins: {', '.join(SHAPES)}")
    files = [(Path(f).name, Path(f)) for f in args.files] + \
        [(f"{name} (stand-in)", standin_file(name, args.standin_source)) for name in names]
    if not files:
        raise SystemExit("give GGUF files, --standins, or both")
    load_at_start = load_average()
    reports = [(label, path, decode_report(path, args)) for label, path in files]
    rows = [SweepRow(report | {"model": label}, path.stat().st_size) for label, path, report in reports if report]
    print("=============== zhuzi bench sweep ===============")
    if rows:
        print(format_table(rows))
    failed = [label for label, _, report in reports if report is None]
    if failed:
        print(f"failed:    {', '.join(failed)} (each one's error above)")
    print(f"load:      1-minute load average {load_at_start:.2f} at the start, {load_average():.2f} at the end")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps([row.report for row in rows], indent=2))
    return rows
