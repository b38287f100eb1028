"""Tiny random checkpoints of the families zhuzi runs, saved the way Hugging Face saves them, with the real
SmolLM2 tokenizer beside them so text paths work too; and the same models as GGUF files, the way llama.cpp
writes them (names, Q/K permutation, metadata, quantized types)."""
from __future__ import annotations

import copy
import math
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers
from gguf_blocks import random_blocks

from zhuzi.model.loader import default_model_path
from zhuzi.tokenizer import HARMONY_MARKERS, Tokenizer

CLASSES = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
           "qwen3": transformers.Qwen3ForCausalLM, "mistral": transformers.MistralForCausalLM,
           "phi3": transformers.Phi3ForCausalLM, "gemma3": transformers.Gemma3ForCausalLM}
# Mixture-of-Experts: 4 experts, top-2 (Qwen3-MoE renormalizes its top-k as the released models do)
CLASSES |= {"mixtral": transformers.MixtralForCausalLM, "qwen2_moe": transformers.Qwen2MoeForCausalLM,
            "qwen3_moe": transformers.Qwen3MoeForCausalLM}
MOE = {"mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
       "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         shared_expert_intermediate_size=48),
       "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)}
GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}  # llama.cpp's names
VOCAB = 1000
# Gemma 3 as llama.cpp's converter can write it (query_pre_attn_scalar = head_dim, no soft-capping) and as
# write_gguf's metadata says (its RoPE base and epsilon); 6 layers: five local, one global, llama.cpp's pattern.
GEMMA3 = dict(head_dim=16, query_pre_attn_scalar=16, rope_theta=50000.0, rms_norm_eps=1e-5, sliding_window=512,
              num_hidden_layers=6)


def build(arch: str, directory: Path, layers: int = 2, vocab_size: int = VOCAB,
          **overrides) -> transformers.PreTrainedModel:
    cls = CLASSES[arch]
    shape = dict(hidden_size=64, num_hidden_layers=layers, vocab_size=vocab_size, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128, bos_token_id=1, eos_token_id=2,
                 max_position_embeddings=4096, rope_theta=10000.0)
    if arch == "phi3":  # Phi3Config's default pad id (32000) is outside a tiny vocabulary
        shape |= {"pad_token_id": None}
    family = GEMMA3 if arch == "gemma3" else MOE.get(arch, {})
    config = cls.config_class(**(shape | family | copy.deepcopy(overrides)))  # transformers edits rope dicts in place
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


