"""The screenshots of docs/inspector.md, one per view: python tests/server/inspector_screenshots.py [OUTDIR]

Starts `zhuzi serve` as `make serve` does (bf16, the embedded SmolLM2, a 1 GiB KV pool), has a short chat in
Debian's Chromium, and shoots each view (default OUTDIR: docs/img/inspector).
"""
from __future__ import annotations

import re
import sys
import tempfile
import time
from pathlib import Path

from inspector import Inspector, launch
from playwright.sync_api import expect, sync_playwright
from server_process import running_server

VIEWS = [("1-chat-and-slow-motion", "steps"), ("2-document", "document"), ("3-sampling-lab", "lab"),
         ("4-logit-lens", "lens"), ("5-tokenizer", "bpe"), ("6-name-tree", "tree")]
READY = {"document": "doc-token", "lab": "lab-candidate", "lens": "lens-row", "bpe": "bpe-final", "tree": "tree-first"}


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    expect.set_options(timeout=120_000)
    log = Path(tempfile.mkdtemp()) / "serve.log"
    with running_server(log, "--kv-cache-memory", "1GiB") as server, sync_playwright() as playwright:
        browser = launch(playwright)
        page = browser.new_context(viewport={"width": 1500, "height": 950}).new_page()
        ui = Inspector(page, server).open()
        ui.chat("I just adopted an orange cat. She eats a lot!", temperature=0.7, max_tokens=60, seed=3)
        ui.chat("Suggest a name for her, in bold, and say why in one sentence.")
        page.locator("details.settings summary").click()  # fold the settings away again
        ui.select_step(next((t["step"] for t in ui.tokens() if not_the_top(ui, t["step"])), 0))
        for name, tab in VIEWS:
            ui.tab(tab)
            if tab in READY:
                expect(page.get_by_test_id(READY[tab]).first).to_be_visible()
            time.sleep(0.5)  # let the last frame paint
            page.screenshot(path=str(out / f"{name}.png"))
        ui.tab("engine")
        ui.settings(max_tokens=400)
        page.locator("#new-chat").click()  # a story on its own runs long
        page.locator("details.settings summary").click()
        ui.send("Tell me a long story about a cat who lives in a library.")
        expect(page.get_by_test_id("token").nth(10)).to_be_attached()
        time.sleep(0.6)  # two polls of the engine view, while the reply streams
        page.screenshot(path=str(out / "7-engine.png"))
        if page.get_by_test_id("stop").is_enabled():
            page.get_by_test_id("stop").click()
        expect(ui.assistant()).to_have_attribute("data-state", re.compile("^(done|stopped)$"))
        assert not ui.errors, ui.errors
        browser.close()


def not_the_top(ui: Inspector, step: int) -> bool:
    """Whether the sampler drew something other than the most likely token at this step."""
    ui.select_step(step)
    rows = ui.candidates()
    return bool(rows) and not rows[0]["chosen"]


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/img/inspector"))
