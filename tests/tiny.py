"""Tiny random Llama / Qwen2 / Qwen3 checkpoints, saved the way Hugging Face saves them, with the
real SmolLM2 tokenizer beside them so text paths work too; and the same models as GGUF files, the way
llama.cpp writes them (names, Q/K permutation, metadata, quantized types)."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
import transformers
from gguf_blocks import random_blocks

from zhuzi.model.loader import default_model_path
from zhuzi.tokenizer import Tokenizer

CLASSES = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
           "qwen3": transformers.Qwen3ForCausalLM}
VOCAB = 1000


def build(arch: str, directory: Path, layers: int = 2, vocab_size: int = VOCAB,
          **overrides) -> transformers.PreTrainedModel:
    cls = CLASSES[arch]
    shape = dict(hidden_size=64, num_hidden_layers=layers, vocab_size=vocab_size, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128, bos_token_id=1, eos_token_id=2,
                 max_position_embeddings=4096, rope_theta=10000.0)
    config = cls.config_class(**(shape | overrides))
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():  # larger than HF's init so that tokens are not near-ties everywhere
        for p in model.parameters():
            p.normal_(0, 0.1)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(1.0)
    model.save_pretrained(directory)
    Tokenizer.load(default_model_path()).hf.save_pretrained(directory)
    return model


def reference_tensors(model: transformers.PreTrainedModel) -> dict[str, torch.Tensor]:
    tensors = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        del tensors["lm_head.weight"]
    return tensors


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows (pairs for its RoPE); the model rotates them as they are."""
    return weight.reshape(heads, 2, -1, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


RawTensors = dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]]


def write_gguf(path: Path, model, arch: str, raw: RawTensors | None = None, drop: tuple[str, ...] = (),
               types: dict[str, gguf.GGMLQuantizationType] | None = None, pooling_type: int | None = None) -> Path:
    """A GGUF file holding `model` the way llama.cpp writes it: its names, its permutation, its metadata.
    `raw` replaces a tensor's data by pre-quantized bytes; `types` quantizes tensors to GGUF types (the
    K-quants, which the gguf package cannot quantize, as random blocks)."""
    cfg = model.config
    writer = gguf.GGUFWriter(path, arch)
    for key, value in {"block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
                       "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
                       "attention.head_count": cfg.num_attention_heads,
                       "attention.head_count_kv": cfg.num_key_value_heads}.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.rope.freq_base", 50000.0)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    if arch == "qwen3":
        writer.add_key_length(cfg.head_dim)
    if pooling_type is not None:  # an embedding model's (llama.cpp's enum: 1 mean, 3 last)
        writer.add_uint32(f"{arch}.pooling_type", pooling_type)
    writer.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])  # no vocab_size key: from the list
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_eos_token_id(2)
    writer.add_uint32("tokenizer.ggml.eot_token_id", 7)
    arch_id = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(arch_id, cfg.num_hidden_layers)
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    for hf_name, tensor in reference_tensors(model).items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        array = tensor.numpy()
        if arch == "llama" and hf_name.split(".")[-2] in heads:
            array = llama_cpp_permute(array, heads[hf_name.split(".")[-2]])
        if hf_name in (types or {}):
            raw = (raw or {}) | {hf_name: (quantized(array, types[hf_name]), types[hf_name])}
        if hf_name in (raw or {}):
            data, qtype = raw[hf_name]
            writer.add_tensor(name, np.ascontiguousarray(data).view(np.uint8), raw_dtype=qtype)
        elif name not in drop:
            writer.add_tensor(name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def quantized(array: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """The matrix's blocks of qtype; random blocks of its shape for the types gguf cannot quantize."""
    try:
        return gguf.quants.quantize(array.astype(np.float32), qtype)
    except NotImplementedError:
        return random_blocks(qtype, *array.shape, seed=array.size)


THINKING_TEMPLATE = (  # ChatML whose generation prompt opens a thought, as DeepSeek-R1's does
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}"
    "{%- endif %}")


def build_thinking(directory: Path) -> tuple[int, int]:
    """A tiny random Qwen3 that thinks: SmolLM2's tokenizer plus <think> and </think> as added tokens, and a
    template that opens the thought. Returns the two tags' ids."""
    build("qwen3", directory, vocab_size=49152 + 2)
    hf = Tokenizer.load(directory).hf
    hf.add_tokens(["<think>", "</think>"])
    hf.chat_template = THINKING_TEMPLATE
    hf.save_pretrained(directory)
    return tuple(hf.convert_tokens_to_ids(["<think>", "</think>"]))
