"""The inspector's batch, cache, divergence and speculation views (the tool view has test_inspector_tools.py),
driven in Chromium against real `zhuzi serve` processes (conftest.py's, the session's: det_server speculates
with --deterministic): what each shows is checked against the server's own APIs (its step records, the usage
of each request, the answers the test computes itself through the chat API)."""
from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
import torch
from inspector import REPLY_TIMEOUT_MS, Inspector
from playwright.sync_api import Browser, expect
from server_process import ServerProcess, running_server

from zhuzi.config import Precision
from zhuzi.model import native
from zhuzi.server.inspect.protocol import MAX_STEPS

pytestmark = pytest.mark.long  # a minute or more: handed out first (tests/conftest.py)


@pytest.fixture(scope="module")
def bf16_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The divergence experiment's server, in bf16 as docs/inspector.md describes it: the session's `server` where dtype
    auto computes in bf16 (native bf16), else one of its own (dtype auto computes in float32 there). Which one is
    decided as the server decides dtype auto, not by asking it: on a CPU without native bf16, this file's worker
    (the inspector's: tests/conftest.py) would start the session's `server` only to hear that."""
    if Precision.of("auto", native.default_choice()).compute == torch.bfloat16:
        server = request.getfixturevalue("server")
        assert server.get("/inspect/engine?steps=0")["model"]["dtype"] == "bfloat16"
        yield server
        return
    with running_server(tmp_path_factory.mktemp("bf16") / "server.log", "--quantization", "none",
                        "--dtype", "bfloat16") as running:
        yield running


@pytest.fixture
def open_page(browser: Browser) -> Iterator[Callable[[ServerProcess], Inspector]]:
    """The page on another server than the inspector fixture's; every console error fails the test."""
    pages: list[tuple[object, Inspector]] = []

    def open_on(server: ServerProcess) -> Inspector:
        context = browser.new_context(viewport={"width": 1500, "height": 950})
        page = context.new_page()
        page.set_default_timeout(120_000)
        pages.append((context, Inspector(page, server).open()))
        return pages[-1][1]

    expect.set_options(timeout=120_000)
    yield open_on
    for context, ui in pages:
        context.close()
        assert ui.errors == [], f"the browser console logged errors: {ui.errors}"


def post(server: ServerProcess, path: str, body: dict) -> dict:
    """The server's own answer, waited for as long as the page waits for one."""
    response = httpx.post(server.url + path, json=body, timeout=REPLY_TIMEOUT_MS / 1000)
    response.raise_for_status()
    return response.json()


def batch(server: ServerProcess, request_id: str) -> list[dict]:
    return server.get(f"/inspect/batch?steps={MAX_STEPS}&request_id={request_id}")["steps"]


def prefill_of(steps: list[dict]) -> int:
    """The prompt tokens the caller's request computed, by the engine's step records."""
    return sum(row["tokens"] for step in steps for row in step["rows"] if row["yours"] and row["kind"] == "prefill")


def reply_id(ui: Inspector) -> str:
    return ui.assistant().get_attribute("data-request-id")


# ------------------------------------------------------------------ batch

def test_the_batch_strip_shows_the_reply_among_anonymous_strangers(inspector: Inspector) -> None:
    ui = inspector
    strangers = [threading.Thread(target=post, args=(ui.server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": f"Say something about the number {n}."}], "max_tokens": 16,
        "temperature": 0})) for n in (7, 11)]
    ui.settings(temperature=0, max_tokens=24)
    ui.send("Count from one to twenty.")
    expect(ui.page.get_by_test_id("token").first).to_be_attached(timeout=REPLY_TIMEOUT_MS)
    for thread in strangers:  # they join while the reply decodes
        thread.start()
    ui.wait_reply()
    for thread in strangers:
        thread.join()
    ui.tab("batch")
    strip = ui.page.get_by_test_id("batch-strip")
    expect(strip.locator("[data-testid=batch-step]:not([data-yours='0'])").first).to_be_attached()
    ui.page.get_by_test_id("batch-pause").check()
    shown = strip.get_by_test_id("batch-step").evaluate_all("cols => cols.map(c => ({...c.dataset}))")
    steps = {s["index"]: s for s in batch(ui.server, reply_id(ui))}
    for col in shown:  # each column is the engine's own record of that step
        step = steps[int(col["index"])]
        assert int(col["rows"]) == len(step["rows"])
        assert int(col["prefillTokens"]) == step["prefill_tokens"]
        assert int(col["decodeRows"]) == step["decode_rows"]
        assert int(col["yours"]) == sum(row["yours"] for row in step["rows"])
    mine = [c for c in shown if c["yours"] == "1"]
    assert len(mine) == len(ui.tokens()), "one row of the reply in each of its steps (prefill, then a decode a token)"
    shared = [c for c in mine if int(c["rows"]) > 1]
    assert shared, "no step of the reply held another request"
    column = strip.locator(f'[data-testid=batch-step][data-index="{shared[-1]["index"]}"]')
    column.click()
    detail = ui.page.get_by_test_id("batch-detail")
    step = steps[int(shared[-1]["index"])]
    expect(detail.get_by_test_id("batch-duration")).to_have_text(f"{step['duration_s'] * 1000:.1f} ms")
    rows = detail.get_by_test_id("batch-row")
    expect(rows).to_have_count(len(step["rows"]))
    assert rows.evaluate_all("r => r.filter(x => x.dataset.yours === 'true').length") == 1
    assert "another request" in detail.inner_text() and "chatcmpl" not in ui.page.locator("#view-batch").inner_html()


