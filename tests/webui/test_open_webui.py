"""Open WebUI, unmodified, in a real browser (Debian's Chromium through Playwright) against a real `zhuzi serve` of
the default model: once with zhuzi as its OpenAI connection, once as its Ollama connection. zhuzi's model is in
its list, a reply streams into the page, Stop ends the request on zhuzi's side (its KV pages come back), and a
second turn reuses the first one's prefix. Then against a `zhuzi serve --models-dir` of two models, through each
connection: both are in the list, and each answers a chat (loaded by it). `make test-webui` installs Open WebUI
in a venv of its own and names its executable in $OPEN_WEBUI; `make test` leaves these tests out (marker
`webui`)."""
from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright
from server.inspector import launch
from server.server_process import ServerProcess, free_port, running_server, stop

pytestmark = pytest.mark.webui

MODEL = "SmolLM2-135M-Instruct"
MODELS = ("smollm2-a", "smollm2-b")  # a models directory's two names for the embedded SmolLM2 (links)
START_TIMEOUT_S = 600.0  # its first start migrates a fresh database: minutes on two busy cores
REPLY_TIMEOUT_MS = 300_000
# Open WebUI's switches for a machine without internet access, and for a test that counts zhuzi's requests.
SETTINGS = {
    "OFFLINE_MODE": "true",  # no version check, no Hugging Face downloads (it sets HF_HUB_OFFLINE=1)
    "RAG_EMBEDDING_ENGINE": "openai",  # no local sentence-transformers model to load at start
    "WEBUI_AUTH": "False",  # one user, no sign-in
    "WEBUI_SECRET_KEY": "test",  # else it writes a key file into the working directory
    # Its background tasks (a title, tags, follow-up questions) would be more requests to zhuzi
    "ENABLE_TITLE_GENERATION": "False",
    "ENABLE_TAGS_GENERATION": "False",
    "ENABLE_FOLLOW_UP_GENERATION": "False",
    "ENABLE_AUTOCOMPLETE_GENERATION": "False",
    # Its built-in tools (memory, notes, chat search, ...) are ~7,000 tokens of schemas in every request
    "DEFAULT_MODEL_METADATA": '{"capabilities": {"builtin_tools": false}}',
    # It sends no max_tokens of its own: SmolLM2 would write up to its context window
    "DEFAULT_MODEL_PARAMS": '{"max_tokens": 400}',
}


def connection(kind: str, zhuzi: ServerProcess) -> dict[str, str]:
    if kind == "openai":
        return {"ENABLE_OPENAI_API": "True", "OPENAI_API_BASE_URL": zhuzi.api, "OPENAI_API_KEY": "none",
                "ENABLE_OLLAMA_API": "False"}
    return {"ENABLE_OLLAMA_API": "True", "OLLAMA_BASE_URL": zhuzi.url, "ENABLE_OPENAI_API": "False"}


@contextmanager
def running_open_webui(data: Path, env: dict[str, str]) -> Iterator[str]:
    """`open-webui serve` on a free port with its data in `data`; yields its URL once /health says so."""
    executable = os.environ.get("OPEN_WEBUI")
    if not executable:
        pytest.fail("$OPEN_WEBUI is not set: run these tests with `make test-webui`, which installs Open WebUI")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = data / "open-webui.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([executable, "serve", "--host", "127.0.0.1", "--port", str(port)], cwd=data,
                                stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **SETTINGS, **env, "DATA_DIR": str(data)})
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not healthy(url):
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
            assert proc.poll() is None, f"open-webui exited with {proc.returncode}:\n{tail}"
            assert time.monotonic() < deadline, f"open-webui not healthy after {START_TIMEOUT_S} s:\n{tail}"
            time.sleep(1)
        yield url
    finally:
        stop(proc, 30)


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def metrics(zhuzi: ServerProcess) -> dict[str, float]:
    """zhuzi's engine gauges and counters of interest, summed over their labels."""
    text = httpx.get(zhuzi.url + "/metrics", timeout=30).text
    values: dict[str, float] = {}
    for name, labels, value in re.findall(r"^zhuzi:(\w+)(\{[^}]*\})? (\S+)$", text, re.M):
        if name == "request_success_total":
            name += "_" + re.search(r'finished_reason="(\w+)"', labels)[1]
        values[name] = values.get(name, 0.0) + float(value)
    return values


