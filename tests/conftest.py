"""Shared fixtures: the embedded SmolLM2 checkpoint and its transformers reference model; the order files run in."""
from pathlib import Path

import pytest
import torch

from zhuzi.model.loader import default_model_path


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "long: a file that runs for a minute or more, started before the others")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files marked long first, the rest after (each file's tests stay together, in their order): xdist
    hands whole files out in this order (make test: --no-loadscope-reorder), so the last ones to run are short
    and no core waits idle while a long file ends the run."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


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


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path: Path):
    from zhuzi.tokenizer import Tokenizer

    return Tokenizer.load(smollm2_path)


@pytest.fixture(scope="session")
def grammars(smollm2_tokenizer):
    """One grammar compiler on SmolLM2's tokenizer (its tokenizer view takes about a second to build)."""
    from zhuzi.sample.grammar import GrammarCompiler

    return GrammarCompiler(smollm2_tokenizer.hf, 49152, [2])


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for a module: two OpenMP threads on a loaded 2-core machine make each small op many
    times slower. Use with pytestmark = pytest.mark.usefixtures("one_thread")."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
