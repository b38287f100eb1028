"""Checkpoint loading: HF safetensors directories and GGUF files -> ModelConfig + HF-named tensors."""
import copy
import json
import math
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import tiny
import torch
import transformers
from safetensors.torch import load_file, save_file
from tiny import llama_cpp_permute, reference_tensors, write_gguf

from zhuzi.model.blocks import BlockWeight
from zhuzi.model.families import supported_families
from zhuzi.model.layers import rope_attention_factor
from zhuzi.model.loader import Checkpoint, CheckpointError, load_checkpoint, load_model_config

MODEL_CLASSES = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
                 "qwen3": transformers.Qwen3ForCausalLM, "mistral": transformers.MistralForCausalLM,
                 "phi3": transformers.Phi3ForCausalLM, "gemma3": transformers.Gemma3ForCausalLM}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
DOWN_PROJ = "model.layers.0.mlp.down_proj.weight"  # (64, 256): one 256-wide block per row, fits K-quants


pytestmark = pytest.mark.usefixtures("own_cache")  # loading a GGUF should make no entry


def made_entries(cache: Path) -> set[Path]:
    """What the cache holds besides the kernels (shared with other test processes, which may build them now)."""
    return {path for path in cache.rglob("*") if path.relative_to(cache).parts[0] != "kernels"}


def tiny_model(arch: str, **overrides) -> transformers.PreTrainedModel:
    cls = MODEL_CLASSES[arch]
    config = cls.config_class(hidden_size=64, num_hidden_layers=2, vocab_size=1000, num_attention_heads=4,
                              num_key_value_heads=2, intermediate_size=256, bos_token_id=1, eos_token_id=2,
                              max_position_embeddings=16384, **copy.deepcopy(overrides))  # HF edits dicts in place
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():  # HF initialises norms to ones; random values expose any mix-up of names
        for parameter in model.parameters():
            parameter.normal_(0, 0.02)
    return model


