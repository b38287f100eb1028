"""The inspector's page on a server of many models (conftest.py's models_server), in a real Chromium: the page
lists the models with their states, each reply says which model answered it, and picking another model makes
the next message name it, which loads it."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
from inspector import Inspector, inspecting
from playwright.sync_api import Browser, expect
from server_process import ServerProcess


@pytest.fixture
def ui(browser: Browser, models_server: ServerProcess) -> Iterator[Inspector]:
    models_server.post("/models/unload", {"model": "b"})
    models_server.post("/models/load", {"model": "a"})  # the page picks a loaded model
    with inspecting(browser, models_server) as inspector:
        yield inspector


def test_the_page_lists_the_models_and_a_picked_one_answers_the_next_message(ui: Inspector) -> None:
    picker = ui.page.get_by_test_id("model-select")
    expect(picker).to_have_value("a")
    listed = [card["id"] for card in ui.server.get("/v1/models")["data"]]
    expect(picker.locator("option")).to_have_count(len(listed))
    assert picker.locator("option").evaluate_all("options => options.map(o => o.value)") == listed
    expect(picker.locator('option[value="b"]')).to_have_attribute("data-state", "unloaded")
    expect(ui.page.locator("#model-name")).to_contain_text("a · ")  # the engine that answers, as it says

    ui.chat("Hi", temperature=0, max_tokens=4)
    expect(ui.assistant()).to_have_attribute("data-model", "a")

    picker.select_option("b")
    expect(ui.page.locator("#banner")).to_contain_text("b is not loaded")
    ui.chat("Hi")
    expect(ui.assistant()).to_have_attribute("data-model", "b")
    expect(picker.locator('option[value="b"]')).to_have_attribute("data-state", "loaded")
    expect(ui.page.locator("#model-name")).to_contain_text("b · ")
    assert {card["id"]: card["state"] for card in ui.server.get("/v1/models")["data"]}["b"] == "loaded"
