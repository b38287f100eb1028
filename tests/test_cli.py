"""The command line as a user runs it.

Two runners, one command line. `zhuzi(...)` starts a real `python -m zhuzi.cli` process; a process start
(importing torch and transformers) costs about 5 s, so only the tests that need one pay it. `zhuzi_here(...)`
runs the same main() in this process, its stdout, stderr and exit status captured as a process's would be.

In a process of their own: generate and chat (they load and run a model), the CPU-kernel variant test
(--cpu-kernels is the flag that, run for real, switches a process's kernels), and the errors that generate
reports from its engine (EngineCore seeds torch's global RNG, and may set torch's threads, before a bad model
path or architecture fails); these also keep the real process's stderr and exit status covered. In this process:
every `plan` (arithmetic over a config, nothing loaded or selected), `models` (a directory scan), and the
one-line errors that `serve` or a config check raises before any model is served. zhuzi_here restores
os.environ (serve sets TOKENIZERS_PARALLELISM) and the root logger (main() calls logging.basicConfig) after each
command, so nothing leaks from one test into the next.
"""
import contextlib
import io
import json
import logging
import os
import platform
import subprocess
import sys

import gguf
import pytest
import tiny

from zhuzi import cli
from zhuzi.model import native
from zhuzi.model.families import FAMILIES
from zhuzi.model.loader import default_model_path, load_model_config


def zhuzi(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zhuzi.cli", "--log-level", "WARNING", *args], input=stdin,
                          capture_output=True, text=True, timeout=300)


def zhuzi_here(*args: str) -> subprocess.CompletedProcess:
    """zhuzi(*args) run by main() in this process (see the module's docstring): SystemExit's code as the
    interpreter reports it (a message: on stderr, status 1; a number: the status; None: 0)."""
    argv = ["--log-level", "WARNING", *args]
    stdout, stderr = io.StringIO(), io.StringIO()
    environ, root = dict(os.environ), logging.getLogger()
    handlers, level = root.handlers[:], root.level
    returncode = 0
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                cli.main(argv)
            except SystemExit as exit_:
                if exit_.code is None or isinstance(exit_.code, int):
                    returncode = exit_.code or 0
                else:
                    print(exit_.code, file=sys.stderr)
                    returncode = 1
    finally:
        os.environ.clear()
        os.environ.update(environ)
        root.handlers[:] = handlers
        root.setLevel(level)
    return subprocess.CompletedProcess([sys.executable, "-m", "zhuzi.cli", *argv], returncode, stdout.getvalue(),
                                       stderr.getvalue())


def test_generate_prints_a_sensible_continuation():
    out = zhuzi("generate", "--temperature", "0", "--max-tokens", "8", "The capital of France is")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("The capital of France is Paris")


def test_chat_streams_replies_and_keeps_the_history():
    out = zhuzi("chat", "--temperature", "0", "--max-tokens", "30", "--quantization", "none",  # as test_llm's llm16
                stdin="What is the capital of France?\nAnd of Germany?\n\n")
    assert out.returncode == 0, out.stderr
    first, second = [line for line in out.stdout.splitlines() if line.startswith("> ")][:2]
    assert "Paris" in first
    assert "Berlin" in second  # "And of Germany?" only makes sense with the first turn in the history


def test_plan_prints_the_weight_and_kv_arithmetic():
    out = zhuzi_here("plan", "--kv-cache-memory", "4GiB", "--context", "4096", "--sequences", "4")
    assert out.returncode == 0, out.stderr
    assert "KV bytes per token: 2 x 30 layers x 3 kv_heads x 64 head_dim x 2 bytes = 23,040" in out.stdout
    assert "186,400 tokens" in out.stdout  # 4 GiB / (23,040 x 16) = 11,650 pages of 16
    assert "requests of 4,096 tokens that fit at once: 45" in out.stdout
    # The GGUF's own blocks: Q4_1 layers, the tied Q8_0 embedding (the LM head), float32 norms as bf16
    assert "weights: 96,506,496 bytes (92 MiB) in memory: the file's blocks (Q4_1 63.3 MiB, Q8_0 28.7 MiB" in out.stdout
    assert "4 x 4,096-token sequences: KV 377,487,360 bytes (360 MiB), with the weights 473,993,856" in out.stdout
    assert "weight bytes one decode step reads: 96,506,496" in out.stdout


