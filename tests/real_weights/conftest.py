"""The real GGUF files of `make test-models` (tests/real_models.py): Qwen2.5-Coder-0.5B-Instruct (a Q4_K_M mix:
Q5_0, Q8_0, Q4_K, Q6_K), 1.5B-Instruct (Q4_K, Q6_K) and Gemma 3 270M base (Q4_K_M: Q5_0, Q8_0, Q4_K, Q6_K),
fetched once into zhuzi's cache; and one `zhuzi serve` of the 0.5B, shared by the files that drive it through a
client."""
from collections.abc import Iterator
from pathlib import Path

import pytest
from real_models import GEMMA3_270M, QWEN_0_5B, QWEN_1_5B, fetch
from server.server_process import ServerProcess, running_server


@pytest.fixture(scope="session")
def qwen_small() -> Path:
    return fetch(QWEN_0_5B)


@pytest.fixture(scope="session")
def qwen_large() -> Path:
    return fetch(QWEN_1_5B)


@pytest.fixture(scope="session")
def gemma3() -> Path:
    return fetch(GEMMA3_270M)


@pytest.fixture(scope="session")
def qwen_server(qwen_small: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory.mktemp("qwen") / "server.log", str(qwen_small), "--max-model-len", "4096",
                        "--kv-cache-memory", "256MiB") as server:
        yield server
