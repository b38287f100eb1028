"""Shared server fixtures: a `zhuzi serve` per test module with the default flags and an `openai` client for
it (a module may define its own `server`); the inspector's server (float32, so that an inspection re-run
reproduces a step's probabilities to ~1e-6; bf16: ~1e-3), one per session, shared by the /inspect API and
page tests; and the page tests' browser."""
from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from inspector import Inspector, launch
from playwright.sync_api import Browser, expect, sync_playwright
from server_process import ServerProcess, running_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory.mktemp("serve") / "server.log") as running:
        yield running


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(api_key="none", base_url=server.api, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def inspect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory.mktemp("inspect") / "server.log", "--dtype", "float32") as server:
        yield server


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
    expect.set_options(timeout=60_000)  # inspection calls share two busy cores with the step loop
    context = browser.new_context(viewport={"width": 1500, "height": 950})
    page = context.new_page()
    page.set_default_timeout(60_000)
    ui = Inspector(page, inspect_server).open()
    yield ui
    context.close()
    assert ui.errors == [], f"the browser console logged errors: {ui.errors}"