def test_plan_on_a_gpu_shows_both_memories_and_the_tokens_that_fit(tmp_path):
    """A tiny llama's config (no weights: nothing is loaded), 3 of its 4 layers on a GPU of 1 GiB. A layer: q, o
    64 x 64, k, v 32 x 64, gate, up, down 128 x 64, two norms: 36,992 bf16 values. The GPU: 3 layers' weights;
    the CPU: the last layer, the embedding and LM head (1000 x 64 each) and the final norm. The GPU's share
    int(2**30 x 0.9) less the weights and the 0.5 GiB reserve, over 2 x 3 layers x 2 kv_heads x 16 x 2 bytes."""
    tiny.config("llama", layers=4).save_pretrained(tmp_path)
    out = zhuzi_here("plan", str(tmp_path), "--device", "cuda", "--n-gpu-layers", "3", "--gpu-memory", "1GiB")
    assert out.returncode == 0, out.stderr
    assert "layers 0-2 on cuda, layer 3 and the embedding and LM head on cpu" in out.stdout
    assert f"= 966,367,641 bytes: weights of 3 layers {3 * 36_992 * 2:,}" in out.stdout
    assert f"+ KV {966_367_641 - 221_952 - 2**29:,}" in out.stdout  # 429,274,777
    assert f"/ 384 KV bytes a token on the GPU = {429_274_777 // 384:,}" in out.stdout  # 1,117,903
    assert f"CPU: weights {(36_992 + 2 * 64_000 + 64) * 2:,}" in out.stdout
    assert f"KV of its layers {1_117_903 * 128:,} (128 bytes a token)" in out.stdout
    assert f"= {1_117_903 // 16:,} pages of 16 tokens" in out.stdout  # the CPU's layers hold the same slots


def test_plan_reads_a_models_preset_beneath_the_flags_given(tmp_path):
    """MODEL names its table, whose `model` is the file; [default] under it, the flags given over both."""
    preset = tmp_path / "models.toml"
    preset.write_text(f"[default]\nkv-cache-memory = '1GiB'\n[smol]\nmodel = '{default_model_path()}'\n"
                      "kv-cache-dtype = 'q8_0'\nblock-size = 32\n")
    out = zhuzi_here("plan", "--models-preset", str(preset), "smol", "--block-size", "64")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f'preset [smol] of {preset}: kv-cache-memory = "1GiB", model = "')
    assert "x 1.0625 bytes (q8_0: 8-bit values and an fp16 scale per 32) = 12,240" in out.stdout
    assert "KV pool: 1,073,741,824 bytes = 1,370 pages of 64 tokens" in out.stdout  # 2**30 // (12,240 x 64)
    out = zhuzi_here("plan", "--models-preset", str(preset), str(default_model_path()))  # no table: [default]'s
    assert "x 2 bytes = 23,040" in out.stdout and "KV pool: 1,073,741,824 bytes = 2,912 pages of 16" in out.stdout
    preset.write_text("[smol]\nblock_size = 32\n")
    out = zhuzi_here("plan", "--models-preset", str(preset), "smol")
    assert out.returncode != 0 and out.stderr.strip().count("\n") == 0
    assert f"{preset} [smol] block_size: unknown key (did you mean block-size?)" in out.stderr


def test_plan_of_a_mixture_of_experts_counts_the_experts_a_step_reads(tmp_path):
    """A GGUF file of 4 experts, top-2: a step reads every weight but the unread embedding rows and two experts of
    each layer (float32 values held as bf16)."""
    hf = tiny.build("qwen3_moe", tmp_path)
    path = tiny.write_gguf(tmp_path / "moe.gguf", hf, "qwen3_moe")
    out = zhuzi_here("plan", "--model", str(path))
    assert out.returncode == 0, out.stderr
    values = sum(t.numel() for t in hf.state_dict().values())
    step = 2 * (values - (1000 - 1) * 64 - 2 * 2 * 3 * 64 * 32)
    assert f"weights: {2 * values:,} bytes" in out.stdout
    assert f"weight bytes one decode step reads: {step:,}" in out.stdout
    assert "M active: top-2 of 4 experts" in out.stdout


