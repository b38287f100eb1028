"""The inspector's tool round trip on a model that calls on its own: Qwen2.5-Coder-0.5B-Instruct, whose template
renders the tools (tool_choice "auto"), in Debian's Chromium against a real `zhuzi serve`: the trip has the
call, the tool's result and an answer, each step checked as on the default model (server/inspector_trip.py)."""
from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from playwright.sync_api import Page, expect, sync_playwright
from server.inspector import Inspector, launch
from server.inspector_trip import check, walk
from server.server_process import ServerProcess

pytestmark = pytest.mark.models


@pytest.fixture
def page() -> Iterator[Page]:
    with sync_playwright() as playwright:
        browser = launch(playwright)
        page = browser.new_page(viewport={"width": 1500, "height": 950})
        page.set_default_timeout(120_000)
        expect.set_options(timeout=120_000)
        yield page
        browser.close()


def test_the_trip_has_the_call_the_result_and_the_answer(page: Page, qwen_server: ServerProcess) -> None:
    ui = Inspector(page, qwen_server).open()
    steps = walk(ui, "What is 17 times 23?")
    check(ui, steps)
    expect(page.get_by_test_id("tool-template")).to_have_attribute("data-tool-prompt", "template")
    call = steps[0].messages  # the document before the call: the question alone
    assert call == [{"role": "user", "content": "What is 17 times 23?"}] and steps[0].outcome == "call"
    assert "calculator" in steps[0].text and steps[1].outcome == "result" and "391" in steps[1].text
    [first_call] = steps[2].messages[1]["tool_calls"]
    assert json.loads(first_call["function"]["arguments"]) == {"expression": "17 * 23"}
    assert steps[2].messages[2] == {"role": "tool", "tool_call_id": first_call["id"], "content": "391"}
    assert steps[-1].action == "answer" and steps[-1].outcome == "answer", [s.outcome for s in steps]
    assert "391" in steps[-1].text, "the answer carries the tool's result"
    assert ui.errors == [], f"the browser console logged errors: {ui.errors}"
