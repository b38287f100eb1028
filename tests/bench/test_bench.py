"""The benchmark tools (`zhuzi bench offline | decode | structured | serve | polling | scaling | models`) run end to end
on tiny settings.

They drive the real engine, real transformers and a real `zhuzi serve` subprocess; the figures
are meaningless at this size, so the tests check that each report is complete and consistent.
"""
import json
import re
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
import tiny

from zhuzi.bench import collectives, decode, kv
from zhuzi.bench.client import chunk_content
from zhuzi.bench.datasets import (
    input_grounded_chats,
    load_tokenizer,
    random_token_requests,
    read_sharegpt,
    sharegpt_conversations,
)
from zhuzi.cli import build_parser
from zhuzi.model import native
from zhuzi.model.loader import load_model_config

pytestmark = pytest.mark.long  # a minute or more: handed out first (tests/conftest.py)


def run_tool(argv: list[str]):
    args = build_parser().parse_args(argv)
    return args.func(args)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def test_cli_lists_every_tool(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--help"])
    help_text = capsys.readouterr().out
    assert all(tool in help_text for tool in ("offline", "decode", "structured", "serve", "polling", "scaling", "tools",
                                              "kv", "models"))


def test_random_prompts_are_seeded_in_range_and_free_of_control_tokens(tokenizer):
    requests = random_token_requests(tokenizer, 32, (5, 9), (3, 4), seed=7)
    assert requests == random_token_requests(tokenizer, 32, (5, 9), (3, 4), seed=7)
    assert requests != random_token_requests(tokenizer, 32, (5, 9), (3, 4), seed=8)
    assert {len(r.prompt_token_ids) for r in requests} <= set(range(5, 10))
    assert {r.max_tokens for r in requests} <= {3, 4}
    ids = np.concatenate([r.prompt_token_ids for r in requests])
    assert not set(ids.tolist()) & set(tokenizer.all_special_ids)
    assert ids.min() >= 0 and ids.max() < len(tokenizer)


def test_sharegpt_reads_the_packaged_file_although_it_is_cut_off():
    records = read_sharegpt()
    assert len(records) > 10_000
    assert all("conversations" in r for r in records)


def test_sharegpt_conversations_fill_exactly_the_requested_turns(tokenizer):
    conversations = sharegpt_conversations(tokenizer, 30, seed=0, max_context=1024)
    assert sum(len(c.turns) for c in conversations) == 30
    assert any(len(c.turns) > 1 for c in conversations)
    for c in conversations:
        assert all(t.user.strip() and t.max_tokens >= 4 for t in c.turns)
        assert sum(c.turn_lengths) + sum(t.max_tokens for t in c.turns) <= 1024  # the dataset's own history
    again = sharegpt_conversations(tokenizer, 30, seed=0, max_context=1024)
    assert [t.user for c in again for t in c.turns] == [t.user for c in conversations for t in c.turns]


def test_stream_chunks_of_other_servers_are_read():
    # llama-server: no role chunk, reasoning in its own field; completions: text; usage-only: no choices.
    assert chunk_content({"index": 0, "delta": {"content": "Hi"}}) == "Hi"
    assert chunk_content({"index": 0, "delta": {"reasoning_content": "hmm"}}) == "hmm"
    assert chunk_content({"index": 0, "delta": {"role": "assistant", "content": None}}) == ""
    assert chunk_content({"index": 0, "text": " there", "finish_reason": None}) == " there"


def test_offline_compares_zhuzi_with_transformers_on_the_same_requests(tmp_path, capsys):
    # A tiny random checkpoint with SmolLM2's vocabulary: transformers loads its safetensors at once, where
    # the GGUF takes it 20-30 s (its tokenizer arrays read field by field); the report is what is tested.
    tiny.build("llama", tmp_path / "tiny", vocab_size=len(load_tokenizer(None)))
    out = tmp_path / "offline.json"
    report = run_tool(["bench", "offline", "--model", str(tmp_path / "tiny"), "--num-prompts", "4",
                       "--min-input", "16", "--max-input", "32",
                       "--min-output", "8", "--max-output", "16", "--hf-batch-size", "2",
                       "--hf-num-prompts", "1", "--json-out", str(out)])
    printed = capsys.readouterr().out
    assert report.zhuzi.output_tokens == report.requested_output_tokens  # ignore_eos: every token asked for
    assert report.transformers.num_requests == 2  # rounded up to one whole batch
    assert "first 2 of 4 requests" in report.comparison
    assert report.ratio == pytest.approx(report.zhuzi.tokens_per_s / report.transformers.tokens_per_s)
    assert "output tokens/s" in printed and "zhuzi / transformers" in printed
    data = json.loads(out.read_text())
    assert data["ratio"] == pytest.approx(report.ratio)
    assert data["zhuzi"]["tokens_per_s"] > 0 and data["transformers"]["output_tokens"] > 0


@pytest.mark.parametrize("quantization", [None, "none", "int8"])
def test_decode_reports_speed_and_share_of_roofline(quantization, tmp_path, capsys):
    out = tmp_path / "decode.json"
    report = run_tool(["bench", "decode", "--prompt-len", "16", "--max-tokens", "6", "--runs", "1",
                       "--bandwidth-repeats", "2", "--json-out", str(out)]
                      + (["--quantization", quantization] if quantization else []))
    assert (report.prompt_tokens, report.output_tokens) == (16, 6)
    assert report.prefill_tokens_per_s > 0 and report.decode_tokens_per_s > 0
    assert report.bandwidth_bytes_per_s > 1e9
    bf16_bytes = load_model_config(None).decode_weight_bytes(2)  # ~269 MB for SmolLM2
    # the roofline rises as the bytes a step reads fall: the GGUF's own Q4_1 blocks (the default), int8 matrices
    if quantization is None:
        assert report.weight_bytes_per_step < 0.4 * bf16_bytes
    elif quantization == "int8":
        assert report.quantization == "int8" and report.weight_bytes_per_step < 0.65 * bf16_bytes
    else:
        assert report.weight_bytes_per_step == pytest.approx(bf16_bytes, rel=0.02)
    assert report.roofline_fraction == pytest.approx(report.decode_tokens_per_s * report.weight_bytes_per_step
                                                     / report.bandwidth_bytes_per_s)
    printed = capsys.readouterr().out
    assert "% of roofline" in printed and "STREAM-style read" in printed and report.sum_bandwidth_bytes_per_s > 1e9
    data = json.loads(out.read_text())
    assert data["roofline_fraction"] == pytest.approx(report.roofline_fraction)
    assert data["llama_cpp_roofline_fraction"] is None  # no --compare
    if quantization is None:  # the fused step ran every decode step, its threads clocked at its barriers
        assert 0 <= report.barrier_wait_s <= report.decode_step_s and "barriers:" in printed
    assert report.machine.endswith(f", {native.resolve(native.default_choice())} kernels")  # the variant that ran


def test_decode_of_a_mixture_of_experts_has_its_roofline_on_the_active_parameters(tmp_path, capsys, monkeypatch):
    """Top-2 of 4 experts: a step reads the dense part and two experts a layer, not all four."""
    tiny.build("qwen3_moe", tmp_path)
    monkeypatch.setattr(decode, "BANDWIDTH_BUFFER_BYTES", 64 << 20)  # the figure is not checked here: a short read
    report = run_tool(["bench", "decode", "--model", str(tmp_path), "--dtype", "float32", "--prompt-len", "8",
                       "--max-tokens", "4", "--runs", "1", "--bandwidth-repeats", "1"])
    config = load_model_config(tmp_path)
    active, total = report.parameters
    assert report.experts == (2, 4) and (active, total) == (config.active_parameters, config.num_parameters)
    assert total - active == 2 * 2 * 3 * 64 * 32  # two layers' two unread experts
    assert report.weight_bytes_per_step == pytest.approx(config.decode_weight_bytes(4), rel=0.01)  # float32
    assert report.roofline_tokens_per_s == pytest.approx(report.bandwidth_bytes_per_s / report.weight_bytes_per_step)
    assert "top-2 of 4 experts a sparse layer" in capsys.readouterr().out


def test_decode_of_a_hybrid_counts_the_states_a_step_reads_and_writes_in_its_roofline(tmp_path, capsys,
                                                                                       monkeypatch):
    """Qwen3.5's shape: a decode step moves its weights and each DeltaNet layer's state, read and written."""
    tiny.build("qwen3_5", tmp_path)
    monkeypatch.setattr(decode, "BANDWIDTH_BUFFER_BYTES", 64 << 20)
    report = run_tool(["bench", "decode", "--model", str(tmp_path), "--dtype", "float32", "--prompt-len", "8",
                       "--max-tokens", "4", "--runs", "1", "--bandwidth-repeats", "1"])
    config = load_model_config(tmp_path)
    assert report.state_bytes_per_step == 2 * config.state_bytes > 0
    assert report.roofline_tokens_per_s == pytest.approx(
        report.bandwidth_bytes_per_s / (report.weight_bytes_per_step + report.state_bytes_per_step))
    assert "the recurrent layers' states, read and written" in capsys.readouterr().out


def test_decode_compares_speculation_with_none_on_grounded_prompts(tmp_path, capsys):
    out = tmp_path / "spec.json"
    ngram = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    report = run_tool(["bench", "decode", "--speculative-config", ngram, "--workload", "grounded", "--num-prompts", "2",
                       "--max-tokens", "16", "--json-out", str(out)])
    assert report.num_prompts == 2 and report.identical_outputs == 2  # greedy: the same text, faster or not
    assert report.plain_tokens == report.spec_tokens > 0
    assert report.num_drafts > 0 and report.num_accepted_tokens > 0
    assert report.speedup == pytest.approx(report.plain_decode_s / report.spec_decode_s)  # the same tokens
    assert report.mean_acceptance_length == pytest.approx(1 + report.num_accepted_tokens / report.num_drafts)
    assert "speedup:" in capsys.readouterr().out
    assert json.loads(out.read_text())["speculative_config"]["num_speculative_tokens"] == 4


def test_grounded_chats_ask_to_repeat_real_text():
    chats = input_grounded_chats(8, seed=3)
    assert len(chats) == 8 and chats == input_grounded_chats(8, seed=3)
    asks = [chat[0]["content"] for chat in chats]
    assert [a.split()[0].strip(",") for a in asks[:4]] == ["Fix", "Add", "Rewrite", "Quote"]
    assert all("def " in a for a in asks[1:3]) and all(len(a) > 400 for a in asks)


def test_structured_compares_constrained_and_free_decode_steps(tmp_path, capsys):
    out = tmp_path / "structured.json"
    report = run_tool(["bench", "structured", "--batch", "2", "--steps", "6", "--rounds", "1",
                       "--json-out", str(out)])
    assert (report.batch, report.steps) == (2, 6)
    assert report.free_step_s > 0 and report.constrained_step_s > 0
    assert report.ratio == pytest.approx(report.constrained_step_s / report.free_step_s)
    assert "ms a decode step" in capsys.readouterr().out
    assert json.loads(out.read_text())["ratio"] == pytest.approx(report.ratio)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "serve.log"
    with open(log, "w") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "zhuzi.cli", "serve", "--port", str(port)],
                                stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while not healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"zhuzi serve did not become healthy:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def test_serve_measures_every_streamed_request(server_url, tmp_path, capsys):
    """With the long-prompt mix (one long prompt here), reported apart."""
    out = tmp_path / "serve.json"
    report = run_tool(["bench", "serve", "--base-url", server_url, "--num-prompts", "4",
                       "--random-input-len", "24", "--random-output-len", "6", "--max-concurrency", "2",
                       "--ignore-eos", "--disable-tqdm", "--json-out", str(out),
                       "--long-prompt-len", "200", "--long-prompts", "1"])
    assert (report.completed, report.failed, report.num_prompts) == (4, 0, 4)
    assert report.long_completed == 1 and report.long_ttft_ms.median > 0
    assert report.total_output_tokens == 4 * 6  # ignore_eos reached the server; usage was read
    assert report.total_input_tokens >= 4 * 24  # the chat template adds to the prompt
    for stat in (report.ttft_ms, report.tpot_ms, report.itl_ms, report.e2el_ms):
        assert 0 < stat.median <= stat.p99
    assert report.e2el_ms.mean > report.ttft_ms.mean
    assert report.machine.endswith(f", {native.resolve(native.default_choice())} kernels")  # from /inspect/engine
    assert all(1 <= len(r.itl) <= 5 for r in report.requests)  # gaps between at most 6 content chunks
    printed = capsys.readouterr().out
    for row in ("Successful requests:", "Request throughput (req/s):", "Output token throughput (tok/s):",
                "Median TTFT (ms):", "P99 TPOT (ms):", "Mean ITL (ms):", "P99 E2EL (ms):", "Long prompts answered:"):
        assert row in printed
    data = json.loads(out.read_text())
    assert data["completed"] == 4 and data["ttft_ms"]["p99"] == pytest.approx(report.ttft_ms.p99)