def test_plan_counts_a_q8_0_kv_cache_at_about_half_the_bytes():
    out = zhuzi_here("plan", "--kv-cache-memory", "4GiB", "--kv-cache-dtype", "q8_0")
    assert out.returncode == 0, out.stderr
    assert ("KV bytes per token: 2 x 30 layers x 3 kv_heads x 64 head_dim x 1.0625 bytes (q8_0: 8-bit values and an "
            "fp16 scale per 32) = 12,240") in out.stdout  # 17/32 of bf16's 23,040
    assert "= 350,896 tokens" in out.stdout  # 4 GiB / (12,240 x 16) = 21,931 pages of 16


def test_plan_of_dense_weights():
    out = zhuzi_here("plan", "--quantization", "none")
    assert out.returncode == 0, out.stderr
    assert "weights: 269,030,016 bytes (257 MiB) in memory: dense (2-byte values)" in out.stdout


@pytest.mark.parametrize("kernels", [v.name for v in native.runnable() if v.name in ("avx512", "avx2")])
def test_plan_says_which_dtype_auto_picked_and_why(kernels):
    out = zhuzi_here("plan", "--cpu-kernels", kernels, "--quantization", "none")
    assert out.returncode == 0, out.stderr
    if kernels == "avx512":
        assert "dtype auto: bfloat16; the avx512 kernels compute bf16 natively; CPU kernels avx512" in out.stdout
    else:  # float32 activations over bf16 weights and KV cache: the KV and weight bytes of bf16
        assert ("dtype auto: float32 (weights and KV bfloat16); no native bf16 in the avx2 kernels: float32 math, "
                "bf16 weights and KV cache widened in registers; CPU kernels avx2") in out.stdout
    assert "x 2 bytes = 23,040" in out.stdout and "weight bytes one decode step reads: 269,030,016" in out.stdout


def test_a_cpu_kernel_variant_the_cpu_cannot_run_is_a_one_line_error():
    other = "neon" if platform.machine() != "aarch64" else "avx2"
    out = zhuzi("plan", "--cpu-kernels", other)
    assert out.returncode != 0 and out.stderr.strip().count("\n") == 0
    assert f"cpu_kernels {other} runs on" in out.stderr


def test_a_bad_model_path_is_a_one_line_error():
    out = zhuzi("generate", "--model", "/no/such/model.gguf", "hi")
    assert out.returncode != 0
    assert out.stderr.strip().count("\n") == 0
    assert "/no/such/model.gguf" in out.stderr and "no such file" in out.stderr


@pytest.mark.parametrize(("args", "error"), [
    (["x.gguf", "--models-dir", "."], "one MODEL or --models-dir, not both"),
    (["--models-dir", "/no/such/dir"], "/no/such/dir"),
    (["--models-dir", ".", "--keep-alive", "soon"], "'soon' is not a duration"),
])
def test_a_bad_models_dir_or_keep_alive_is_a_one_line_error(args, error):
    out = zhuzi_here("serve", *args)
    assert out.returncode != 0 and out.stderr.strip().count("\n") == 0
    assert error in out.stderr


def test_a_bad_speculative_config_is_a_one_line_error():
    out = zhuzi_here("generate", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}', "hi")
    assert out.returncode != 0 and out.stderr.strip().count("\n") == 0
    assert "num_speculative_tokens must be an integer in [1, 64], got 0" in out.stderr


@pytest.mark.parametrize("flag, error", [("--tool-call-parser", "no parser 'hermes2'; choose from openai,"),
                                         ("--reasoning-parser", "no parser 'hermes2'; choose from deepseek_r1,")])
def test_a_parser_that_does_not_exist_is_a_one_line_error_before_the_model_loads(flag: str, error: str):
    out = zhuzi_here("serve", "--port", "1", flag, "hermes2")
    assert out.returncode != 0 and out.stderr.strip().count("\n") == 0
    assert error in out.stderr