# ------------------------------------------------------------------ cached input and its price

def test_cached_prompt_tokens_are_shaded_and_priced_both_ways(inspector: Inspector) -> None:
    ui = inspector
    ui.chat("My cat is called Momo. She sleeps all day.", temperature=0, max_tokens=8)
    ui.chat("What is my cat called?")
    ui.tab("document")
    doc = ui.page.get_by_test_id("document")
    expect(doc.get_by_test_id("doc-token").first).to_be_visible()
    cached = int(ui.page.get_by_test_id("doc-cached").get_attribute("data-value"))
    prompt = doc.locator("[data-testid=doc-token]:not([data-generated])").count()
    generated = doc.locator("[data-testid=doc-token][data-generated]").count()
    page = ui.server.get("/inspect/engine?steps=0")["kv"]["block_size"]
    assert cached >= page and cached % page == 0, "the second turn re-reads the first from whole cached pages"
    assert doc.locator("[data-cached=true]").count() == cached
    assert prefill_of(batch(ui.server, reply_id(ui))) == prompt - cached, "the engine computed the rest"
    for key, price in (("input", "2"), ("cached", "0.5"), ("output", "8")):
        ui.page.get_by_test_id(f"price-{key}").fill(price)
    line = ui.page.get_by_test_id("cost-line")
    with_cache = ((prompt - cached) * 2 + cached * 0.5 + generated * 8) / 1e6
    expect(line).to_have_attribute("data-with-cache", re.compile(r"^[\d.e-]+$"))
    assert float(line.get_attribute("data-with-cache")) == pytest.approx(with_cache)
    assert float(line.get_attribute("data-without-cache")) == pytest.approx((prompt * 2 + generated * 8) / 1e6)


# ------------------------------------------------------------------ the same question twice

# Prompts the experiment tries, in order, at 16 rows and then 8 (a bigger batch is likelier to take another
# kernel path): on AVX-512 in bf16 "the sea" changes at 8 rows, on a Zen 2 (AVX2) "the sky" at 16; each try that
# changes nothing costs the search ten seconds or more.
CANDIDATES = ["Explain why the sky is blue.", "Write a short poem about the sea.", "Tell me a story about a robot."]
ANSWER_TOKENS = 32


def greedy(server: ServerProcess, prompt: str) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": ANSWER_TOKENS,
            "logprobs": True, "top_logprobs": 2, "return_token_ids": True}
    choice = post(server, "/v1/chat/completions", body)["choices"][0]
    return {"ids": choice["token_ids"], "top": [[t["logprob"] for t in e["top_logprobs"]]
                                               for e in choice["logprobs"]["content"]]}


def in_batch(server: ServerProcess, prompt: str, rows: int) -> dict:
    """The page's procedure through the API: rows - 1 other prompts in one streamed completions request, the
    target once they all decode, then the others cut off and the engine idle again."""
    started, stop = threading.Event(), threading.Event()

    def others() -> None:
        body = {"prompt": [f"A few sentences with the words {k} apples and {k + 1} pears:" for k in range(rows - 1)],
                "stream": True, "temperature": 0, "max_tokens": 2 * ANSWER_TOKENS + 16, "ignore_eos": True,
                "logprobs": 0}
        seen: set[int] = set()
        url = server.url + "/v1/completions"
        with httpx.stream("POST", url, json=body, timeout=REPLY_TIMEOUT_MS / 1000) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    seen.update(c["index"] for c in json.loads(line[6:])["choices"])
                if len(seen) == rows - 1:
                    started.set()
                if stop.is_set():
                    return  # hanging up aborts the request

    thread = threading.Thread(target=others)
    thread.start()
    try:
        assert started.wait(REPLY_TIMEOUT_MS / 1000), "the other rows never started"
        return greedy(server, prompt)
    finally:
        stop.set()
        thread.join()
        wait_idle(server)


def wait_idle(server: ServerProcess) -> None:
    deadline = time.monotonic() + 60
    while (requests := server.get("/inspect/engine?steps=0")["requests"])["running"] + requests["waiting"]:
        assert time.monotonic() < deadline, "the engine stayed busy"
        time.sleep(0.05)


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), -1 if len(a) == len(b) else min(len(a), len(b)))


Divergence = tuple[str, int, dict, dict]  # a prompt, a batch's rows, its answer alone and in that batch


