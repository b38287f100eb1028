"""Drive the inspector page: Debian's Chromium through Playwright, against a real `zhuzi serve` (server_process.py)."""
from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from playwright.sync_api import Browser, Locator, Page, Playwright, expect

if TYPE_CHECKING:  # only a type here: tests/real_weights import this module as server.inspector
    from server_process import ServerProcess

CHROMIUM = Path("/usr/bin/chromium")  # Debian's package: Playwright's own download host is unreachable here
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
REPLY_TIMEOUT_MS = 240_000  # two cores shared with other work: a reply can take a while


def launch(playwright: Playwright) -> Browser:
    if not CHROMIUM.exists():
        raise RuntimeError(f"{CHROMIUM} is missing: `make test` installs Debian's chromium package")
    return playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)


@contextmanager
def inspecting(browser: Browser, server: ServerProcess) -> Iterator[Inspector]:
    """The page on the server in a context of its own; on the way out, no error may have reached its console."""
    expect.set_options(timeout=60_000)  # inspection calls share two busy cores with the step loop
    context = browser.new_context(viewport={"width": 1500, "height": 950})
    page = context.new_page()
    page.set_default_timeout(60_000)
    inspector = Inspector(page, server).open()
    yield inspector
    context.close()
    assert inspector.errors == [], f"the browser console logged errors: {inspector.errors}"


@dataclass
class Inspector:
    """The page, with its console watched: every error it logs fails the test that caused it."""

    page: Page
    server: ServerProcess
    errors: list[str] = field(default_factory=list)

    def open(self) -> Inspector:
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        self.page.goto(self.server.url + "/")
        expect(self.page.get_by_test_id("kv-total")).to_have_attribute("data-value", re.compile(r"^\d+$"))
        return self

    def settings(self, **values: float | int | str) -> None:
        """Fill the chat's sampling settings, e.g. temperature=0, max_tokens=20."""
        details = self.page.locator("details.settings")
        if details.get_attribute("open") is None:
            details.locator("summary").click()
        for name, value in values.items():
            self.page.get_by_test_id("set-" + name.replace("_", "-")).fill(str(value))

    def send(self, text: str) -> None:
        self.page.get_by_test_id("chat-input").fill(text)
        self.page.get_by_test_id("send").click()

    def assistant(self, index: int = -1) -> Locator:
        replies = self.page.get_by_test_id("message-assistant")
        return replies.last if index == -1 else replies.nth(index)

    def wait_reply(self, state: str = "done") -> None:
        """Until the last reply ends, and it must end in `state`."""
        reply = self.assistant()
        expect(reply).to_have_attribute("data-state", re.compile(r"^(done|stopped|error)$"), timeout=REPLY_TIMEOUT_MS)
        expect(reply).to_have_attribute("data-state", state)

    def chat(self, text: str, **settings: float | int | str) -> None:
        """Send a message with these settings and wait for its reply to finish."""
        if settings:
            self.settings(**settings)
        self.send(text)
        self.wait_reply()

    def tab(self, name: str) -> None:
        self.page.get_by_test_id("tab-" + name).click()

    def tokens(self) -> list[dict]:
        return self.page.get_by_test_id("token").evaluate_all(
            "spans => spans.map(s => ({id: Number(s.dataset.tokenId), partial: s.dataset.partial === 'true',"
            " step: Number(s.dataset.step)}))")

    def select_step(self, step: int) -> None:
        self.tab("steps")
        self.page.locator(f'[data-testid=token][data-step="{step}"]').click()
        expect(self.page.get_by_test_id("step-panel").get_by_test_id("candidate").first).to_be_visible()

    def candidates(self) -> list[dict]:
        return self.page.get_by_test_id("step-panel").get_by_test_id("candidate").evaluate_all(
            "rows => rows.map(r => ({id: Number(r.dataset.tokenId), prob: Number(r.dataset.prob),"
            " chosen: r.dataset.chosen === 'true'}))")