def gpt2_checkpoint(tmp_path, form: str):
    """A GPT-2, which zhuzi does not run: a Hugging Face directory or a GGUF file (header only suffices)."""
    if form == "directory":
        (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
        return tmp_path, "GPT2LMHeadModel"
    writer = gguf.GGUFWriter(tmp_path / "gpt2.gguf", "gpt2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return tmp_path / "gpt2.gguf", "gpt2"


@pytest.mark.parametrize("command,form", [("generate", "directory"), ("serve", "gguf")])
def test_an_architecture_zhuzi_does_not_run_is_a_one_line_error_listing_those_it_does(tmp_path, command, form):
    path, name = gpt2_checkpoint(tmp_path, form)
    args = ("generate", "--model", str(path), "hi") if command == "generate" else ("serve", str(path), "--port", "1")
    out = (zhuzi if command == "generate" else zhuzi_here)(*args)  # generate: its own process (see the top)
    assert out.returncode != 0 and out.stderr.strip().count("\n") == 0, out.stderr
    assert f"unknown architecture {name}" in out.stderr
    assert all(f.hf_class in out.stderr and f"GGUF {f.gguf_arch}" in out.stderr for f in FAMILIES.values())


def test_plan_of_a_hybrid_counts_attention_layers_kv_and_each_sequences_states(tmp_path):
    """Qwen3.5's shape: one attention layer of four keeps KV; three keep a state per sequence, held twice while
    it runs, and the state slots bound the requests that fit."""
    hf = tiny.build("qwen3_5", tmp_path)
    config = load_model_config(tmp_path)
    assert config.num_parameters == sum(p.numel() for name, p in hf.named_parameters()
                                        if ".q_norm." not in name and ".k_norm." not in name)
    run = zhuzi_here("plan", "--model", str(tmp_path), "--dtype", "float32", "--kv-cache-memory",
                str(9 * config.state_bytes), "--context", "40", "--sequences", "2")
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "KV bytes per token: 2 x 1 layers x 2 kv_heads x 32 head_dim x 4 bytes = 512" in out
    assert f"recurrent state per sequence: 3 layers' states = {config.state_bytes:,} bytes" in out
    assert "and 4 state slots" in out and "requests of 40 tokens that fit at once: 2\n" in out  # pages: 3


def test_models_lists_a_directorys_models_as_a_table_and_the_skipped_files_on_stderr(tmp_path, monkeypatch):
    (tmp_path / "smol.gguf").symlink_to(default_model_path())
    gpt2, _ = gpt2_checkpoint(tmp_path, "gguf")
    (tmp_path / "mmproj-F16.gguf").write_bytes(b"")
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "none"))
    out = zhuzi_here("models", "--models-dir", str(tmp_path), "--models-dir", "ollama")
    assert out.returncode != 0 and out.stderr.strip() == \
        f"zhuzi: error: --models-dir: {tmp_path / 'none' / 'manifests'} is not a directory (Ollama's store, " \
        "$OLLAMA_MODELS or ~/.ollama/models)"
    out = zhuzi_here("models", "--models-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    header, *rows = out.stdout.splitlines()
    assert header.split() == ["ID", "SIZE", "FAMILY", "RUNS", "PATH"]
    assert [row.split()[:5] for row in rows] == [["gpt2", str(gpt2.stat().st_size), "B", "gpt2", "no:"],
                                                 ["smol", "98", "MB", "llama", "yes"]]
    assert rows[0].endswith(str(gpt2)) and "no: unknown architecture gpt2" in rows[0]
    assert out.stderr == f"zhuzi: skipped {tmp_path / 'mmproj-F16.gguf'}: a vision projector (mmproj), loaded " \
                         "with a model, not a model of its own\n"


def test_models_without_a_models_dir_reads_the_stores_a_person_has(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-hub"))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    out = zhuzi_here("models")
    assert out.returncode == 0 and out.stdout.split() == ["ID", "SIZE", "FAMILY", "RUNS", "PATH"]
    assert "no --models-dir given, and no Hugging Face cache or Ollama store here" in out.stderr
    blob = tmp_path / "ollama" / "blobs" / ("sha256-" + "1" * 64)
    blob.parent.mkdir(parents=True)
    blob.symlink_to(default_model_path())
    manifest = tmp_path / "ollama" / "manifests" / "registry.ollama.ai" / "library" / "smollm2" / "latest"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model",
                                                "digest": "sha256:" + "1" * 64}]}))
    out = zhuzi_here("models")
    assert out.returncode == 0 and out.stderr == ""
    assert out.stdout.splitlines()[1].split()[:5] == ["smollm2:latest", "98", "MB", "llama", "yes"]
