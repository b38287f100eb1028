"""The families zhuzi runs, one file each: the registry the loaders, the CLI and the server check a
checkpoint against (docs/models.md). A new family is one file and one line here."""
from __future__ import annotations

from typing import Any

from zhuzi.model.families import (
    gemma3,
    gemma4,
    gpt_oss,
    granite_hybrid,
    lfm2,
    llama,
    mistral,
    mixtral,
    phi3,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_5,
    qwen3_moe,
    qwen3_next,
)
from zhuzi.model.families.base import Family

FAMILIES: dict[str, Family] = {f.name: f for f in (
    llama.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    mistral.FAMILY,
    phi3.FAMILY,
    gemma3.FAMILY,
    gemma4.FAMILY,
    mixtral.FAMILY,
    qwen2_moe.FAMILY,
    qwen3_moe.FAMILY,
    qwen3_5.FAMILY,
    qwen3_5.MOE_FAMILY,
    qwen3_next.FAMILY,
    gpt_oss.FAMILY,
    lfm2.FAMILY,
    lfm2.MOE_FAMILY,
    granite_hybrid.FAMILY,
)}


def family(name: str) -> Family:
    """The family of a ModelConfig.architecture."""
    return FAMILIES[name]


def hf_family(raw: dict[str, Any]) -> Family | None:
    """The family config.json names: by a class of its architectures, else (none named) by its model_type."""
    named = raw.get("architectures") or []
    by_class = {f.hf_class: f for f in FAMILIES.values()} | \
        {f.hf_multimodal_class: f for f in FAMILIES.values() if f.hf_multimodal_class}
    found = next((by_class[name] for name in named if name in by_class), None)
    return found or (FAMILIES.get(raw.get("model_type")) if not named else None)


def gguf_family(arch: str | None, sparse: bool) -> Family | None:
    """The family of a GGUF's general.architecture: the first listed, one with experts where the file has them
    (llama.cpp writes Llama, Mistral and Mixtral all as llama)."""
    candidates = [f for f in FAMILIES.values() if f.gguf_arch == arch]
    return next((f for f in candidates if f.sparse == sparse), candidates[0] if candidates else None)


def supported_families() -> str:
    """The families for a message: 'LlamaForCausalLM (GGUF llama), ...'."""
    return ", ".join(f"{f.hf_class} (GGUF {f.gguf_arch})" for f in FAMILIES.values())
