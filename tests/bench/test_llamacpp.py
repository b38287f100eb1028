"""llama.cpp as the benchmark peer: its tools' output is read right (captured from real llama-bench,
llama-batched-bench and llama-perplexity runs on SmolLM2), a missing build says how to make one before
anything runs, and where the tools are built the comparisons run end to end in the same process."""
from pathlib import Path

import pytest

from zhuzi.bench.datasets import read_sharegpt, sharegpt_messages
from zhuzi.bench.llamacpp import (
    LlamaCppError,
    find_tool,
    parse_batched_bench,
    parse_llama_bench,
    parse_perplexity,
    shown,
)
from zhuzi.cli import build_parser

DATA = Path(__file__).parent / "data"
NOT_BUILT = "llama.cpp is not built (../shared/tools/build-llamacpp.sh)"


def run_tool(argv: list[str]):
    args = build_parser().parse_args(argv)
    return args.func(args)


def built(name: str) -> bool:
    try:
        return find_tool(name).is_file()
    except LlamaCppError:
        return False


def test_llama_bench_json_is_read():
    pp, tg = parse_llama_bench((DATA / "llama_bench.json").read_text())
    assert (pp.name, pp.n_prompt, pp.n_gen) == ("pp16", 16, 0)
    assert (tg.name, tg.n_prompt, tg.n_gen) == ("tg8", 0, 8)
    assert pp.tokens_per_s == pytest.approx(245.039179) and tg.tokens_per_s == pytest.approx(170.533834)
    assert tg.stddev == pytest.approx(0.055505)
    assert (tg.n_threads, tg.build, tg.model_type) == (1, "0c1e570", "llama 256M Q4_1")


def test_a_report_shows_files_by_name_not_by_this_machines_paths():
    command = ["/opt/llama.cpp/bin/llama-bench", "-m", "/srv/models/m.Q4_1.gguf", "-t", "2", "-o", "json"]
    assert shown(command) == "llama-bench -m m.Q4_1.gguf -t 2 -o json"


def test_llama_batched_bench_jsonl_is_read():
    one, four = parse_batched_bench((DATA / "llama_batched_bench.jsonl").read_text())
    assert (one.pl, one.pp, one.tg) == (1, 16, 8) and (four.pl, four.pp, four.tg) == (4, 16, 8)
    assert four.output_tokens == 32
    # output tokens over the whole run, prefill included, as zhuzi's offline figure counts them
    assert four.output_tokens_per_s == pytest.approx(32 / 0.479378)
    assert four.decode_tokens_per_s == pytest.approx(143.653656) and four.prefill_s == pytest.approx(0.25662)


def test_llama_perplexity_log_is_read():
    assert parse_perplexity((DATA / "llama_perplexity.log").read_text()) == (34.4216, 7)
    with pytest.raises(LlamaCppError, match="no final estimate"):
        parse_perplexity("perplexity: tokenizing the input ..")


def test_a_missing_llama_perplexity_says_which_target_builds_it(tmp_path):
    with pytest.raises(LlamaCppError, match="build-llamacpp.sh.*`cmake --build build --target llama-perplexity`"):
        find_tool("llama-perplexity", str(tmp_path))


def test_a_missing_llama_cpp_is_named_with_how_to_build_it(tmp_path, monkeypatch):
    with pytest.raises(LlamaCppError, match="not found in .*build-llamacpp.sh"):
        find_tool("llama-bench", str(tmp_path))
    monkeypatch.setenv("LLAMA_CPP_BIN", str(tmp_path))
    with pytest.raises(LlamaCppError, match=r"\$LLAMA_CPP_BIN"):
        find_tool("llama-batched-bench")


@pytest.mark.parametrize("tool", [["decode"], ["offline"], ["accuracy", "--perplexity", "README.md"]])
def test_compare_fails_before_zhuzi_runs_when_llama_cpp_is_missing(tool, tmp_path, capsys):
    with pytest.raises(LlamaCppError, match="build-llamacpp.sh"):
        run_tool(["bench", *tool, "--compare", "llama.cpp", "--llama-cpp-bin", str(tmp_path)])
    assert "zhuzi bench" not in capsys.readouterr().out  # no report: nothing ran


