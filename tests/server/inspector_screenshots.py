"""The screenshots of docs/inspector.md, one per view: python tests/server/inspector_screenshots.py [OUTDIR]

Starts `zhuzi serve` on the embedded SmolLM2 with dense bf16 weights (`--quantization none`: batches change
greedy answers there, which the divergence view shows) and a 1 GiB KV pool, has a short chat in
Debian's Chromium, and shoots each view (default OUTDIR: docs/img/inspector); then the batch view beside other
requests and the divergence experiment; then, on a second server that speculates, the slow motion of a reply
with accepted drafts; then a whole tool round trip on Qwen2.5-Coder-0.5B-Instruct (tests/real_models.py fetches
its GGUF), a model whose template writes the tools.
"""
from __future__ import annotations

import re
import sys
import tempfile
import threading
import time
from pathlib import Path

from inspector import REPLY_TIMEOUT_MS, Inspector, launch
from inspector_trip import walk
from playwright.sync_api import Browser, expect, sync_playwright
from server_process import ServerProcess, running_server

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/, for real_models when run as a script
from real_models import QWEN_0_5B, fetch  # noqa: E402

VIEWS = [("1-chat-and-slow-motion", "steps"), ("2-document", "document"), ("3-sampling-lab", "lab"),
         ("4-logit-lens", "lens"), ("5-tokenizer", "bpe"), ("6-name-tree", "tree")]
READY = {"document": "doc-token", "lab": "lab-candidate", "lens": "lens-row", "bpe": "bpe-final", "tree": "tree-first"}
NGRAM = '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    expect.set_options(timeout=REPLY_TIMEOUT_MS)
    logs = Path(tempfile.mkdtemp())
    with sync_playwright() as playwright:
        browser = launch(playwright)
        with running_server(logs / "serve.log", "--kv-cache-memory", "1GiB", "--quantization", "none") as server:
            ui = open_page(browser, server)
            chat_views(ui, out)
            engine_view(ui, out)
            batch_view(ui, out)
            divergence_view(ui, out)
            assert not ui.errors, ui.errors
        with running_server(logs / "spec.log", "--kv-cache-memory", "1GiB", "--speculative-config", NGRAM) as server:
            ui = open_page(browser, server)
            ui.chat("Repeat this sentence word for word: The river ran through the old city, past the market and the "
                    "stone bridge, and every morning the fishermen pulled their boats onto the sand.",
                    temperature=0, max_tokens=48)
            fold_settings(ui)
            ui.select_step(next(t["step"] for t in ui.tokens() if rejected_at(ui, t["step"])))
            shoot(ui, out / "8-speculative.png")
            assert not ui.errors, ui.errors
        tool_view(browser, logs, out)
        browser.close()


def open_page(browser: Browser, server: ServerProcess) -> Inspector:
    page = browser.new_context(viewport={"width": 1500, "height": 950}).new_page()
    page.set_default_timeout(REPLY_TIMEOUT_MS)
    return Inspector(page, server).open()


def shoot(ui: Inspector, path: Path) -> None:
    time.sleep(0.5)  # let the last frame paint
    ui.page.screenshot(path=str(path))


def fold_settings(ui: Inspector) -> None:
    if ui.page.locator("details.settings").get_attribute("open") is not None:
        ui.page.locator("details.settings summary").click()


def chat_views(ui: Inspector, out: Path) -> None:
    ui.chat("I just adopted an orange cat. She eats a lot!", temperature=0.7, max_tokens=60, seed=3)
    ui.chat("Suggest a name for her, in bold, and say why in one sentence.")
    fold_settings(ui)
    ui.select_step(next((t["step"] for t in ui.tokens() if not_the_top(ui, t["step"])), 0))
    for name, tab in VIEWS:
        ui.tab(tab)
        if tab in READY:
            expect(ui.page.get_by_test_id(READY[tab]).first).to_be_visible()
        shoot(ui, out / f"{name}.png")


def engine_view(ui: Inspector, out: Path) -> None:
    ui.tab("engine")
    ui.settings(max_tokens=400)
    ui.page.locator("#new-chat").click()  # a story on its own runs long
    fold_settings(ui)
    ui.send("Tell me a long story about a cat who lives in a library.")
    expect(ui.page.get_by_test_id("token").nth(10)).to_be_attached()
    time.sleep(0.6)  # two polls of the engine view, while the reply streams
    ui.page.screenshot(path=str(out / "7-engine.png"))
    if ui.page.get_by_test_id("stop").is_enabled():
        ui.page.get_by_test_id("stop").click()
    expect(ui.assistant()).to_have_attribute("data-state", re.compile("^(done|stopped)$"))


def batch_view(ui: Inspector, out: Path) -> None:
    """A reply while three other clients ask questions of their own."""
    def stranger(n: int) -> None:
        time.sleep(0.3 * n)
        question = [{"role": "user", "content": f"Tell me about the number {n}."}]
        ui.server.post("/v1/chat/completions", {"messages": question, "max_tokens": 12 + 6 * n, "temperature": 0.8})

    ui.tab("batch")
    ui.settings(max_tokens=40, temperature=0)
    fold_settings(ui)
    ui.send("Name five rivers of Europe.")
    strangers = [threading.Thread(target=stranger, args=(n,)) for n in range(1, 4)]
    for thread in strangers:
        thread.start()
    ui.wait_reply()
    for thread in strangers:
        thread.join()
    strip = ui.page.get_by_test_id("batch-strip")
    expect(strip.locator("[data-testid=batch-step]:not([data-yours='0'])").first).to_be_attached()
    ui.page.get_by_test_id("batch-pause").check()
    busiest = max(strip.get_by_test_id("batch-step").all(), key=lambda c: int(c.get_attribute("data-rows")))
    busiest.click()
    shoot(ui, out / "9-batch.png")
    ui.page.get_by_test_id("batch-pause").uncheck()


def divergence_view(ui: Inspector, out: Path) -> None:
    ui.tab("divergence")
    ui.page.get_by_test_id("divergence-prompt").fill("Write a short poem about the sea.")
    ui.page.get_by_test_id("divergence-start").click()
    expect(ui.page.get_by_test_id("divergence-run")).to_have_count(4)
    expect(ui.page.get_by_test_id("divergence-start")).to_be_enabled()
    shoot(ui, out / "10-divergence.png")


def tool_view(browser: Browser, logs: Path, out: Path) -> None:
    """The whole trip, on a page tall enough to hold its document and its log."""
    with running_server(logs / "qwen.log", str(fetch(QWEN_0_5B)), "--max-model-len", "4096",
                        "--kv-cache-memory", "256MiB") as server:
        ui = open_page(browser, server)
        walk(ui, "What is 17 times 23?")
        ui.page.set_viewport_size({"width": 1500, "height": 2300})
        shoot(ui, out / "11-tool-call.png")
        assert not ui.errors, ui.errors


def not_the_top(ui: Inspector, step: int) -> bool:
    """Whether the sampler drew something other than the most likely token at this step."""
    ui.select_step(step)
    rows = ui.candidates()
    return bool(rows) and not rows[0]["chosen"]


def rejected_at(ui: Inspector, step: int) -> bool:
    return ui.page.locator(f'[data-testid=spec-rejected][data-step="{step}"]').count() > 0


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/img/inspector"))
