"""llama.cpp as the peer of `zhuzi bench decode | offline | accuracy --compare llama.cpp`: llama-bench,
llama-batched-bench and llama-perplexity on the same GGUF with the same threads, in the same run. The binaries
are found in --llama-cpp-bin, $LLAMA_CPP_BIN, $LLAMA_CPP_DIR's build (default ~/.cache/llama.cpp), or the PATH.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)
ENV = "LLAMA_CPP_BIN"
BUILT = "llama_cpp_python-*/vendor/llama.cpp/build/bin"  # under $LLAMA_CPP_DIR, as the build script lays it out
HOW_TO_BUILD = (f"build them with ../shared/tools/build-llamacpp.sh (10-25 minutes on 2 cores; it prints their "
                f"folder), then pass --llama-cpp-bin DIR or set {ENV}=DIR")
# Tools the script does not build: the command that builds one beside the others, in the script's source folder.
EXTRA_TOOLS = {"llama-perplexity": "cmake --build build --target llama-perplexity"}


class LlamaCppError(OSError):
    """llama.cpp is missing, or one of its tools failed; the message (one line) says what to do."""


def _folders(directory: str | None) -> tuple[list[Path], str]:
    """Where to look, and how to say it."""
    if directory:
        return [Path(directory)], f"in {directory}"
    if os.environ.get(ENV):
        return [Path(os.environ[ENV])], f"in ${ENV} ({os.environ[ENV]})"
    home = Path(os.environ.get("LLAMA_CPP_DIR") or Path.home() / ".cache/llama.cpp")
    return sorted(home.glob(BUILT), reverse=True), f"in {home}/{BUILT} or on the PATH"


def find_tool(name: str, directory: str | None = None) -> Path:
    """The path of llama.cpp's tool `name` (llama-bench, llama-batched-bench)."""
    folders, where = _folders(directory)
    for folder in folders:
        if (folder / name).is_file() and os.access(folder / name, os.X_OK):
            return folder / name
    if not directory and not os.environ.get(ENV) and (found := shutil.which(name)):
        return Path(found)
    extra = (f"; the script does not build {name}: then run `{EXTRA_TOOLS[name]}` in the llama.cpp folder it built "
             "(where its build/ is)") if name in EXTRA_TOOLS else ""
    raise LlamaCppError(f"llama.cpp's {name} not found {where}; {HOW_TO_BUILD}{extra}")


def _run(command: list[str], timeout: float, without_repack: tuple[str, ...] = ()) -> tuple[
        subprocess.CompletedProcess, list[str]]:
    """(the finished tool, the command that ran). A tool killed by a signal runs once more with `without_repack`
    (its flag that turns weight repacking off): its AMX repacking dies with SIGILL/SIGSEGV where a hypervisor
    withholds AMX state from a CPU that lists AMX. The report prints the command that ran, so it says so."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise LlamaCppError(f"{Path(command[0]).name} ran past {timeout:.0f} s") from None
    if done.returncode < 0 and without_repack:
        log.warning("%s died of signal %d; running it again without weight repacking",
                    Path(command[0]).name, -done.returncode)
        return _run(command + list(without_repack), timeout)
    if done.returncode != 0:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise LlamaCppError(f"{Path(command[0]).name} failed (exit {done.returncode}): {tail}")
    return done, command


@dataclass
class BenchTest:
    """One llama-bench test: pp<n_prompt> (prompt processing) or tg<n_gen> (generation)."""

    name: str
    n_prompt: int
    n_gen: int
    n_threads: int
    tokens_per_s: float
    stddev: float
    build: str
    model_type: str


def parse_llama_bench(text: str) -> list[BenchTest]:
    """llama-bench -o json output -> its tests."""
    tests = []
    for t in json.loads(text):
        name = f"pp{t['n_prompt']}" if t["n_gen"] == 0 else f"tg{t['n_gen']}" if t["n_prompt"] == 0 \
            else f"pp{t['n_prompt']}+tg{t['n_gen']}"
        if t.get("n_depth"):
            name += f" @ d{t['n_depth']}"
        tests.append(BenchTest(name, t["n_prompt"], t["n_gen"], t["n_threads"], t["avg_ts"], t["stddev_ts"],
                               t["build_commit"], t["model_type"]))
    return tests


def shown(command: list[str]) -> str:
    """A command line as a report prints it: files by their names, not this machine's paths."""
    return " ".join(Path(arg).name if Path(arg).is_absolute() else arg for arg in command)