def test_compare_needs_a_gguf_model(tmp_path):
    with pytest.raises(LlamaCppError, match="needs a .gguf model"):
        run_tool(["bench", "decode", "--model", str(tmp_path), "--compare", "llama.cpp"])


@pytest.mark.skipif(not built("llama-bench"), reason=NOT_BUILT)
def test_decode_runs_llama_bench_on_the_same_gguf_and_threads(capsys):
    report = run_tool(["bench", "decode", "--quantization", "int4", "--prompt-len", "16", "--max-tokens", "8",
                       "--runs", "2", "--bandwidth-repeats", "1", "--compare", "llama.cpp"])
    peer = report.llama_cpp
    assert len(peer.rounds) == len(report.decode_rounds) == len(report.decode_ratios_by_round) == 2  # taking turns
    assert (peer.prefill.n_prompt, peer.decode.n_gen) == (16, 8)
    assert peer.decode.n_threads == report.threads and "Q4_1" in peer.decode.model_type
    assert peer.command.startswith("llama-bench -m SmolLM2-135M-Instruct.Q4_1.gguf ") and "/" not in peer.command
    prefill, decode = report.ratios
    assert decode == pytest.approx(report.decode_tokens_per_s / peer.decode.tokens_per_s)
    assert prefill == pytest.approx(report.prefill_tokens_per_s / peer.prefill.tokens_per_s)
    assert report.llama_cpp_roofline_fraction == pytest.approx(peer.decode.tokens_per_s / report.roofline_tokens_per_s)
    printed = capsys.readouterr().out
    assert "zhuzi / llama.cpp decode:" in printed and "tg8:" in printed and "load:" in printed
    assert "llama.cpp at" in printed


@pytest.mark.skipif(not built("llama-batched-bench"), reason=NOT_BUILT)
def test_offline_runs_llama_batched_bench_with_the_workloads_mean_lengths(capsys):
    report = run_tool(["bench", "offline", "--num-prompts", "4", "--min-input", "16", "--max-input", "32",
                       "--min-output", "8", "--max-output", "12", "--no-transformers", "--rounds", "2",
                       "--compare", "llama.cpp"])
    assert len(report.zhuzi_rounds) == len(report.llama_cpp_rounds) == 2  # taking turns
    assert report.zhuzi.tokens_per_s == max(report.zhuzi_rounds)
    peer = report.llama_cpp
    assert peer.pl == 4 and peer.n_threads == report.threads
    assert peer.pp == round(report.input_tokens / 4) and peer.tg == round(report.requested_output_tokens / 4)
    assert report.llama_cpp_ratio == pytest.approx(report.zhuzi.tokens_per_s / peer.output_tokens_per_s)
    printed = capsys.readouterr().out
    assert "zhuzi / llama.cpp:" in printed
    assert "llama.cpp: llama-batched-bench -m SmolLM2-135M-Instruct.Q4_1.gguf -t" in printed


@pytest.mark.skipif(not built("llama-perplexity"), reason=NOT_BUILT + " with its llama-perplexity target")
def test_perplexity_of_a_text_is_llama_perplexitys_within_one_percent(tmp_path, capsys):
    """The same GGUF blocks and text, windows scored the same way: the same perplexity."""
    answers = (m["content"] for record in read_sharegpt(50) for m in sharegpt_messages(record)
               if m["role"] == "assistant")
    text = tmp_path / "answers.txt"
    # One space between words: llama.cpp's SmolLM2 pre-tokenizer joins "\n\n" into one token, transformers' not
    text.write_text(" ".join(" ".join(next(answers) for _ in range(12)).split()))
    report = run_tool(["bench", "accuracy", "--perplexity", str(text), "--window", "256", "--compare", "llama.cpp"])
    assert report.windows == report.llama_cpp_windows >= 2
    assert report.results["default"] == pytest.approx(report.llama_cpp, rel=0.01)
    assert "zhuzi default" in capsys.readouterr().out