@pytest.fixture(scope="module")
def zhuzi(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # `zhuzi serve`'s own pool (1 GiB), as a user starts it, not the test helper's 64 MiB
    with running_server(tmp_path_factory.mktemp("zhuzi") / "server.log", "--kv-cache-memory", "1GiB") as server:
        yield server


@dataclass
class WebUI:
    page: Page
    url: str
    hosts: set[str] = field(default_factory=set)  # every host the page sent a request to


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """One Chromium for every page of the module (Playwright's sync API runs one at a time in a thread)."""
    with sync_playwright() as playwright:
        chromium = launch(playwright)
        yield chromium
        chromium.close()


@contextmanager
def chat_page(kind: str, zhuzi: ServerProcess, data: Path, browser: Browser) -> Iterator[WebUI]:
    """The chat page of an Open WebUI whose one connection is zhuzi, through the API `kind` names."""
    with running_open_webui(data, connection(kind, zhuzi)) as url:
        ui = WebUI(browser.new_page(viewport={"width": 1280, "height": 800}), url)
        ui.page.set_default_timeout(120_000)
        expect.set_options(timeout=120_000)
        ui.page.on("request", lambda r: r.url.startswith("http") and ui.hosts.add(httpx.URL(r.url).netloc.decode()))
        welcome = ui.page.get_by_role("button", name="Okay, Let's Go!")  # its release notes, once per new user
        ui.page.add_locator_handler(welcome, welcome.click)
        ui.page.goto(url)
        expect(ui.page.locator("#chat-input")).to_be_visible()
        yield ui
        ui.page.screenshot(path=data / "chat.png")
        ui.page.close()


@pytest.fixture(scope="module", params=["openai", "ollama"])
def webui(request: pytest.FixtureRequest, zhuzi: ServerProcess, tmp_path_factory: pytest.TempPathFactory,
          browser: Browser) -> Iterator[WebUI]:
    with chat_page(request.param, zhuzi, tmp_path_factory.mktemp(f"open-webui-{request.param}"), browser) as ui:
        yield ui


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Iterator[ServerProcess]:
    """`zhuzi serve --models-dir` of MODELS, none loaded until a request names it."""
    root = tmp_path_factory.mktemp("many")
    (root / "models").mkdir()
    for name in MODELS:
        (root / "models" / f"{name}.gguf").symlink_to(smollm2_path)
    with running_server(root / "server.log", "--models-dir", str(root / "models")) as server:
        yield server


@pytest.fixture(scope="module", params=["openai", "ollama"])
def many_webui(request: pytest.FixtureRequest, many: ServerProcess, tmp_path_factory: pytest.TempPathFactory,
               browser: Browser) -> Iterator[WebUI]:
    with chat_page(request.param, many, tmp_path_factory.mktemp(f"open-webui-many-{request.param}"),
                   browser) as ui:
        yield ui


def settled(zhuzi: ServerProcess) -> dict[str, float]:
    """zhuzi's metrics once nothing runs and every KV block is free again (60 s at most)."""
    deadline = time.monotonic() + 60
    while (now := metrics(zhuzi))["num_requests_running"] or now["kv_cache_usage_perc"]:
        assert time.monotonic() < deadline, f"zhuzi still runs a request: {now}"
        time.sleep(0.5)
    return now


def answered(zhuzi: ServerProcess, model: str) -> float:
    """The requests zhuzi finished for the model (its model_name label)."""
    text = httpx.get(zhuzi.url + "/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(rf'^zhuzi:request_success_total{{[^}}]*model_name="{model}"[^}}]*}} (\S+)$',
                                            text, re.M))


