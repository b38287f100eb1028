"""The real GGUF files of `make test-models` (tests/real_models.py): Qwen2.5-Coder-0.5B-Instruct (a Q4_K_M mix:
Q5_0, Q8_0, Q4_K, Q6_K), 1.5B-Instruct (Q4_K, Q6_K) and Gemma 3 270M base (Q4_K_M: Q5_0, Q8_0, Q4_K, Q6_K),
fetched once into zhuzi's cache."""
from pathlib import Path

import pytest
from real_models import GEMMA3_270M, QWEN_0_5B, QWEN_1_5B, fetch


@pytest.fixture(scope="session")
def qwen_small() -> Path:
    return fetch(QWEN_0_5B)


@pytest.fixture(scope="session")
def qwen_large() -> Path:
    return fetch(QWEN_1_5B)


@pytest.fixture(scope="session")
def gemma3() -> Path:
    return fetch(GEMMA3_270M)