def converter_tensors(model: transformers.PreTrainedModel) -> dict[str, torch.Tensor]:
    """What llama.cpp's converter maps to GGUF names: each sparse layer's experts stacked per matrix
    ([experts, rows, columns], under the names gguf maps to ffn_*_exps); transformers holds gate and up as one."""
    tensors = {}
    for name, tensor in reference_tensors(model).items():
        if name.endswith("experts.gate_up_proj"):
            gate, up = tensor.chunk(2, 1)
            tensors |= {name.replace("gate_up_proj", "gate_proj.weight"): gate,
                        name.replace("gate_up_proj", "up_proj.weight"): up}
        elif name.endswith("experts.down_proj"):
            tensors[name + ".weight"] = tensor
        else:
            tensors[name] = tensor
    return tensors


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows (pairs for its RoPE); the model rotates them as they are."""
    return weight.reshape(heads, 2, -1, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


RawTensors = dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]]


def write_gguf(path: Path, model, arch: str, raw: RawTensors | None = None, drop: tuple[str, ...] = (),
               types: dict[str, gguf.GGMLQuantizationType] | None = None, sliding_window: int | None = None,
               sliding_window_pattern: list[bool] | None = None, pooling_type: int | None = None) -> Path:
    """A GGUF file holding `model` the way llama.cpp writes it: its names, its permutation, its metadata.
    `raw` replaces a tensor's data by pre-quantized bytes; `types` quantizes tensors to GGUF types (the
    K-quants, which the gguf package cannot quantize, as random blocks). A Mistral is written as llama.cpp's
    converter writes it, as "llama" without its window; sliding_window (and which layers slide) adds the keys
    llama.cpp's converters write for the families whose window they keep."""
    cfg = model.config
    arch = GGUF_ARCH.get(arch, arch)
    writer = gguf.GGUFWriter(path, arch)
    if arch == "gemma3":  # what llama.cpp's converter adds for Gemma 3
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
        writer.add_sliding_window(cfg.sliding_window)
    for key, value in {"block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
                       "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
                       "attention.head_count": cfg.num_attention_heads,
                       "attention.head_count_kv": cfg.num_key_value_heads}.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.rope.freq_base", 50000.0)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    if sliding_window is not None:
        writer.add_sliding_window(sliding_window)
    if sliding_window_pattern is not None:
        writer.add_sliding_window_pattern(sliding_window_pattern)
    if arch in ("qwen3", "qwen3moe"):
        writer.add_key_length(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    if arch == "phi3":
        _phi3_metadata(writer, cfg)
    if experts := getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None):
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if arch != "llama":  # Qwen's converter: the experts' width, and the shared expert's where there is one
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if getattr(cfg, "shared_expert_intermediate_size", None):
            writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if pooling_type is not None:  # an embedding model's (llama.cpp's enum: 1 mean, 3 last)
        writer.add_uint32(f"{arch}.pooling_type", pooling_type)
    writer.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])  # no vocab_size key: from the list
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_eos_token_id(2)
    writer.add_uint32("tokenizer.ggml.eot_token_id", 7)
    arch_id = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(arch_id, cfg.num_hidden_layers)
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    for hf_name, tensor in converter_tensors(model).items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        array = tensor.numpy()
        if arch == "llama" and hf_name.split(".")[-2] in heads:
            array = llama_cpp_permute(array, heads[hf_name.split(".")[-2]])
        if arch == "gemma3" and hf_name.endswith("norm.weight"):  # the converter stores Gemma's (1 + w)
            array = array + 1
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


def _phi3_metadata(writer: gguf.GGUFWriter, cfg) -> None:
    """What llama.cpp's converter adds for Phi-3: the rotary dims, the original context, the sliding window
    (0: none), and LongRoPE's factors as tensors with its attention factor computed from the context's stretch."""
    rope = cfg.rope_parameters
    original = rope.get("original_max_position_embeddings", cfg.original_max_position_embeddings)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * head_dim))
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_sliding_window(cfg.sliding_window or 0)
    if rope.get("rope_type") == "longrope":
        scale = cfg.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))


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


def build_harmony(directory: Path, reply: list[str]) -> list[int]:
    """A tiny Llama that speaks harmony by rote: SmolLM2's tokenizer with harmony's markers as control tokens,
    and weights that make it write reply (texts and markers) after any prompt that ends with "assistant", as a
    harmony prompt does. Every layer's output is zero, so each next token depends on the last one alone: a token
    of the script has a unit vector of its own as embedding, which the head maps to the token after it; a reply
    that ends with "assistant" goes round again. Returns the reply's ids."""
    hf = Tokenizer.load(default_model_path()).hf
    hf.add_special_tokens({"additional_special_tokens": list(HARMONY_MARKERS)})
    model = build("llama", directory, vocab_size=len(hf))
    tokenizer = Tokenizer(hf)
    pieces = [tokenizer.special_id(piece) if piece in HARMONY_MARKERS else piece for piece in reply]
    script = tokenizer.encode("assistant", add_special_tokens=False)[-1:] + tokenizer.encode_pieces(pieces)
    sources = script[:-1]
    assert len(set(sources)) == len(sources) <= model.config.hidden_size, "a token of the script has one successor"
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        for i, (token, successor) in enumerate(zip(script, script[1:])):
            model.model.embed_tokens.weight[token] = torch.nn.functional.one_hot(torch.tensor(i),
                                                                                 model.config.hidden_size)
            model.lm_head.weight[successor, i] = 10.0
    model.save_pretrained(directory)
    hf.save_pretrained(directory)
    return script[1:]