def assert_same_tensors(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(loaded) == sorted(expected)
    for name, tensor in expected.items():
        assert loaded[name].shape == tensor.shape, name
        assert torch.equal(loaded[name], tensor.to(loaded[name].dtype)), name


def unpermute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of llama_cpp_permute: back to Hugging Face's rotate-half order."""
    return weight.reshape(heads, -1, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def values(tensors: dict) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors with GGUF blocks replaced by their exact values."""
    return {name: t.dequantize() if isinstance(t, BlockWeight) else t for name, t in tensors.items()}


def file_order(model, arch: str) -> dict[str, torch.Tensor]:
    """The reference tensors in a GGUF file's row order: llama's Q/K rows permuted."""
    heads = {"q_proj": model.config.num_attention_heads, "k_proj": model.config.num_key_value_heads}
    return {name: torch.from_numpy(llama_cpp_permute(t.numpy(), heads[name.split(".")[-2]]))
            if arch == "llama" and name.split(".")[-2] in heads else t for name, t in reference_tensors(model).items()}


def error_message(path: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, torch.float32)
    message = str(info.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------- Hugging Face directories

HF_CASES = {
    "llama": ({"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0},
              {"head_dim": 16, "attention_bias": False, "qk_norm": False, "rope_theta": 500000.0}),
    "qwen2": ({}, {"head_dim": 16, "attention_bias": True, "qk_norm": False, "rope_scaling": None,
                   "sliding_window": None}),
    "qwen3": ({"head_dim": 32}, {"head_dim": 32, "attention_bias": False, "qk_norm": True}),
    "mistral": ({"sliding_window": 24}, {"head_dim": 16, "attention_bias": False, "sliding_window": 24,
                                         "layer_types": None, "kv_window": 24}),
}


@pytest.mark.parametrize("arch", HF_CASES)
def test_hf_directory_gives_transformers_tensors_and_config(tmp_path, arch):
    overrides, expected_config = HF_CASES[arch]
    model = tiny_model(arch, **overrides)
    model.generation_config.eos_token_id = [2, 7]
    model.save_pretrained(tmp_path)

    checkpoint = load_checkpoint(tmp_path, torch.float32)

    assert_same_tensors(checkpoint.tensors, reference_tensors(model))
    config = checkpoint.config
    assert (config.architecture, config.vocab_size, config.hidden_size, config.num_layers) == (arch, 1000, 64, 2)
    assert (config.num_heads, config.num_kv_heads, config.intermediate_size) == (4, 2, 256)
    assert {key: getattr(config, key) for key in expected_config} == expected_config
    assert config.eos_token_ids == [2, 7] and config.bos_token_id == 1
    assert checkpoint.path == tmp_path.resolve()
    assert load_model_config(tmp_path) == config


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_slides_from_max_window_layers_on_when_asked(tmp_path, arch):
    """As transformers reads it: use_sliding_window turns the window on for the layers from max_window_layers on."""
    tiny_model(arch, use_sliding_window=True, sliding_window=8, max_window_layers=1).save_pretrained(tmp_path)
    config = load_model_config(tmp_path)
    assert [config.window(i) for i in range(2)] == [None, 8]
    assert config.kv_window is None  # layer 0 reads everything: no block falls out of every window


def test_llama3_rope_scaling_is_passed_through(tmp_path):
    tiny_model("llama", rope_scaling=LLAMA3_ROPE, rope_theta=500000.0).save_pretrained(tmp_path)
    assert load_model_config(tmp_path).rope_scaling == LLAMA3_ROPE


def test_tied_embeddings_have_no_lm_head(tmp_path):
    model = tiny_model("llama", tie_word_embeddings=True)
    model.save_pretrained(tmp_path)
    checkpoint = load_checkpoint(tmp_path, torch.float32)
    assert checkpoint.config.tie_word_embeddings
    assert_same_tensors(checkpoint.tensors, reference_tensors(model))


def test_sharded_checkpoint_loads_every_shard(tmp_path):
    model = tiny_model("qwen2")
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    assert_same_tensors(load_checkpoint(tmp_path, torch.float32).tensors, reference_tensors(model))


def test_default_dtype_is_bfloat16(tmp_path):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path)
    tensors = load_checkpoint(tmp_path).tensors
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert_same_tensors(tensors, reference_tensors(model))


def test_config_needs_no_tensor_data(tmp_path):
    tiny_model("qwen3", head_dim=32).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    assert load_model_config(tmp_path).head_dim == 32


# ---------------------------------------------------------------- GGUF files

@pytest.mark.parametrize("arch,tied", [("llama", True), ("qwen2", False), ("qwen3", False)])
def test_gguf_gives_hf_names_file_order_tensors_and_config(tmp_path, arch, tied):
    model = tiny_model(arch, tie_word_embeddings=tied, **HF_CASES[arch][0])
    path = write_gguf(tmp_path / "tiny.gguf", model, arch)

    checkpoint = load_checkpoint(path, torch.float32)

    assert_same_tensors(checkpoint.tensors, file_order(model, arch))
    config = checkpoint.config
    assert config.rope_interleaved == (arch == "llama")  # llama's Q/K rows rotate as the file orders them
    shape = (config.architecture, config.vocab_size, config.num_layers, config.tie_word_embeddings)
    assert shape == (arch, 1000, 2, tied)
    assert (config.head_dim, config.attention_bias, config.qk_norm) == (
        HF_CASES[arch][1]["head_dim"], arch == "qwen2", arch == "qwen3")
    assert (config.rope_theta, config.max_position_embeddings) == (50000.0, 16384)
    assert config.eos_token_ids == [2, 7] and config.bos_token_id == 1
    assert load_model_config(path) == config


def test_gguf_mistral_as_llama_cpp_writes_it_attends_everything_and_a_window_key_is_honoured(tmp_path):
    """llama.cpp's converter writes Mistral as llama and drops its window (llama.cpp then attends whole
    contexts); a file that carries {arch}.attention.sliding_window, and a pattern of sliding layers, slides."""
    model = tiny_model("mistral", sliding_window=24)
    assert load_model_config(write_gguf(tmp_path / "plain.gguf", model, "llama")).sliding_window is None
    config = load_model_config(write_gguf(tmp_path / "window.gguf", model, "llama", sliding_window=24))
    assert (config.architecture, config.kv_window) == ("llama", 24)
    path = write_gguf(tmp_path / "pattern.gguf", tiny_model("qwen2"), "qwen2", sliding_window=8,
                      sliding_window_pattern=[False, True])
    config = load_model_config(path)
    assert [config.window(i) for i in range(2)] == [None, 8]


@pytest.mark.parametrize(("pooling_type", "pooling"), [(None, None), (1, "mean"), (3, "last"), (0, None)])
def test_an_embedding_gguf_says_how_to_pool(tmp_path, pooling_type, pooling):
    path = write_gguf(tmp_path / "tiny.gguf", tiny_model("qwen3", **HF_CASES["qwen3"][0]), "qwen3",
                      pooling_type=pooling_type)
    assert load_model_config(path).pooling == pooling


@pytest.mark.parametrize(("modes", "pooling"), [({"pooling_mode_lasttoken": True}, "last"),
                                                ({"pooling_mode_mean_tokens": True}, "mean"), (None, None)])
def test_a_sentence_transformers_directory_says_how_to_pool(tmp_path, modes, pooling):
    tiny_model("qwen3").save_pretrained(tmp_path)
    if modes is not None:
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(modes))
    assert load_model_config(tmp_path).pooling == pooling


ROUND_TRIP_TOLERANCE = {  # max |error| relative to the largest weight
    "F32": 0.0, "F16": 1e-3, "BF16": 1e-2, "Q8_0": 1e-2,
    "Q5_0": 0.05, "Q5_1": 0.05, "Q4_0": 0.1, "Q4_1": 0.1,
}


@pytest.mark.parametrize("type_name", ROUND_TRIP_TOLERANCE)
def test_gguf_quant_types_round_trip(tmp_path, type_name):
    qtype = gguf.GGMLQuantizationType[type_name]
    model = tiny_model("llama")
    weight = model.state_dict()[DOWN_PROJ].numpy()
    quantized = gguf.quants.quantize(weight, qtype)
    path = write_gguf(tmp_path / "q.gguf", model, "llama", raw={DOWN_PROJ: (quantized, qtype)})

    loaded = values(load_checkpoint(path, torch.float32).tensors)[DOWN_PROJ].numpy()

    assert np.array_equal(loaded, gguf.quants.dequantize(quantized.view(np.uint8), qtype))
    assert np.abs(loaded - weight).max() <= ROUND_TRIP_TOLERANCE[type_name] * np.abs(weight).max()


def k_quant_rows(type_name: str, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Hand-built K-quant super-blocks (256 weights each, one per row; the gguf package cannot
    quantize these types) and the values llama.cpp's block layout says they hold. Every quant byte
    is 0x21, so the two nibbles (1 and 2) and every sub-block scale show up in distinct places."""
    blocks, expected = [], []
    sub = np.arange(8)
    # 6-bit scales and mins of 8 sub-blocks packed into 12 bytes: scale j = j+1, min j = 8-j.
    packed = np.array([1, 2, 3, 4, 8, 7, 6, 5, 5 | 4 << 4, 6 | 3 << 4, 7 | 2 << 4, 8 | 1 << 4], np.uint8)
    for row in range(rows):
        d, dmin = np.float16((row + 1) / 64), np.float16(0.25)
        if type_name == "Q6_K":  # ql[128] qh[64] scales[16] d; value = d * scale[i // 16] * (q - 32)
            scales = np.arange(1, 17, dtype=np.int8)
            blocks.append(np.concatenate([np.full(128, 0x21, np.uint8), np.zeros(64, np.uint8),
                                          scales.view(np.uint8), np.array([d]).view(np.uint8)]))
            q = np.where(np.arange(256) % 128 < 64, 1, 2)
            expected.append(np.float32(d) * np.repeat(scales, 16) * (q - 32))
            continue
        if type_name in ("Q3_K", "Q2_K"):
            blocks.append(two_bit_block(type_name, d, dmin))
            expected.append(two_bit_values(type_name, d, dmin))
            continue
        high = [np.full(32, 0xFF, np.uint8)] if type_name == "Q5_K" else []  # Q5_K: qh adds 16 to every q
        blocks.append(np.concatenate([np.array([d, dmin]).view(np.uint8), packed, *high, np.full(128, 0x21, np.uint8)]))
        q = np.where(sub % 2 == 0, 1, 2) + (16 if high else 0)
        expected.append(np.repeat(np.float32(d) * (sub + 1) * q - np.float32(dmin) * (8 - sub), 32))
    return np.stack(blocks), np.stack(expected).astype(np.float32)


def two_bit_block(type_name: str, d: np.float16, dmin: np.float16) -> np.ndarray:
    """A Q3_K (hmask[32] qs[64] scales[12] d) or Q2_K (scales[16] qs[64] d dmin) block: qs bytes 0x21 give
    2-bit codes 1, 0, 2, 0 to the four 32-weight quarters of each half; Q3_K's hmask 0x55 sets the third bit of
    every other 32 weights, and its sub-block g's 6-bit scale is 4g + 1 (stored plus 32); Q2_K's sub-block g
    has scale g % 15 + 1 and minimum 15 - g."""
    qs = np.full(64, 0x21, np.uint8)
    g = np.arange(16)
    if type_name == "Q2_K":
        return np.concatenate([((g % 15 + 1) | (15 - g) << 4).astype(np.uint8), qs, np.array([d, dmin]).view(np.uint8)])
    six = 4 * g + 1
    scales = np.zeros(12, np.uint8)
    for j in range(16):  # low nibbles in bytes 0-7 (j < 8 low, else high), top 2 bits in bytes 8-11
        scales[j % 8] |= (six[j] & 15) << (4 * (j // 8))
        scales[8 + j % 4] |= (six[j] >> 4) << (2 * (j // 4))
    return np.concatenate([np.full(32, 0x55, np.uint8), qs, scales, np.array([d]).view(np.uint8)])


def two_bit_values(type_name: str, d: np.float16, dmin: np.float16) -> np.ndarray:
    """The 256 values of two_bit_block()'s block, as llama.cpp's layout reads them."""
    i = np.arange(256)
    q, g = np.array([1, 0, 2, 0])[i % 128 // 32], i // 16
    if type_name == "Q2_K":
        return np.float32(d) * (g % 15 + 1) * q - np.float32(dmin) * (15 - g)
    third = i // 32 % 2 == 0  # hmask 0x55: bit k of every byte set for even k
    return np.float32(d) * (4 * g + 1 - 32) * (q + 4 * third - 4)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K"])
def test_gguf_k_quants_dequantize_to_their_encoded_values(tmp_path, type_name):
    qtype = gguf.GGMLQuantizationType[type_name]
    raw, expected = k_quant_rows(type_name, rows=64)
    assert raw.shape[1] == gguf.GGML_QUANT_SIZES[qtype][1]
    path = write_gguf(tmp_path / "k.gguf", tiny_model("llama"), "llama", raw={DOWN_PROJ: (raw, qtype)})

    loaded = values(load_checkpoint(path, torch.float32).tensors)[DOWN_PROJ].numpy()

    np.testing.assert_allclose(loaded, expected, rtol=1e-6)


def test_gguf_blocks_are_read_in_place(tmp_path, own_cache):
    """Quantized matrices are views of the mapped file: no copy, no converted cache."""
    model = tiny_model("qwen2")
    quantized = gguf.quants.quantize(model.state_dict()[DOWN_PROJ].numpy(), gguf.GGMLQuantizationType.Q8_0)
    path = write_gguf(tmp_path / "mapped.gguf", model, "qwen2",
                      raw={DOWN_PROJ: (quantized, gguf.GGMLQuantizationType.Q8_0)})
    before = made_entries(own_cache)

    weight = load_checkpoint(path).tensors[DOWN_PROJ]

    assert isinstance(weight, BlockWeight) and weight.shape == (64, 256)
    assert weight.data.untyped_storage().nbytes() == path.stat().st_size  # the whole file, mapped
    assert weight.data.numpy().tobytes() == quantized.tobytes()
    assert made_entries(own_cache) == before


# ---------------------------------------------------------------- the embedded SmolLM2

@pytest.fixture(scope="module")
def smollm2(smollm2_path) -> Checkpoint:
    return load_checkpoint(smollm2_path, torch.float32)


def test_smollm2_config(smollm2, smollm2_path):
    config = smollm2.config
    assert config.architecture == "llama" and smollm2.path == smollm2_path
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.tie_word_embeddings, config.rope_theta) == (49152, True, 100000.0)
    assert 2 in config.eos_token_ids and config.max_position_embeddings == 8192
    assert load_model_config(smollm2_path) == config


def test_smollm2_tensors_equal_transformers_gguf_load(smollm2, hf_smollm2):
    """transformers dequantizes the same file and un-permutes Q/K: the same values, Q/K rows reordered."""
    heads = {"q_proj": 9, "k_proj": 3}
    ours = {name: unpermute(t, heads[name.split(".")[-2]]) if name.split(".")[-2] in heads else t
            for name, t in values(smollm2.tensors).items()}
    assert_same_tensors(ours, reference_tensors(hf_smollm2))


# ---------------------------------------------------------------- errors

def test_error_missing_path(tmp_path):
    assert "no such file" in error_message(tmp_path / "nowhere")


def test_error_directory_without_config(tmp_path):
    assert "no config.json" in error_message(tmp_path) and str(tmp_path) in error_message(tmp_path)


def test_error_config_not_json(tmp_path):
    (tmp_path / "config.json").write_text("{'architectures': ")
    message = error_message(tmp_path)
    assert "not valid JSON" in message and str(tmp_path / "config.json") in message


def test_error_no_safetensors(tmp_path):
    tiny_model("llama").config.save_pretrained(tmp_path)
    message = error_message(tmp_path)
    assert "no *.safetensors" in message and str(tmp_path) in message


def test_error_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    message = error_message(tmp_path)
    assert "unknown architecture GPT2LMHeadModel; zhuzi runs LlamaForCausalLM (GGUF llama)" in message
    assert supported_families() in message and "config.json" in message


def test_error_truncated_safetensors(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    message = error_message(tmp_path)
    assert "truncated" in message and str(file) in message


def test_error_missing_tensor_in_safetensors(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, file)
    assert "missing tensor model.layers.1.mlp.up_proj.weight" in error_message(tmp_path)


def test_error_gguf_bad_magic(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGML" + bytes(1000))
    message = error_message(path)
    assert "not a GGUF file" in message and str(path) in message


@pytest.mark.parametrize("keep", [0.5, 0.01])  # tensor data cut off; header cut off
def test_error_truncated_gguf(tmp_path, keep):
    path = write_gguf(tmp_path / "model.gguf", tiny_model("llama"), "llama")
    path.write_bytes(path.read_bytes()[: int(path.stat().st_size * keep)])
    message = error_message(path)
    assert "truncated" in message and str(path) in message


@pytest.mark.parametrize("keep", [300_000, 1_200_000])  # inside the tokens' strings, inside the merges'
def test_error_a_download_cut_off_in_its_vocabulary(tmp_path, smollm2_path, keep):
    path = tmp_path / "partial.gguf"
    path.write_bytes(smollm2_path.read_bytes()[:keep])
    message = error_message(path)
    assert "truncated" in message and str(path) in message


def test_error_gguf_tensor_of_a_type_zhuzi_neither_computes_nor_dequantizes(tmp_path):
    qtype = gguf.GGMLQuantizationType.Q8_1  # llama.cpp's activation type: no kernel, no gguf dequantizer
    rows, cols = tiny_model("llama").state_dict()[DOWN_PROJ].shape
    raw = np.zeros((rows, cols // 32 * gguf.GGML_QUANT_SIZES[qtype][1]), np.uint8)
    path = write_gguf(tmp_path / "model.gguf", tiny_model("llama"), "llama", raw={DOWN_PROJ: (raw, qtype)})
    message = error_message(path)
    assert "tensor blk.0.ffn_down.weight is Q8_1" in message and str(path) in message


def test_error_gguf_tensor_of_a_type_id_gguf_does_not_know(tmp_path):
    path = write_gguf(tmp_path / "model.gguf", tiny_model("llama"), "llama")
    data = bytearray(path.read_bytes())
    name = b"blk.0.ffn_down.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)  # then n_dims, the dims, the type id
    at += 4 + 8 * struct.unpack_from("<I", data, at)[0]
    data[at:at + 4] = struct.pack("<I", 99)
    path.write_bytes(data)
    message = error_message(path)
    assert "tensor blk.0.ffn_down.weight is of ggml type 99" in message and "corrupt" not in message


def test_error_gguf_unknown_architecture(tmp_path):
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    message = error_message(path)
    assert "unknown architecture gpt2" in message and supported_families() in message


PHI4_MINI_ROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.5, 4.0], "long_factor": [1.0, 2.0, 6.0, 9.5]}


def test_phi3_keeps_its_fused_tensors_and_reads_longrope_from_either_form(tmp_path):
    """Phi-4-mini's shape of Phi-3 (LongRoPE over a part of each head, tied embeddings) plus Phi-3-mini's
    sliding window: the Hugging Face directory and llama.cpp's GGUF give the same tensors (qkv_proj and
    gate_up_proj as stored; llama.cpp permutes no Phi-3 rows) and the same RoPE as transformers'."""
    model = tiny_model("phi3", pad_token_id=None, partial_rotary_factor=0.5, rope_scaling=PHI4_MINI_ROPE,
                       original_max_position_embeddings=4096, sliding_window=2047, tie_word_embeddings=True)
    model.save_pretrained(tmp_path / "hf")
    directory = load_checkpoint(tmp_path / "hf", torch.float32)
    file = load_checkpoint(write_gguf(tmp_path / "phi3.gguf", model, "phi3"), torch.float32)
    for checkpoint in (directory, file):
        assert_same_tensors(checkpoint.tensors, reference_tensors(model))
        config = checkpoint.config
        assert (config.architecture, config.rotary_dim, config.sliding_window) == ("phi3", 8, 2047)
        assert config.tie_word_embeddings and not config.rope_interleaved
        scaling = config.rope_scaling
        assert (scaling["rope_type"], scaling["original_max_position_embeddings"]) == ("longrope", 4096)
        assert scaling["short_factor"] == PHI4_MINI_ROPE["short_factor"]  # exact in float32 too
        assert scaling["long_factor"] == PHI4_MINI_ROPE["long_factor"]
        assert rope_attention_factor(scaling) == pytest.approx(model.model.rotary_emb.attention_scaling, rel=1e-6)
    stretch = math.sqrt(1 + math.log(4) / math.log(4096))  # 16,384 positions over the original 4,096
    assert rope_attention_factor(directory.config.rope_scaling) == pytest.approx(stretch)


def test_phi3_reads_the_older_su_rope_scaling(tmp_path):
    """Phi-3-mini-128k's config.json as published: rope_scaling of type "su", the original context beside it."""
    tiny_model("phi3", pad_token_id=None).config.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("rope_parameters")
    raw |= {"rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
            "original_max_position_embeddings": 4096, "max_position_embeddings": 131072}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    scaling = load_model_config(tmp_path).rope_scaling
    assert (scaling["rope_type"], scaling["original_max_position_embeddings"], scaling["factor"]) == (
        "longrope", 4096, 32.0)
    raw["rope_scaling"] = {"type": "yarn", "factor": 32.0}  # no factors: nothing LongRoPE can turn by
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert "Phi-3's rope_scaling (LongRoPE) needs short_factor and long_factor" in error_message(tmp_path)


def test_error_missing_tensor_in_gguf(tmp_path):
    path = write_gguf(tmp_path / "model.gguf", tiny_model("qwen3", head_dim=32), "qwen3", drop=("blk.1.ffn_up.weight",))
    assert "missing tensor model.layers.1.mlp.up_proj.weight" in error_message(path)


# ---------------------------------------------------------------- Gemma 3

GEMMA3 = {key: value for key, value in tiny.GEMMA3.items() if key != "num_hidden_layers"}  # 2 layers, both local
GEMMA3_FIELDS = ("architecture", "num_layers", "head_dim", "rope_theta", "rope_local_theta", "layer_types",
                 "sliding_window", "query_pre_attn_scalar", "embedding_scale", "norm_weight_offset",
                 "sandwich_norms", "hidden_act", "qk_norm", "tie_word_embeddings", "final_logit_softcapping")


def test_gemma3_gguf_gives_the_directorys_config_and_tensors(tmp_path):
    """llama.cpp's file stores each norm as (1 + w): loaded back as transformers' w; its other matrices as they
    are (Gemma's Q/K are not permuted); what the file does not say is llama.cpp's fixed Gemma 3 values."""
    model = tiny_model("gemma3", **GEMMA3)
    model.save_pretrained(tmp_path)
    directory = load_checkpoint(tmp_path, torch.float32)
    from_file = load_checkpoint(write_gguf(tmp_path / "tiny.gguf", model, "gemma3"), torch.float32)
    expected = reference_tensors(model)
    assert_same_tensors(directory.tensors, expected)
    norms = {name for name in expected if name.endswith("norm.weight")}
    assert_same_tensors({k: v for k, v in from_file.tensors.items() if k not in norms},
                        {k: v for k, v in expected.items() if k not in norms})
    for name in norms:  # (1 + w) - 1 in float32: w to within 1 + w's rounding
        assert (from_file.tensors[name] - expected[name]).abs().max() < 1e-6, name
    assert {f: getattr(from_file.config, f) for f in GEMMA3_FIELDS} == \
        {f: getattr(directory.config, f) for f in GEMMA3_FIELDS}
    assert directory.config.layer_types == ["sliding_attention"] * 2 and directory.config.window(1) == 512


def test_gemma3_hub_config_keys(tmp_path):
    """The Hub's config.json (before transformers 5): rope_theta, rope_local_base_freq, rope_scaling for the
    global layers, sliding_window_pattern, and tie_word_embeddings left to its default (tied)."""
    tiny_model("gemma3", **GEMMA3).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    for key in ("rope_parameters", "layer_types", "tie_word_embeddings"):
        raw.pop(key)
    raw |= {"rope_theta": 1e6, "rope_local_base_freq": 10000.0, "sliding_window_pattern": 3,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = load_model_config(tmp_path)
    assert (config.rope_theta, config.rope_local_theta, config.tie_word_embeddings) == (1e6, 10000.0, True)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert config.layer_types == ["sliding_attention", "sliding_attention"]  # a global layer every third
    raw |= {"num_hidden_layers": 3}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert load_model_config(tmp_path).window(2) is None


def test_error_gemma2_style_attention_softcapping(tmp_path):
    tiny_model("gemma3", **GEMMA3, attn_logit_softcapping=50.0).save_pretrained(tmp_path)
    message = error_message(tmp_path)
    assert "config.json" in message and "gemma3 with attn_logit_softcapping=50.0 is not supported" in message


# ---------------------------------------------------------------- Gemma 4

GEMMA4_FIELDS = GEMMA3_FIELDS + ("num_kv_heads", "global_head_dim", "num_global_kv_heads", "global_values_are_keys",
                                 "num_kv_shared_layers", "per_layer_input_size", "per_layer_vocab_size",
                                 "value_norm", "layer_scalar", "rope_scaling", "rotary_dim", "max_position_embeddings")


@pytest.mark.parametrize("shape", [{}, tiny.GEMMA4_PLAIN], ids=["e2b", "plain"])
def test_gemma4_gguf_gives_the_directorys_config_and_tensors(shape, tmp_path):
    """llama.cpp's file says both head sizes, KV heads per layer where they differ, the shared layers and the
    per-layer input's width, and proportional RoPE as frequency factors; its norms are stored as they are."""
    model = tiny.build("gemma4", tmp_path, **shape)
    directory = load_checkpoint(tmp_path, torch.float32)
    from_file = load_checkpoint(write_gguf(tmp_path / "tiny.gguf", model, "gemma4"), torch.float32)
    assert_same_tensors(directory.tensors, reference_tensors(model))
    assert_same_tensors(from_file.tensors, reference_tensors(model))
    assert {f: getattr(from_file.config, f) for f in GEMMA4_FIELDS} == \
        {f: getattr(directory.config, f) for f in GEMMA4_FIELDS}
    assert from_file.config.eos_token_ids == [2, 7, 1, 106, 50]  # the file's, and the ends of a Gemma 4 reply
    c = directory.config
    assert (c.head_dim, c.global_head_dim, c.rope_scaling["partial_rotary_factor"]) == (16, 32, 0.25)
    assert (c.num_kv_shared_layers, c.per_layer_input_size) == ((2, 8) if not shape else (0, 0))


def test_gemma4_hub_config_keys(tmp_path):
    """The Hub's config.json names the global layers' head size and KV heads (global_head_dim,
    num_global_key_value_heads) where transformers 5 saves them per layer (per_layer_config)."""
    tiny.build("gemma4", tmp_path, **tiny.GEMMA4_PLAIN)
    saved = load_model_config(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("per_layer_config")
    (tmp_path / "config.json").write_text(json.dumps(raw | {"global_head_dim": 32, "num_global_key_value_heads": 1}))
    assert load_model_config(tmp_path) == saved
    assert (saved.global_head_dim, saved.num_global_kv_heads, saved.global_values_are_keys) == (32, 1, True)


def test_gemma4_text_model_of_a_multimodal_checkpoint_loads_with_one_log_line(tmp_path, caplog):
    model = tiny.build_gemma4_multimodal(tmp_path)
    with caplog.at_level("INFO"):
        ckpt = load_checkpoint(tmp_path, torch.float32)
    assert [r.getMessage() for r in caplog.records if "Gemma4" in r.getMessage()] == \
        ["Gemma4ForConditionalGeneration carries a vision tower too: loading its text model only"]
    text = {"model." + name: t for name, t in model.model.language_model.state_dict().items()}
    assert_same_tensors(ckpt.tensors, text)  # the vision tower's are left out


GEMMA4_EXPERT_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                        "expert_gating", "moe_layers", "dense_beside_experts", "router_input_norm", "expert_scale",
                        "experts_gate_up", "intermediate_size")


def test_gemma4_experts_in_the_gguf_are_the_directorys(tmp_path):
    """llama.cpp's converter keeps each expert's gate and up as one stacked matrix (ffn_gate_up_exps), and
    writes the router's input scale and its factor per expert beside the router's and the experts' down
    matrices: the file gives the directory's config and tensors, the experts [experts * rows, columns]."""
    model = tiny.build("gemma4", tmp_path, **tiny.GEMMA4_MOE)
    directory = load_checkpoint(tmp_path, torch.float32)
    from_file = load_checkpoint(write_gguf(tmp_path / "tiny.gguf", model, "gemma4"), torch.float32)
    assert_same_tensors(from_file.tensors, directory.tensors)
    fields = GEMMA4_FIELDS + GEMMA4_EXPERT_FIELDS
    assert {f: getattr(from_file.config, f) for f in fields} == {f: getattr(directory.config, f) for f in fields}
    layer = model.model.layers[5]
    experts = {"gate_up_proj": layer.experts.gate_up_proj, "down_proj": layer.experts.down_proj}
    for part, stacked in experts.items():
        assert torch.equal(directory.tensors[f"model.layers.5.mlp.experts.{part}.weight"], stacked.flatten(0, 1))
    router = {"gate.weight": layer.router.proj.weight, "gate.scale": layer.router.scale,
              "expert_scale": layer.router.per_expert_scale}
    for part, tensor in router.items():
        assert torch.equal(directory.tensors[f"model.layers.5.mlp.{part}"], tensor)


def set_bidirectional_attention(directory: Path, mode: str) -> None:
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(raw | {"use_bidirectional_attention": mode}))


def test_gemma4_bidirectional_attention_over_image_tokens_leaves_text_causal(tmp_path):
    """"vision" (26B-A4B's config): image tokens attend each other both ways; text, as here, is causal."""
    tiny.build("gemma4", tmp_path)
    causal = load_model_config(tmp_path)
    set_bidirectional_attention(tmp_path, "vision")
    assert load_model_config(tmp_path) == causal


def test_error_gemma4_bidirectional_attention_over_all_tokens(tmp_path):
    """"all": every token attends the whole prompt, both ways: no model that generates text."""
    tiny.build("gemma4", tmp_path)
    set_bidirectional_attention(tmp_path, "all")
    assert "gemma4 with use_bidirectional_attention=all is not supported" in error_message(tmp_path)
