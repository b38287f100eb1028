"""Configuration: the model's shape (read from a checkpoint) and every engine tunable."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

ARCHITECTURES = ("llama", "qwen2", "qwen3")


@dataclass
class ModelConfig:
    """The shape of a decoder-only checkpoint, independent of its file format."""

    architecture: str  # one of ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF's rope_scaling dict (e.g. Llama-3 "llama3")
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def num_parameters(self) -> int:
        h, i, l = self.hidden_size, self.intermediate_size, self.num_layers
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return l * per_layer + embed + h

    def decode_weight_bytes(self, bytes_per_weight: float) -> int:
        """Weight bytes one decode step reads: every matrix once, but only one embedding row."""
        unread_embedding = (self.vocab_size - 1) * self.hidden_size if not self.tie_word_embeddings else 0
        return int((self.num_parameters - unread_embedding) * bytes_per_weight)

    def kv_bytes_per_token(self, bytes_per_value: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_value


def parse_bytes(text: str | int) -> int:
    """'1GiB' / '512MiB' / '2GB' / '1000000' -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?)B?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot read a memory size from {text!r} (try '1GiB' or '512MiB')")
    number, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    base = 1024 if binary or not unit else 1000
    return int(number * base ** " KMGT".index(unit or " "))


DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
          "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


@dataclass
class EngineConfig:
    """Every tunable of the engine in one place; the CLI and LLM() fill it."""

    model: str | None = None  # HF directory or .gguf file; None = embedded SmolLM2
    dtype: str = "bfloat16"
    device: str = "cpu"
    kv_cache_memory: str | int = "1GiB"
    block_size: int = 16
    max_model_len: int | None = None  # default: the checkpoint's context length
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # While other sequences decode, one prompt advances at most this many tokens a step, so a long
    # prompt cannot stall the running streams (vLLM's name; 0 = no cap; `zhuzi serve` uses 128).
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    quantization: str | None = None  # None or "int8"
    seed: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    @property
    def kv_cache_bytes(self) -> int:
        return parse_bytes(self.kv_cache_memory)