@pytest.fixture(scope="module")
def diverging(bf16_server: ServerProcess) -> Divergence | None:
    """A prompt whose greedy answer changes inside some batch on this machine (bf16, without --deterministic),
    found through the API: the prompt, the batch's rows, and the answers alone and in the batch; None where
    none of the candidates changes (this CPU's bf16 kernels gave every row the same bits in these batches)."""
    server = bf16_server
    for prompt in CANDIDATES:
        greedy(server, prompt)  # its pages in the prefix cache, as the page does first
        alone = greedy(server, prompt)
        for rows in (16, 8):
            batched = in_batch(server, prompt, rows)
            if first_divergence(alone["ids"], batched["ids"]) >= 0:
                return prompt, rows, alone, batched
    return None


def run_experiment(ui: Inspector, prompt: str, sizes: str) -> list[dict]:
    ui.tab("divergence")
    for name, value in (("prompt", prompt), ("sizes", sizes), ("tokens", ANSWER_TOKENS), ("tries", 1)):
        ui.page.get_by_test_id(f"divergence-{name}").fill(str(value))
    ui.page.get_by_test_id("divergence-start").click()
    expect(ui.page.get_by_test_id("divergence-run")).to_have_count(len(sizes.split(",")), timeout=REPLY_TIMEOUT_MS)
    expect(ui.page.get_by_test_id("divergence-start")).to_be_enabled(timeout=REPLY_TIMEOUT_MS)
    return ui.page.get_by_test_id("divergence-run").evaluate_all(
        "runs => runs.map(r => ({rows: Number(r.dataset.batchSize), first: Number(r.dataset.firstDivergence),"
        " ids: r.dataset.tokenIds.split(',').map(Number)}))")


def test_a_batch_changes_a_greedy_answer_and_the_page_shows_where(open_page, bf16_server: ServerProcess,
                                                                  diverging: Divergence | None) -> None:
    if diverging is None:
        pytest.skip(f"no greedy answer of {len(CANDIDATES)} prompts ({ANSWER_TOKENS} tokens) changed in a batch of 16 "
                    "or 8 rows here: this CPU's bf16 kernels computed every row alike in those batches")
    prompt, rows, alone, batched = diverging
    at = first_divergence(alone["ids"], batched["ids"])
    ui = open_page(bf16_server)
    runs = run_experiment(ui, prompt, f"1, {rows}")
    assert runs == [{"rows": 1, "first": -1, "ids": alone["ids"]}, {"rows": rows, "first": at, "ids": batched["ids"]}]
    detail = ui.page.get_by_test_id("divergence-detail")
    gaps = [alone["top"][at][0] - alone["top"][at][1], batched["top"][at][0] - batched["top"][at][1]]
    assert [float(detail.get_attribute(f"data-gap-{arm}")) for arm in ("alone", "batch")] == pytest.approx(gaps)
    expect(ui.page.locator("#div-mode")).to_contain_text("without --deterministic")


def test_no_batch_changes_an_answer_under_deterministic(open_page, det_server: ServerProcess,
                                                        diverging: Divergence | None) -> None:
    # the control: without the flag, this batch changed this answer (where one did on this CPU)
    prompt, rows = diverging[:2] if diverging else (CANDIDATES[0], 16)
    ui = open_page(det_server)
    runs = run_experiment(ui, prompt, f"1, {rows}")
    assert [(r["rows"], r["first"]) for r in runs] == [(1, -1), (rows, -1)]
    assert runs[0]["ids"] == greedy(det_server, prompt)["ids"]
    expect(ui.page.locator("#div-mode")).to_contain_text("runs --deterministic")
    expect(ui.page.get_by_test_id("divergence-status")).to_contain_text("No batch size changed the answer")


# ------------------------------------------------------------------ speculative decoding

def test_the_slow_motion_marks_accepted_and_rejected_drafts(open_page, det_server: ServerProcess) -> None:
    ui = open_page(det_server)
    text = ("The river ran through the old city, past the market and the stone bridge, and every morning the "
            "fishermen pulled their boats onto the sand.")
    ask = f"Repeat this sentence word for word: {text}"
    ui.chat(ask, temperature=0, max_tokens=40)
    api = post(det_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": ask}], "temperature": 0,
                                                   "max_tokens": 40, "return_token_ids": True})["choices"][0]
    tokens = ui.page.get_by_test_id("token")
    assert tokens.evaluate_all("s => s.map(x => Number(x.dataset.tokenId))") == api["token_ids"]  # greedy, batch-free
    drafts = tokens.evaluate_all("s => s.map(x => x.dataset.draft === 'accepted')")
    assert drafts == api["draft_accepted"] and sum(drafts) >= 4
    ghosts = ui.page.get_by_test_id("spec-rejected").evaluate_all(
        "g => g.map(x => [Number(x.dataset.step), x.dataset.ids.split(',').map(Number)])")
    assert ghosts == [[k, r] for k, r in enumerate(api["drafts_rejected"]) if r]
    checks = sum(r is not None for r in api["drafts_rejected"])
    summary = ui.page.get_by_test_id("spec-accepted")
    assert int(summary.get_attribute("data-value")) == sum(drafts)
    assert float(summary.get_attribute("data-mean")) == pytest.approx(1 + sum(drafts) / checks)
    ui.select_step(ghosts[0][0])
    expect(ui.page.get_by_test_id("spec-rejected-note")).to_contain_text("the model rejected")
