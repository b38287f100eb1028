"""The inspector's tool round trip, walked in the page: Next until the trip ends (each wait bounded), and what
each step added checked against the server's own answers (its rendering of the same messages, its step
records of each request). Shared by the default model's test (tests/server) and Qwen's (tests/real_weights)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx
from playwright.sync_api import expect

if TYPE_CHECKING:
    from inspector import Inspector

STEP_TIMEOUT_MS = 240_000  # one request on two shared cores
MAX_STEPS = 10  # the page stops after two calls: call, run, append, answer, run, append, answer
ENDS = {"no-call", "cut", "answer", "limit", "failed"}


@dataclass
class Step:
    """One Next: what its log line says, and the tool view's document and requests after it."""

    action: str  # call, run, append or answer
    outcome: str  # call, result, error, appended, or how the trip ended (ENDS)
    author: str  # whose writing the step added: assistant (the model) or tool (the program)
    text: str
    doc: list[dict]
    prompt: int  # the document's prompt tokens (the rest the model wrote)
    messages: list[dict]
    requests: list[dict]


def _doc(ui: Inspector) -> list[dict]:
    return ui.page.get_by_test_id("tool-doc").get_by_test_id("doc-token").evaluate_all(
        "s => s.map(x => ({id: Number(x.dataset.tokenId), author: x.dataset.author, generated: !!x.dataset.generated,"
        " cached: !!x.dataset.cached, text: x.textContent}))")


def _requests(ui: Inspector) -> list[dict]:
    return ui.page.get_by_test_id("tool-request").evaluate_all(
        "s => s.map(x => ({id: x.dataset.id, cached: Number(x.dataset.cached), prompt: Number(x.dataset.prompt),"
        " generated: Number(x.dataset.generated)}))")


def walk(ui: Inspector, question: str) -> list[Step]:
    """Ask `question` with the calculator and press Next until the button says Done."""
    page = ui.page
    ui.tab("tools")
    page.get_by_test_id("tool-question").fill(question)
    button, log = page.get_by_test_id("tool-next"), page.get_by_test_id("tool-log-step")
    steps: list[Step] = []
    while len(steps) < MAX_STEPS:
        expect(button).to_be_enabled()
        button.click()
        expect(log).to_have_count(len(steps) + 1, timeout=STEP_TIMEOUT_MS)
        line = log.nth(len(steps))
        box = page.get_by_test_id("tool-doc")
        steps.append(Step(line.get_attribute("data-action"), line.get_attribute("data-outcome"),
                          line.get_attribute("data-author"), line.text_content(), _doc(ui),
                          int(box.get_attribute("data-prompt")), json.loads(box.get_attribute("data-messages")),
                          _requests(ui)))
        if steps[-1].outcome in ENDS:
            expect(button).to_have_text("Done")
            expect(button).to_be_disabled()
            return steps
    raise AssertionError(f"the trip did not end in {MAX_STEPS} steps: {[s.outcome for s in steps]}")


def squash(text: str) -> str:
    """Text without whitespace, however the document shows it (· for a space, ↵ for a newline)."""
    return re.sub(r"[\s·↵⇥]+", "", text)


def _post(ui: Inspector, path: str, body: dict) -> dict:
    response = httpx.post(ui.server.url + path, json=body, timeout=STEP_TIMEOUT_MS / 1000)
    response.raise_for_status()
    return response.json()


def _prefilled(ui: Inspector, request_id: str) -> int:
    """The prompt tokens the request computed, by the engine's step records."""
    steps = ui.server.get(f"/inspect/batch?steps=256&request_id={request_id}")["steps"]
    return sum(row["tokens"] for step in steps for row in step["rows"] if row["yours"] and row["kind"] == "prefill")


def check(ui: Inspector, steps: list[Step]) -> None:
    """What each step added: a request's generated tokens (model-written, and its cached prefix shaded as the
    engine counted it), the tool's result (the page's arithmetic, redone here), the call and result appended
    (the server's own rendering, the result program-written)."""
    tools = ui.page.evaluate("async () => (await import('/static/js/toolbox.js')).TOOLS")
    assert steps[0].action == "call" and steps[-1].outcome in ENDS
    before: Step | None = None
    for step in steps:
        if step.action in ("call", "answer"):
            assert len(step.requests) == (len(before.requests) if before else 0) + 1, "each request is listed"
            request = step.requests[-1]
            written = step.doc[step.prompt:]
            assert len(written) == request["generated"] > 0 and {t["author"] for t in written} == {"assistant"}
            assert all(t["generated"] for t in written) and not any(t["generated"] for t in step.doc[:step.prompt])
            assert step.prompt == request["prompt"]
            assert sum(t["cached"] for t in step.doc) == request["cached"]
            assert _prefilled(ui, request["id"]) == request["prompt"] - request["cached"]
            if before is not None:  # the document it read is the one the program appended to
                assert [t["id"] for t in step.doc[:step.prompt]] == [t["id"] for t in before.doc]
                assert request["cached"] >= request["prompt"] // 2, "a request re-reads the last one's pages"
            if step.outcome in ("no-call", "cut", "answer"):  # what it wrote instead of a call, in one line
                quote = ui.page.get_by_test_id("tool-log-step").last.get_by_test_id("tool-wrote").text_content()
                wrote = "".join(t["text"] for t in written if t["text"] and not t["text"].startswith("<|"))
                assert squash(quote) and squash(quote) in squash(wrote), (quote, wrote)
        elif step.action == "run":
            assert step.author == "tool" and step.doc == before.doc, "running the tool writes nothing in the document"
            call = re.search(r"calculator\((\{.*\})\)", before.text, re.DOTALL)
            assert call, before.text
            expression = json.loads(call.group(1))["expression"]
            if step.outcome == "result":
                assert re.fullmatch(r"[\d\s+*/().-]+", expression), f"the model wrote {expression!r}"
                value = eval(expression)  # digits and operators only
                assert re.search(rf"arguments: {re.escape(str(value))} \(", step.text), step.text
        else:
            assert step.action == "append" and step.author == "tool"
            result = step.messages[-1]
            assert result["role"] == "tool" and step.messages[-2]["tool_calls"][0]["function"]["name"] == "calculator"
            assert result["content"] in before.text
            document = _post(ui, "/inspect/document", {"messages": step.messages, "tools": tools})
            assert [t["id"] for t in step.doc] == document["token_ids"] and step.prompt == len(step.doc)
            assert result["content"] in "".join(t["text"] for t in step.doc if t["author"] == "tool")
        before = step
