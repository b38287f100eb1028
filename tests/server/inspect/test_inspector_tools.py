"""The inspector's tool round trip (static/js/tools.js) on the default model, driven in Chromium against a real
`zhuzi serve` (conftest.py's inspect_server): Next until the trip ends, each step's addition checked against the
server's own answers (inspector_trip.py). SmolLM2 is forced to call; whatever it writes after the result, the
trip ends in a bounded number of steps, and says how in one line."""
from __future__ import annotations

import pytest
from inspector import Inspector
from inspector_trip import ENDS, check, walk
from playwright.sync_api import expect

pytestmark = pytest.mark.long  # a minute or more: handed out first (tests/conftest.py)


def test_next_walks_the_trip_until_it_ends_and_each_step_adds_its_part(inspector: Inspector) -> None:
    steps = walk(inspector, "What is 17 times 23?")
    check(inspector, steps)
    expect(inspector.page.get_by_test_id("tool-template")).to_have_attribute("data-tool-prompt", "generic")
    first = steps[0]
    assert first.messages == [{"role": "user", "content": "What is 17 times 23?"}], "the question as typed"
    if first.outcome == "call":  # forced, under the calculator's schema: arithmetic, then the tool and the result
        assert [s.action for s in steps[1:3]] == ["run", "append"]
        assert steps[1].outcome == "result" and steps[3].action == "answer"
    assert steps[-1].outcome in ENDS - {"failed"}, steps[-1].text


def test_the_model_list_comes_from_the_server(inspector: Inspector) -> None:
    inspector.tab("tools")
    models = inspector.page.get_by_test_id("tool-model")
    expect(models).to_have_attribute("data-count", "1")
    assert models.evaluate("s => [...s.options].map(o => o.value)") == \
        [m["id"] for m in inspector.server.get("/v1/models")["data"]]
    expect(inspector.page.get_by_test_id("tool-model-hint")).to_contain_text("Qwen2.5-Coder")