def llama_bench(tool: Path, gguf: Path, threads: int, prompt: int, gen: int,
                repetitions: int) -> tuple[BenchTest, BenchTest, str]:
    """(pp<prompt>, tg<gen>, the command line as shown) from one llama-bench run."""
    command = [str(tool), "-m", str(gguf), "-t", str(threads), "-p", str(prompt), "-n", str(gen),
               "-r", str(repetitions), "-o", "json"]
    done, command = _run(command, timeout=3600, without_repack=("--repack", "0"))
    tests = {(t.n_prompt, t.n_gen): t for t in parse_llama_bench(done.stdout)}
    return tests[prompt, 0], tests[0, gen], shown(command)


@dataclass
class BatchedRun:
    """One llama-batched-bench line: `pl` sequences of `pp` prompt tokens, each generating `tg` tokens."""

    pp: int
    tg: int
    pl: int
    n_threads: int
    prefill_s: float
    prefill_tokens_per_s: float
    decode_s: float
    decode_tokens_per_s: float
    total_s: float

    @property
    def output_tokens(self) -> int:
        return self.pl * self.tg

    @property
    def output_tokens_per_s(self) -> float:
        """Output tokens over the whole run, prefill included (as zhuzi's offline figure)."""
        return self.output_tokens / self.total_s


def parse_batched_bench(text: str) -> list[BatchedRun]:
    """llama-batched-bench --output-format jsonl output -> its runs."""
    runs = []
    for line in text.splitlines():
        if line.strip().startswith("{"):
            r = json.loads(line)
            runs.append(BatchedRun(r["pp"], r["tg"], r["pl"], r["n_threads"], r["t_pp"], r["speed_pp"], r["t_tg"],
                                   r["speed_tg"], r["t"]))
    return runs


def batched_bench(tool: Path, gguf: Path, threads: int, prompt: int, gen: int,
                  sequences: int) -> tuple[BatchedRun, str]:
    """One llama-batched-bench run of `sequences` parallel sequences of prompt + gen tokens, and the command line
    as shown."""
    context = sequences * (prompt + gen) + 64
    command = [str(tool), "-m", str(gguf), "-t", str(threads),
               "-c", str(context), "-b", "2048", "-ub", "512", "-npp", str(prompt), "-ntg", str(gen),
               "-npl", str(sequences), "--output-format", "jsonl"]
    done, command = _run(command, timeout=7200, without_repack=("--no-repack",))
    runs = parse_batched_bench(done.stdout)
    if not runs:
        raise LlamaCppError("llama-batched-bench printed no result")
    return runs[-1], shown(command)


def parse_perplexity(log: str) -> tuple[float, int]:
    """llama-perplexity's log -> (its final estimate, the windows it scored)."""
    final = re.search(r"Final estimate: PPL = ([0-9.]+)", log)
    windows = re.search(r"calculating perplexity over (\d+) chunks", log)
    if not final or not windows:
        raise LlamaCppError("llama-perplexity printed no final estimate (is the text shorter than two windows?)")
    return float(final[1]), int(windows[1])


def llama_perplexity(tool: Path, gguf: Path, text: Path, window: int, threads: int) -> tuple[float, int, str]:
    """(perplexity, windows scored, the command line as shown) of llama-perplexity on a text file, windows of `window`.
    Without weight repacking, which changes no weight and crashed on AMX machines under a hypervisor."""
    command = [str(tool), "-m", str(gguf), "-f", str(text), "-c", str(window), "-b", str(window),
               "-t", str(threads), "--no-repack"]
    return *parse_perplexity(_run(command, timeout=7200)[0].stderr), shown(command)


def gguf_of(model: str | None) -> Path:
    """The GGUF file zhuzi runs (llama.cpp reads only GGUF)."""
    from zhuzi.model.loader import default_model_path

    path = Path(model) if model else default_model_path()
    if path.suffix != ".gguf":
        raise LlamaCppError(f"--compare llama.cpp needs a .gguf model (llama.cpp reads only GGUF), not {path}")
    return path
