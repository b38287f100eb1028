"""Model presets: a TOML file of engine flags per model, read strictly, and the order in which they apply."""
import pytest

from zhuzi.config import EngineConfig, SpeculativeConfig
from zhuzi.presets import Presets

FILE = """
[default]
max-model-len = 8192
kv-cache-memory = "2GiB"
enable-prefix-caching = false

["qwen3:8b"]
max-model-len = 32768
kv-cache-dtype = "q8_0"
block-size = 32
speculative-config = {method = "ngram", num_speculative_tokens = 4}

[embedder]
model = "~/models/qwen3-embedding.gguf"
pooling = "last"
kv-cache-memory = 268435456

[smollm2]
quantization = "int8"
"""


def presets(tmp_path, text: str = FILE) -> Presets:
    (tmp_path / "models.toml").write_text(text)
    return Presets.read(tmp_path / "models.toml")


def test_a_models_table_overrides_default_which_overrides_the_flags_defaults(tmp_path):
    config = presets(tmp_path).engine_config("qwen3:8b")
    assert (config.max_model_len, config.kv_cache_dtype, config.page_size) == (32768, "q8_0", 32)
    assert (config.kv_cache_bytes, config.enable_prefix_caching) == (2 * 2**30, False)  # [default]'s
    assert config.max_num_seqs == EngineConfig().max_num_seqs  # no table sets it
    assert config.speculative == SpeculativeConfig("ngram", 4, 5, 5)  # vLLM's lookup bounds


def test_a_model_without_a_table_takes_default(tmp_path):
    config = presets(tmp_path).engine_config("other")
    assert (config.max_model_len, config.kv_cache_bytes, config.page_size) == (8192, 2 * 2**30, 16)


def test_flags_given_on_the_command_line_win_over_both_tables(tmp_path):
    base = EngineConfig(max_model_len=4096, max_num_seqs=3)
    config = presets(tmp_path).engine_config("qwen3:8b", base, given={"max_model_len", "max_num_seqs"})
    assert (config.max_model_len, config.max_num_seqs, config.page_size) == (4096, 3, 32)
    assert presets(tmp_path).settings("qwen3:8b", {"max_model_len"}).get("max-model-len") is None


def test_a_table_may_name_its_checkpoint_and_ollamas_latest_finds_an_untagged_table(tmp_path):
    p = presets(tmp_path)
    embedder = p.engine_config("embedder")
    assert (embedder.model, embedder.pooling, embedder.kv_cache_bytes) == ("~/models/qwen3-embedding.gguf", "last",
                                                                           2**28)
    assert p.engine_config("smollm2:latest").quantization == "int8"


def test_an_empty_file_changes_nothing(tmp_path):
    assert presets(tmp_path, "").engine_config("any") == EngineConfig()


@pytest.mark.parametrize("text,error", [
    ("[default]\nmax_model_len = 1", "[default] max_model_len: unknown key (did you mean max-model-len?)"),
    ('["qwen3:8b"]\nfrobnicate = 1', '[qwen3:8b] frobnicate: unknown key'),
    ("[default]\nmax-model-len = '8k'", "[default] max-model-len: expected int, got '8k'"),
    ("[default]\nenable-prefix-caching = 1", "[default] enable-prefix-caching: expected bool, got 1"),
    ("[default]\nmax-num-seqs = true", "[default] max-num-seqs: expected int, got True"),
    ("[m]\nkv-cache-dtype = 'q4'", "[m] kv-cache-dtype: 'q4' is not one of auto, bf16, fp32, q8_0"),
    ("[m]\nkv-cache-memory = 'lots'", "[m] kv-cache-memory: cannot read a memory size from 'lots'"),
    ("[m]\nspeculative-config = {method = 'ngram', num_speculative_tokens = 0}",
     "[m] speculative-config: speculative_config: num_speculative_tokens must be an integer in [1, 64], got 0"),
    ("[Qwen3-0.6B]\nblock-size = 8", 'a table inside [Qwen3-0]: quote a model id with dots, ["Qwen3-0.6B"]'),
    ("block-size = 8", "block-size lies outside a table: put it under [default] or a model's table"),
    ("[default]\nmodel = 'x.gguf'", "[default] model: a path belongs in a model's own table"),
    ("[default\n", "not TOML: Expected ']' at the end of a table declaration (at line 1, column 9)"),
])
def test_a_bad_key_or_value_is_one_line_naming_the_file_table_and_key(tmp_path, text, error):
    with pytest.raises(ValueError) as exc:
        presets(tmp_path, text)
    message = str(exc.value)
    assert message.startswith(str(tmp_path / "models.toml")) and error in message and "\n" not in message


def test_settings_wrong_only_together_fail_when_the_model_is_asked_for_naming_its_table(tmp_path):
    p = presets(tmp_path, "[default]\nkv-offload-memory = '1GiB'\n[m]\nenable-prefix-caching = false\n")
    assert p.engine_config("other").kv_tiers
    with pytest.raises(ValueError, match=r"models.toml \[m\]: the KV tiers .* drop --no-enable-prefix-caching"):
        p.engine_config("m")


def test_a_missing_file_is_one_line():
    with pytest.raises(ValueError, match="--models-preset: cannot read /no/such.toml: No such file or directory"):
        Presets.read("/no/such.toml")
