"""Settings and their flags: every EngineConfig / ServerConfig field is a flag with its default and
help, generated, so a new setting is one edit in config.py."""
import argparse
import dataclasses

import pytest
import torch

from zhuzi.cli import build_parser, parse_args, serve_configs
from zhuzi.config import EngineConfig, KVPlan, ParallelConfig, ServerConfig, parse_bytes
from zhuzi.model import native
from zhuzi.model.model_config import ModelConfig
from zhuzi.settings import given


def parsed(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_every_field_is_a_flag_with_its_default():
    args = parsed()
    engine, server = EngineConfig.from_cli_args(args), ServerConfig.from_cli_args(args)
    assert server == ServerConfig()
    # `zhuzi serve` protects running streams from long prompts; everything else is the field's default
    assert dataclasses.replace(engine, long_prefill_token_threshold=0) == EngineConfig()
    assert engine.long_prefill_token_threshold == 128


def test_flags_of_each_kind_reach_their_field():
    args = parsed("/m.gguf", "--max-num-seqs", "3", "--max-model-len", "100", "--no-enable-prefix-caching",
                  "--quantization", "int8", "--api-key", "a", "--api-key", "b", "--rate-limit-rpm", "5",
                  "--kv-cache-memory", "2GiB")
    engine, server = EngineConfig.from_cli_args(args), ServerConfig.from_cli_args(args)
    assert (engine.model, engine.max_num_seqs, engine.max_model_len) == ("/m.gguf", 3, 100)
    assert (engine.enable_prefix_caching, engine.quantization, engine.kv_cache_bytes) == (False, "int8", 2 * 2**30)
    assert (server.api_keys, server.rate_limit_rpm) == (["a", "b"], 5)


def test_models_dir_is_repeatable_and_reaches_the_server_config():
    server = ServerConfig.from_cli_args(parsed("--models-dir", "/models", "--models-dir", "hf"))
    assert server.models_dirs == ["/models", "hf"] and ServerConfig().models_dirs == []


def test_given_names_the_settings_the_command_line_sets_even_to_their_defaults():
    argv = ["serve", "/m.gguf", "--max-num-seqs", "64", "--no-enable-prefix-caching", "--block-size", "8"]
    assert given(build_parser(), argv) == {"command", "model", "max_num_seqs", "enable_prefix_caching", "page_size"}
    assert build_parser().parse_args(argv).max_model_len is None  # the parser itself keeps its defaults


def test_serve_applies_the_served_models_preset_beneath_the_flags_given(tmp_path):
    """The table of the model as clients name it (--served-model-name, else the file's name) over [default]."""
    preset = tmp_path / "models.toml"
    preset.write_text("[default]\nmax-model-len = 2048\nmax-num-seqs = 8\n"
                      "[m]\nmax-model-len = 8192\nkv-cache-memory = '256MiB'\n"
                      "[coder]\nmodel = '/models/coder.gguf'\nblock-size = 32\n")
    (model := tmp_path / "m.Q4_K_M.gguf").touch()
    m, flags = str(model), ["--models-preset", str(preset)]
    server, engine = serve_configs(parse_args(["serve", m, *flags, "--max-num-seqs", "2"]))
    assert server.models_preset == str(preset)
    assert (engine.max_model_len, engine.kv_cache_bytes, engine.max_num_seqs) == (8192, 2**28, 2)
    _, engine = serve_configs(parse_args(["serve", m, *flags, "--max-model-len", "512"]))
    assert (engine.max_model_len, engine.max_num_seqs) == (512, 8)
    _, engine = serve_configs(parse_args(["serve", m, *flags, "--served-model-name", "other"]))
    assert (engine.max_model_len, engine.kv_cache_memory) == (2048, "1GiB")  # [default]'s only
    server, engine = serve_configs(parse_args(["serve", "coder", *flags]))  # MODEL names a table naming its file
    assert (engine.model, engine.page_size, server.served_model_name) == ("/models/coder.gguf", 32, "coder")
    assert serve_configs(parse_args(["serve", m]))[1].max_model_len is None  # no preset, no change


def test_the_page_size_keeps_vllms_flag():
    assert EngineConfig.from_cli_args(parsed("--block-size", "32")).page_size == 32


def test_a_bad_choice_is_refused_by_the_parser():
    with pytest.raises(SystemExit):
        parsed("--quantization", "int3")


def test_help_shows_each_setting_with_its_help_text(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for f in dataclasses.fields(EngineConfig):
        assert f.metadata.get("flags", ["--" + f.name.replace("_", "-")])[0] in help_text
        assert " ".join(f.metadata["help"].split())[:30] in help_text


def test_a_new_setting_is_one_field():
    @dataclasses.dataclass
    class Extended(EngineConfig):
        draft_tokens: int = dataclasses.field(default=4, metadata={"help": "tokens to guess"})

    parser = argparse.ArgumentParser()
    Extended.add_cli_args(parser)
    assert Extended.from_cli_args(parser.parse_args(["--draft-tokens", "7"])).draft_tokens == 7


def test_the_kv_plan_is_the_one_arithmetic():
    smol = ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64)
    plan = KVPlan.of(smol, torch.bfloat16, parse_bytes("4GiB"), 16)
    assert plan.bytes_per_token == 2 * 30 * 3 * 64 * 2 == 23040
    assert (plan.num_pages, plan.capacity_tokens) == (11650, 186400)
    assert EngineConfig(kv_cache_memory="4GiB").kv_plan(smol) == plan
    q8 = EngineConfig(kv_cache_memory="4GiB", kv_cache_dtype="q8_0").kv_plan(smol)
    assert q8.bytes_per_token == 2 * 30 * 3 * (64 + 4) == 12240  # values and an fp16 scale per 32 of them
    assert plan.sequence_tokens(4000) == 4000 and plan.sequence_tokens(4001) == 4016


def test_the_gpu_plan_is_the_seeds_safe_tokens_arithmetic():
    """The seed's example: a 7B of 32 layers, 32 KV heads of 128, fp16 KV, 18 GiB free of a 24 GiB card: (18 -
    0.5) GiB / (2 x 32 x 32 x 128 x 2) bytes. With 16 layers on the GPU, its half of each token's KV only."""
    llama7b = ModelConfig("llama", 32000, 4096, 11008, 32, 32, 32, 128)
    whole = EngineConfig(device="cuda", gpu_memory_utilization=1.0).gpu_plan(llama7b, 24 * 2**30, 6 * 2**30)
    assert whole.kv_bytes_per_token == 2 * 32 * 32 * 128 * 2 == 524288
    assert whole.tokens == int(17.5 * 2**30) // 524288 == 35840
    half = EngineConfig(device="cuda", gpu_memory_utilization=1.0, n_gpu_layers=16)
    gpu = half.gpu_plan(llama7b, 24 * 2**30, 6 * 2**30)
    assert (gpu.kv_bytes_per_token, gpu.tokens) == (262144, 71680)
    assert half.kv_plan(llama7b, gpu).num_pages == 71680 // 16  # the CPU's 16 layers hold the same pages
    assert EngineConfig(device="cpu").gpu_plan(llama7b, 24 * 2**30, 0) is None
    assert EngineConfig(device="cuda", n_gpu_layers=0).gpu_plan(llama7b, 24 * 2**30, 0) is None
    full = EngineConfig(device="cuda").gpu_plan(llama7b, 24 * 2**30, 22 * 2**30)  # 0.9 x 24 < 22 + 0.5
    with pytest.raises(ValueError, match=r"^the GPU's share \(0.9 of 24.0 GiB\) holds the weights of 32 layers "
                                         r"\(22.00 GiB\) and a 0.5 GiB reserve but no KV page: lower --n-gpu-layers"):
        full.check(16, 32)


def test_a_sliding_window_model_holds_its_window_and_a_page_per_sequence():
    """Window 4096 (Mistral 7B v0.1), pages of 16: the next token reads 4095 back, 256 pages, and writes in one
    more. With a full layer among the sliding ones every page stays in some window."""
    mistral = ModelConfig("mistral", 32000, 4096, 14336, 32, 32, 8, 128, sliding_window=4096)
    plan = KVPlan.of(mistral, torch.bfloat16, parse_bytes("4GiB"), 16)
    assert plan.window == 4096
    assert (plan.sequence_tokens(1000), plan.sequence_tokens(4096), plan.sequence_tokens(32768)) == (1008, 4096, 4112)
    mixed = dataclasses.replace(mistral, layer_types=["full_attention"] + ["sliding_attention"] * 31)
    assert KVPlan.of(mixed, torch.bfloat16, parse_bytes("4GiB"), 16).sequence_tokens(32768) == 32768


def test_keyed_settings_name_keys_and_read_the_quota_file(tmp_path):
    quota_file = tmp_path / "quotas.txt"
    quota_file.write_text("# team quotas\nb=5000  # bob\n\n")
    args = parsed("--api-key", "a", "--api-key", "b", "--tenant-weights", "a=2.5", "--quota-tokens-per-day", "a=100",
                  "--quota-file", str(quota_file), "--scheduling-policy", "priority")
    server = ServerConfig.from_cli_args(args)
    assert (server.weights, server.quotas) == ({"a": 2.5}, {"a": 100, "b": 5000})
    assert EngineConfig.from_cli_args(args).scheduling_policy == "priority"
    for bad, why in [(["--tenant-weights", "c=2"], "not one of the --api-key keys"),
                     (["--tenant-weights", "a"], "takes KEY=VALUE"),
                     (["--quota-tokens-per-day", "a=0"], "must be a positive int"),
                     (["--quota-file", str(tmp_path / "missing.txt")], "cannot read")]:
        with pytest.raises(ValueError, match=why):
            ServerConfig.from_cli_args(parsed("--api-key", "a", *bad))


def test_data_parallelism_needs_engine_processes():
    with pytest.raises(ValueError, match="--data-parallel-size needs the engine cores in processes of their own"):
        ParallelConfig(data_parallel_size=2, engine_process=False)
    with pytest.raises(ValueError, match="at least 1"):
        ParallelConfig(data_parallel_size=0)
    assert ParallelConfig(data_parallel_size=2).engine_process


@pytest.mark.parametrize("kernels", [v.name for v in native.runnable()] + ["torch"])
def test_dtype_auto_follows_the_cpu_kernels(kernels):
    """bf16 where the variant computes it natively; elsewhere float32 math over bf16 weights and KV cache."""
    p = EngineConfig(cpu_kernels=kernels).precision
    if native.native_bf16(kernels):
        assert (p.weights, p.compute, p.kv, str(p)) == (torch.bfloat16,) * 3 + ("bfloat16",)
    else:
        assert (p.weights, p.compute, p.kv) == (torch.bfloat16, torch.float32, torch.bfloat16)
        assert str(p) == "float32 (weights and KV bfloat16)" and "no native bf16" in p.reason
    assert EngineConfig(cpu_kernels=kernels, device="cuda").precision.compute == torch.bfloat16
    assert EngineConfig(cpu_kernels=kernels, dtype="float32").precision.kv == torch.float32  # the reference


def test_a_cpu_kernel_variant_is_checked_when_the_config_is_made():
    with pytest.raises(ValueError, match="unknown cpu_kernels 'avx3'"):
        EngineConfig(cpu_kernels="avx3")
    with pytest.raises(ValueError, match="unknown dtype 'bf8'"):
        EngineConfig(dtype="bf8")


def test_kv_tiers_and_hand_offs_refuse_what_they_cannot_serve():
    with pytest.raises(ValueError, match="prefix cache"):
        EngineConfig(kv_offload_memory="1GiB", enable_prefix_caching=False)
    with pytest.raises(ValueError, match="--tensor-parallel-size 1"):
        EngineConfig(kv_offload_dir="kv", tensor_parallel_size=2)
    roles = ParallelConfig(data_parallel_size=2, kv_role="prefill,decode")
    with pytest.raises(ValueError, match="--tensor-parallel-size 1"):
        roles.check(EngineConfig(tensor_parallel_size=2))
    with pytest.raises(ValueError, match="prefix cache"):
        roles.check(EngineConfig(enable_prefix_caching=False))
    ParallelConfig(data_parallel_size=2).check(EngineConfig(tensor_parallel_size=2, enable_prefix_caching=False))
