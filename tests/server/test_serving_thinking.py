"""Thinking through every API, on a tiny random Qwen3 that thinks (tiny.build_thinking: its template opens a
thought that the random model never closes): the budget each API names ends the thought at its count, the
thought comes back as reasoning (chat), thinking blocks (Messages) or a reasoning item (Responses), and
usage counts its tokens apart."""
from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest
import tiny
from open_responses import SpecTransport
from server_process import IN_THREAD, ServerProcess, running_server

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def serve_tiny(tmp_path_factory: pytest.TempPathFactory, name: str, build) -> Iterator[ServerProcess]:
    """A server of the tiny checkpoint build() writes, in float32, served as name."""
    directory = tmp_path_factory.mktemp(name)
    build(directory)
    with running_server(directory / "server.log", str(directory), "--dtype", "float32", "--num-threads", "1",
                        "--served-model-name", name, *IN_THREAD) as server:
        yield server


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from serve_tiny(tmp_path_factory, "thinker", tiny.build_thinking)


def test_chat_reasoning_ends_at_the_thinking_token_budget(thinker: ServerProcess) -> None:
    client = openai.OpenAI(base_url=thinker.api, api_key="none", max_retries=0)
    reply = client.chat.completions.create(model="thinker", messages=QUESTION, temperature=0, max_tokens=12,
                                           extra_body={"thinking_token_budget": 5})
    message, usage = reply.choices[0].message, reply.usage
    assert message.model_extra["reasoning_content"] and message.content  # the answer follows the thought
    assert usage.completion_tokens_details.reasoning_tokens == 6  # five tokens of thought and </think>
    unbounded = client.chat.completions.create(model="thinker", messages=QUESTION, temperature=0, max_tokens=12)
    assert unbounded.choices[0].message.content is None or not unbounded.choices[0].message.content
    assert unbounded.usage.completion_tokens_details.reasoning_tokens == 12


def test_messages_thinking_comes_back_as_thinking_blocks_within_the_budget(thinker: ServerProcess) -> None:
    claude = anthropic.Anthropic(base_url=thinker.url, api_key="none", max_retries=0, timeout=300)
    message = claude.messages.create(model="thinker", max_tokens=1030, messages=QUESTION, extra_body={
        "temperature": 0}, thinking={"type": "enabled", "budget_tokens": 1024})
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.usage.output_tokens_details.thinking_tokens == 1025 and message.usage.output_tokens == 1030
    with claude.messages.create(model="thinker", max_tokens=6, messages=QUESTION, stream=True,
                                thinking={"type": "adaptive"}) as stream:
        events = list(stream)
    start = next(e for e in events if e.type == "content_block_start")
    assert start.content_block.type == "thinking"
    assert [e.delta.type for e in events if e.type == "content_block_delta"][-1] == "signature_delta"
    assert "".join(e.delta.thinking for e in events if e.type == "content_block_delta"
                   and e.delta.type == "thinking_delta")
    assert events[-2].usage.output_tokens_details.thinking_tokens == 6


def test_responses_reasoning_effort_bounds_the_reasoning_item(thinker: ServerProcess) -> None:
    client = openai.OpenAI(base_url=thinker.api, api_key="none", max_retries=0, timeout=300)
    args = {"model": "thinker", "input": "What is the capital of France?", "temperature": 0,
            "max_output_tokens": 260, "reasoning": {"effort": "minimal"}}
    response = client.responses.create(**args)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text and response.output_text
    assert response.usage.output_tokens_details.reasoning_tokens == 257  # 256 and </think>
    events = list(client.responses.create(stream=True, **args))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning.delta")  # Open Responses' name
    assert thought == response.output[0].content[0].text
    assert events[-1].response.output_text == response.output_text


def test_a_streamed_thought_is_as_open_responses_writes_it(thinker: ServerProcess) -> None:
    """The reasoning item's events, response.reasoning.delta and .done, and the Response around them, checked
    against the Open Responses specification's schema as they pass (open_responses.py)."""
    client = openai.OpenAI(base_url=thinker.api, api_key="none", max_retries=0, timeout=300,
                           http_client=httpx.Client(transport=SpecTransport()))
    events = list(client.responses.create(model="thinker", input="What is the capital of France?", stream=True,
                                          temperature=0, max_output_tokens=6))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning.delta")
    done = [e for e in events if e.type == "response.reasoning.done"]
    final = events[-1].response
    assert (final.status, [item.type for item in final.output]) == ("incomplete", ["reasoning"])
    assert thought and [e.text for e in done] == [thought] == [final.output[0].content[0].text]


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A tiny random Gemma 4 whose thought is a channel of special tokens (tiny.build_gemma4_thinking)."""
    yield from serve_tiny(tmp_path_factory, "gemma4", tiny.build_gemma4_thinking)


def test_gemma4_thought_channel_comes_back_as_reasoning_within_the_budget(gemma4: ServerProcess) -> None:
    """enable_thinking opens the thought channel; the budget closes it with <channel|>, and the answer follows.
    Without it the template writes an empty thought: all content."""
    client = openai.OpenAI(base_url=gemma4.api, api_key="none", max_retries=0)
    reply = client.chat.completions.create(model="gemma4", messages=QUESTION, temperature=0, max_tokens=12,
                                           extra_body={"thinking_token_budget": 5,
                                                       "chat_template_kwargs": {"enable_thinking": True}})
    message = reply.choices[0].message
    assert message.model_extra["reasoning_content"] and message.content
    assert "<" not in message.model_extra["reasoning_content"] + message.content  # no tag shown
    assert reply.usage.completion_tokens_details.reasoning_tokens == 6  # five tokens of thought and <channel|>
    plain = client.chat.completions.create(model="gemma4", messages=QUESTION, temperature=0, max_tokens=12)
    assert plain.choices[0].message.content and not plain.choices[0].message.model_extra.get("reasoning_content")