def test_serve_runs_tenants_alone_then_together(server_url, tmp_path, capsys):
    out = tmp_path / "tenants.json"
    report = run_tool(["bench", "serve", "--base-url", server_url, "--ignore-eos", "--json-out", str(out),
                       "--tenants", "name=busy,streams=2,input=24,output=6",
                       "name=chat,requests=3,turns=2,input=16,output=4,delay=0.2"])
    assert [(r.tenant, r.phase, r.completed, r.failed) for r in report.results] == [
        ("chat", "alone", 3, 0), ("chat", "together", 3, 0)]
    assert all(0 < r.ttft_ms.median and 0 < r.tpot_ms.median for r in report.results)
    printed = capsys.readouterr().out
    assert "busy: 2 stream(s), background" in printed and "chat: 1 stream(s), 3 requests, 2 turns a chat" in printed
    assert re.search(r"chat +together/alone +\d+\.\d\dx +\d+\.\d\dx", printed)
    assert json.loads(out.read_text())["results"][1]["phase"] == "together"


def test_a_tenant_spec_is_checked():
    for spec, why in [("streams=0", "at least 1"), ("color=red", "is not one of"), ("streams=two", "takes an integer")]:
        with pytest.raises(SystemExit, match=why):
            run_tool(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--tenants", spec + ",requests=1"])


def test_serve_polls_a_path_while_the_load_runs(server_url):
    report = run_tool(["bench", "serve", "--base-url", server_url, "--num-prompts", "4", "--random-input-len", "24",
                       "--random-output-len", "24", "--max-concurrency", "4", "--ignore-eos", "--disable-tqdm",
                       "--poll", "/inspect/engine?steps=128", "--poll-interval", "0.05"])
    assert (report.completed, report.failed) == (4, 0)
    assert report.polls >= 2 and 0 < report.poll_ms.median <= report.poll_ms.p99
    with pytest.raises(RuntimeError, match="--poll /inspect/nowhere failed"):
        run_tool(["bench", "serve", "--base-url", server_url, "--num-prompts", "1", "--random-output-len", "4",
                  "--disable-tqdm", "--poll", "/inspect/nowhere"])


def test_polling_runs_the_load_quiet_and_polled_side_by_side(server_url, tmp_path, capsys):
    out = tmp_path / "polling.json"
    report = run_tool(["bench", "polling", "--base-url", server_url, "--num-prompts", "2", "--max-concurrency", "2",
                       "--random-input-len", "16", "--random-output-len", "12", "--poll-interval", "0.02",
                       "--rounds", "2", "--json-out", str(out)])
    assert [(r.round, r.arm) for r in report.runs] == [(0, "quiet"), (0, "polled"), (1, "polled"), (1, "quiet")]
    assert all((r.polls > 0) == (r.arm == "polled") and r.tpot_ms > 0 for r in report.runs)
    best = min(report.tpots("polled")) / min(report.tpots("quiet"))
    assert report.best_ratio == pytest.approx(best)
    assert "polled/quiet" in capsys.readouterr().out
    assert json.loads(out.read_text())["median_ratio"] == pytest.approx(report.median_ratio)


def test_kv_refuses_an_unknown_part():
    with pytest.raises(SystemExit, match="unknown part 'tiers'"):
        run_tool(["bench", "kv", "--parts", "tiers"])


def test_kv_restart_times_a_first_token_and_reads_the_cached_prompt(server_url):
    """The restart part's probe, against a running server: a system prompt's second turn finds it cached."""
    system = "You are a careful assistant who answers in one short sentence. " * 8
    _, cold = kv.first_token(server_url, system, "Name a colour.")
    ttft, cached = kv.first_token(server_url, system, "Name a colour.")
    assert ttft > 0 and cold < cached and cached >= 64


def test_serve_replays_sharegpt_with_the_servers_answers_in_the_history(server_url):
    report = run_tool(["bench", "serve", "--base-url", server_url, "--dataset", "sharegpt", "--num-prompts", "4",
                       "--sharegpt-output-len", "6", "--max-concurrency", "2", "--disable-tqdm"])
    assert (report.completed, report.failed) == (4, 0)
    by_turn = {(r.conversation, r.turn): r for r in report.requests}
    later_turns = [(by_turn[c, t - 1], r) for (c, t), r in by_turn.items() if t > 0]
    assert later_turns, "seed 0 should draw a multi-turn conversation"
    for before, after in later_turns:
        assert after.prompt_tokens > before.prompt_tokens + before.output_tokens


def test_serve_counts_refused_requests_as_failed(server_url):
    report = run_tool(["bench", "serve", "--base-url", server_url, "--endpoint", "completions",
                       "--num-prompts", "2", "--random-input-len", "8", "--random-output-len", "1000000",
                       "--disable-tqdm"])
    assert (report.completed, report.failed) == (0, 2)
    assert report.errors and report.errors[0].startswith("HTTP 400")


def test_scaling_loads_each_setup_while_probing_the_front(tmp_path, capsys):
    out = tmp_path / "scaling.json"
    rows = run_tool(["bench", "scaling", "--setups", "engine-process", "--num-prompts", "2", "--max-concurrency", "2",
                     "--input-len", "8", "--output-len", "4", "--serve-args=--kv-cache-memory 64MiB",
                     "--json-out", str(out)])
    assert [r.setup for r in rows] == ["engine-process"]
    row = rows[0]
    assert row.failed == 0 and row.output_tok_s > 0 and row.command.endswith("--kv-cache-memory 64MiB")
    assert row.probes >= 2 and 0 < row.health_p50_ms <= row.health_p99_ms and 0 < row.models_p50_ms <= row.models_p99_ms
    assert "| engine-process |" in capsys.readouterr().out
    assert json.loads(out.read_text())["setups"][0]["tpot_p50_ms"] == pytest.approx(row.tpot_p50_ms)


def test_scaling_refuses_an_unknown_setup():
    with pytest.raises(SystemExit, match="unknown setup 'dp3'"):
        run_tool(["bench", "scaling", "--setups", "dp3"])


def test_collectives_time_two_gloo_ranks_and_a_layer_split_in_two():
    report = collectives.measure(iterations=20)
    assert report.all_reduce_bf16_p50_us > 0 and report.all_reduce_fp32_p50_us > 0
    assert report.layer_whole_us > 0 and report.layer_rank0_us > 0
    assert report.saved_us == pytest.approx(report.layer_whole_us - report.layer_rank0_us)
    assert report.added_us == pytest.approx(2 * report.all_reduce_bf16_p50_us)


def test_models_times_a_cold_and_a_warm_first_token_of_each_model_and_both_at_once(smollm2_path, tmp_path, capsys):
    """Two names for the embedded SmolLM2 (links, not copies) behind `zhuzi serve --models-dir`."""
    models = tmp_path / "models"
    models.mkdir()
    for name in ("a", "b"):
        (models / f"{name}.gguf").symlink_to(smollm2_path)
    out = tmp_path / "models.json"
    report = run_tool(["bench", "models", "--models-dir", str(models), "--rounds", "1", "--threads", "1",
                       "--probe-len", "8", "--num-prompts", "2", "--max-concurrency", "2", "--input-len", "8",
                       "--output-len", "4", "--settle", "0", "--json-out", str(out),
                       "--serve-args=--kv-cache-memory 4MiB --no-engine-process"])
    (turn,) = report.turns
    assert (turn.server, turn.round, turn.failed, report.models) == ("zhuzi", 0, 0, ["a", "b"])
    # the warm-up left both unloaded: each cold first token waited for a load, the warm one did not
    assert all(turn.cold_ttft_ms[m] > 2 * turn.warm_ttft_ms[m] > 0 for m in "ab")
    assert turn.output_tok_s > 0 and turn.tpot_ms > 0
    printed = capsys.readouterr().out
    assert "| 0 | zhuzi |" in printed and "zhuzi serve --models-dir models --num-threads 1" in printed
    assert json.loads(out.read_text())["turns"][0]["cold_ttft_ms"]["b"] == pytest.approx(turn.cold_ttft_ms["b"])
