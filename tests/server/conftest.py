"""Shared server fixtures, each a `zhuzi serve` started once per session (a start costs seconds; under xdist, the
modules that use one run in one worker: tests/conftest.py) and shared by the modules that need no flags of their
own: the default server (dense weights) and an `openai` client for it (a module may define its own `server`); a
server with two API keys (KEYS), shared by the Anthropic and Responses API tests; the inspector's server (float32,
so that an inspection re-run reproduces a step's probabilities to ~1e-6; bf16: ~1e-3), shared by the /inspect API
and page tests; a speculating server with --deterministic, shared by the speculation tests and the inspector's
speculation and divergence views; a server of many models (three names for SmolLM2 and a split GGUF), shared by
the many-models tests and the inspector's page of them; and the page tests' browser. Tests on a shared server
compare its counters before and after, never their absolute values."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from inspector import Inspector, inspecting, launch
from playwright.sync_api import Browser, sync_playwright
from server_process import IN_THREAD, ServerProcess, running_server
from tiny import linked, split_gguf


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # Dense weights, as keyed_server below: the API tests read SmolLM2's answers
    with running_server(tmp_path_factory.mktemp("serve") / "server.log", "--quantization", "none") as running:
        yield running


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(api_key="none", base_url=server.api, max_retries=0, timeout=120)


KEYS = ("key-one", "key-two")


@pytest.fixture(scope="session")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    keys = [arg for key in KEYS for arg in ("--api-key", key)]
    # Dense weights: the API tests read the answers (Paris, then Berlin from the stored history), and SmolLM2's
    # greedy answers to them fork at a near-tie on its Q4_1 blocks, the default (llama.cpp's answers on the
    # same file are those of the blocks); other servers of the suite run the default.
    with running_server(tmp_path_factory.mktemp("keyed") / "server.log", *keys, "--quantization", "none",
                        *IN_THREAD) as server:
        yield server


CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="session")
def capital_answer(keyed_server: ServerProcess) -> str:
    """The chat endpoint's greedy reply (24 tokens at most) to CAPITAL: every API runs the one chat path, so each
    answers it with these words."""
    chat = openai.OpenAI(api_key=KEYS[0], base_url=keyed_server.api, max_retries=0, timeout=120)
    return chat.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CAPITAL, max_tokens=24,
                                        temperature=0).choices[0].message.content


@pytest.fixture(scope="session")
def inspect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory.mktemp("inspect") / "server.log", "--dtype", "float32") as server:
        yield server


NGRAM = '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'


@pytest.fixture(scope="session")
def det_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """bf16 with --deterministic, speculating with prompt lookup; dense weights, as `server` whose batches the
    inspector's divergence experiment compares it with."""
    with running_server(tmp_path_factory.mktemp("det") / "server.log", "--deterministic", "--quantization", "none",
                        "--dtype", "bfloat16", "--speculative-config", NGRAM) as running:
        yield running


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    """Three names for SmolLM2 (links, not copies), and a split GGUF of two parts (listed, never loaded)."""
    directory = linked(tmp_path_factory.mktemp("models") / "models", smollm2_path, ("a", "b", "c"))
    split_gguf(directory, "big", 2)
    return directory


@pytest.fixture(scope="session")
def models_server(models_dir: Path, smollm2_path: Path) -> Iterator[ServerProcess]:
    """`zhuzi serve --models-dir` of models_dir, with room for two and a half of its SmolLM2s."""
    size = smollm2_path.stat().st_size + 64 * 2**20  # the weights and running_server's KV pool
    with running_server(models_dir.parent / "server.log", "--models-dir", str(models_dir), "--models-memory",
                        str(2 * size + size // 2)) as running:
        yield running


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    # Module, not session: while sync_playwright runs, its event loop is the thread's running loop, and every
    # later test that calls asyncio.run() would fail.
    with sync_playwright() as playwright:
        browser = launch(playwright)
        yield browser
        browser.close()


@pytest.fixture
def inspector(browser: Browser, inspect_server: ServerProcess) -> Iterator[Inspector]:
    with inspecting(browser, inspect_server) as ui:
        yield ui
