"""A server with prompt-lookup speculation (conftest.py's det_server, shared with the inspector's views), through
the real openai client: streamed chunks may carry several tokens (each with its logprob) and add up to the
non-streamed answer; /metrics counts drafts and acceptances; with return_token_ids each token says whether it
was an accepted draft, as the step records do."""
from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_process import ServerProcess

TEXT = ("The river ran through the old city, past the market and the stone bridge, and every morning the "
        "fishermen pulled their boats onto the sand before the sun rose over the hills.")


@pytest.fixture
def server(det_server: ServerProcess) -> ServerProcess:
    return det_server


def spec_counts(server: ServerProcess) -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)
            for s in f.samples if s.name.startswith("zhuzi:spec_decode_num_")}


def test_streamed_chunks_carry_accepted_runs_and_add_up_to_the_answer(server: ServerProcess) -> None:
    client = openai.OpenAI(api_key="none", base_url=server.api, max_retries=0, timeout=120)
    ask = dict(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=40, logprobs=True,
               messages=[{"role": "user", "content": f"Repeat this sentence word for word: {TEXT}"}])
    before = spec_counts(server)  # a shared server: this test's own drafts are the difference
    whole = client.chat.completions.create(**ask)
    chunks = [c for c in client.chat.completions.create(**ask, stream=True) if c.choices]
    streamed = [lp for c in chunks if c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert [lp.token for lp in streamed] == [lp.token for lp in whole.choices[0].logprobs.content]
    assert len(streamed) == whole.usage.completion_tokens
    assert max(len(c.choices[0].logprobs.content) for c in chunks if c.choices[0].logprobs) >= 3
    after = spec_counts(server)
    delta = {name.split("num_")[1]: after[name] - before[name] for name in after}
    assert delta["draft_tokens_total"] >= delta["accepted_tokens_total"] >= 4


def test_each_token_says_whether_it_was_an_accepted_draft(server: ServerProcess) -> None:
    client = openai.OpenAI(api_key="none", base_url=server.api, max_retries=0, timeout=120)
    before = spec_counts(server)
    chunks = [c for c in client.chat.completions.create(
        model="SmolLM2-135M-Instruct", temperature=0, max_tokens=40, stream=True,
        messages=[{"role": "user", "content": f"Repeat this sentence word for word: {TEXT}"}],
        extra_body={"return_token_ids": True, "ignore_eos": True}) if c.choices]
    after = spec_counts(server)
    marked = [c.choices[0].model_extra for c in chunks if c.choices[0].model_extra.get("token_ids")]
    ids = [t for m in marked for t in m["token_ids"]]
    accepted = [a for m in marked for a in m["draft_accepted"]]
    rejected = [r for m in marked for r in m["drafts_rejected"]]
    assert len(ids) == len(accepted) == len(rejected) == 40
    delta = {name.split("num_")[1]: after[name] - before[name] for name in after}
    assert sum(accepted) == delta["accepted_tokens_total"] >= 4
    assert sum(r is not None for r in rejected) == delta["drafts_total"]
    assert sum(accepted) + sum(len(r or []) for r in rejected) == delta["draft_tokens_total"]
    rows = [row for step in server.get(f"/inspect/batch?steps=64&request_id={chunks[0].id}")["steps"]
            for row in step["rows"] if row["yours"]]
    verify = [row for row in rows if row["kind"] == "verify"]
    assert len(verify) == delta["drafts_total"] and sum(row["accepted"] for row in verify) == sum(accepted)
