"""zhuzi/bench/sweep.py: the table reads each file's decode report (one recorded from a real
`zhuzi bench sweep` of SmolLM2 against llama-bench): the machine, llama.cpp's build, and a row a file with
the best figures, the ratio of each round and the resident memory against the file; unknown stand-ins and a
sweep of nothing are refused before anything runs, and a file that fails is named while the others run."""
import json
from pathlib import Path

import pytest

from zhuzi.bench.sweep import HEADER, SweepRow, format_table
from zhuzi.cli import build_parser

REPORT = json.loads((Path(__file__).parent / "data" / "sweep_decode.json").read_text())


def test_the_table_has_a_row_a_file_with_each_rounds_ratio():
    second = REPORT | {"model": "qwen2.5-3b (stand-in)"}
    table = format_table([SweepRow(REPORT, 98_000_000), SweepRow(second, 1_900_000_000)])
    lines = table.splitlines()
    assert lines[0] == f"machine:   {REPORT['machine']}"
    assert "build 0c1e570, 1 threads" in lines[1] and "16-token prompts, 4 new tokens, 2 rounds" in lines[1]
    assert lines[3] == "| " + " | ".join(HEADER) + " |"
    rows = [line.strip("|").split(" | ") for line in lines[5:]]
    assert [row[0].strip() for row in rows] == [REPORT["model"], "qwen2.5-3b (stand-in)"]
    cells = dict(zip(HEADER[:5], rows[0]))  # the decode side's
    peer = REPORT["llama_cpp"]["rounds"]
    assert float(cells["decode tok/s"]) == pytest.approx(REPORT["decode_tokens_per_s"], abs=0.05)
    assert float(cells["tg"]) == pytest.approx(max(tg["tokens_per_s"] for _, tg in peer), abs=0.05)
    assert cells["ratio"] == f"{REPORT['ratios'][1]:.2f}x"
    decode_rounds, prefill_rounds = rows[0][5].split(), rows[0][9].split()
    assert [float(x) for x in decode_rounds] == pytest.approx(
        [ours / tg["tokens_per_s"] for ours, (_, tg) in zip(REPORT["decode_rounds"], peer)], abs=0.005)
    assert [float(x) for x in prefill_rounds] == pytest.approx(
        [ours / pp["tokens_per_s"] for ours, (pp, _) in zip(REPORT["prefill_rounds"], peer)], abs=0.005)
    loaded = REPORT["peak_rss_bytes"] - REPORT["rss_before_load_bytes"]
    assert rows[0][-1].strip() == f"{loaded / 98_000_000:.2f}x"
    assert rows[1][-1].strip() == f"{loaded / 1_900_000_000:.2f}x"


@pytest.mark.parametrize("argv, message", [(["--standins", "qwen9-1t"], "no stand-in named qwen9-1t"),
                                           ([], "give GGUF files"),
                                           (["--standins", "qwen2.5-3b"], "needs --standin-source")])
def test_a_sweep_that_cannot_run_says_why_before_anything_runs(argv, message, capsys):
    args = build_parser().parse_args(["bench", "sweep", *argv])
    with pytest.raises(SystemExit, match=message):
        args.func(args)


def test_a_file_that_fails_is_named_and_the_sweep_goes_on(tmp_path, capsys):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF, but no more")
    args = build_parser().parse_args(["bench", "sweep", str(broken), "--runs", "1"])
    assert args.func(args) == []
    assert "failed:    broken.gguf" in capsys.readouterr().out