def reply(page: Page) -> str:
    replies = page.locator("#response-content-container")
    return replies.last.inner_text() if replies.count() else ""


def send(page: Page, text: str) -> None:
    page.locator("#chat-input").fill(text)
    page.locator("#send-message-button").click()


def test_zhuzis_model_is_in_the_list(webui: WebUI) -> None:
    selector = webui.page.locator("#model-selector-model-button")
    expect(selector).to_have_attribute("aria-label", re.compile(f"Selected model: {MODEL}"))
    selector.click()
    expect(webui.page.get_by_role("option", name=re.compile(f"Select {MODEL}"))).to_be_visible()
    webui.page.keyboard.press("Escape")


def test_a_reply_streams_and_stop_gives_its_kv_blocks_back(webui: WebUI, zhuzi: ServerProcess) -> None:
    page, before = webui.page, metrics(zhuzi)
    send(page, "Write a long story about a dragon who loves books.")
    lengths = [0]
    deadline = time.monotonic() + REPLY_TIMEOUT_MS / 1000
    while len(set(lengths)) < 4:  # the text grew three times while zhuzi was still writing it
        assert time.monotonic() < deadline, f"the reply never grew: {lengths}"
        lengths.append(len(reply(page)))
        assert lengths[-1] >= lengths[-2]
        time.sleep(0.2)
    assert metrics(zhuzi)["num_requests_running"] == 1
    page.get_by_role("button", name="Stop").click()
    after = settled(zhuzi)
    assert after.get("request_success_total_abort") == before.get("request_success_total_abort", 0) + 1
    stopped = reply(page)
    time.sleep(2)
    assert reply(page) == stopped and len(stopped) >= lengths[-1]  # nothing more came after Stop


def test_a_second_turn_reuses_the_prefix_cache(webui: WebUI, zhuzi: ServerProcess) -> None:
    page, before = webui.page, metrics(zhuzi)
    send(page, "Give the story a short title.")
    expect(page.locator("#response-content-container")).to_have_count(2, timeout=REPLY_TIMEOUT_MS)
    expect(page.locator("#response-content-container").last).not_to_be_empty(timeout=REPLY_TIMEOUT_MS)
    expect(page.get_by_role("button", name="Stop")).to_be_hidden(timeout=REPLY_TIMEOUT_MS)
    after = settled(zhuzi)
    assert after["prefix_cache_hits_total"] > before["prefix_cache_hits_total"]  # the first turn's prompt pages
    assert after.get("request_success_total_stop") == before.get("request_success_total_stop", 0) + 1


def test_the_page_reached_nothing_but_open_webui(webui: WebUI) -> None:
    assert webui.hosts == {httpx.URL(webui.url).netloc.decode()}


def test_each_model_of_a_models_dir_is_listed_and_answers(many_webui: WebUI, many: ServerProcess) -> None:
    page, selector = many_webui.page, many_webui.page.locator("#model-selector-model-button")
    selector.click()
    for name in MODELS:
        expect(page.get_by_role("option", name=re.compile(f"Select {name}"))).to_be_visible()
        many.post("/models/unload", {"model": name})  # the other connection's chats may have loaded it
    page.keyboard.press("Escape")
    assert many.get("/health")["models"] == []
    for name in MODELS:
        page.goto(many_webui.url)  # a new chat
        selector.click()
        page.get_by_role("option", name=re.compile(f"Select {name}")).click()
        expect(selector).to_have_attribute("aria-label", re.compile(f"Selected model: {name}"))
        before = answered(many, name)
        send(page, "What is the capital of France?")
        expect(page.locator("#response-content-container").last).not_to_be_empty(timeout=REPLY_TIMEOUT_MS)
        expect(page.get_by_role("button", name="Stop")).to_be_hidden(timeout=REPLY_TIMEOUT_MS)
        assert answered(many, name) == before + 1  # the chat went to the model chosen, which loaded for it
        assert name in many.get("/health")["models"]
