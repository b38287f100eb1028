"""Shared fixtures: the embedded SmolLM2 checkpoint and its transformers reference model."""
from pathlib import Path

import pytest
import torch

from zhuzi.model.loader import default_model_path


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The embedded SmolLM2-135M-Instruct Q4_1 GGUF file."""
    return default_model_path()


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path: Path):
    """transformers' own load of the same GGUF in fp32 (the oracle; ~12 s, so once per session)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name,
                                                 dtype=torch.float32)
    return model.eval()
