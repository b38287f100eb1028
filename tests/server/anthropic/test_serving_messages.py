"""Anthropic's Messages API end to end: the official `anthropic` client against a real `zhuzi serve` (the
session's server with two API keys), SmolLM2-135M-Instruct at temperature 0 (the SDK no longer has the
sampling arguments: they go in extra_body, as any field the SDK lacks)."""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest
from conftest import CAPITAL, KEYS
from server_process import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
QUESTION = CAPITAL
GREEDY = {"extra_body": {"temperature": 0}}
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def claude(keyed_server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=keyed_server.url, api_key=KEYS[0], max_retries=0, timeout=120)


def events_of(claude: anthropic.Anthropic, **args) -> list:
    with claude.messages.create(model=MODEL, stream=True, **args) as stream:
        return list(stream)


def test_a_plain_answer_with_usage_that_adds_up_to_the_prompt(claude: anthropic.Anthropic, capital_answer: str) -> None:
    message = claude.messages.create(model=MODEL, max_tokens=24, messages=QUESTION, **GREEDY)
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == capital_answer and "Paris" in capital_answer
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    prompt = claude.messages.count_tokens(model=MODEL, messages=QUESTION).input_tokens
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == prompt
    assert 0 < usage.output_tokens < 24
    again = claude.messages.create(model=MODEL, max_tokens=24, messages=QUESTION, **GREEDY).usage
    assert again.cache_read_input_tokens >= prompt // 16 * 16 > 0  # the whole pages of the same prompt
    assert again.input_tokens == prompt - again.cache_read_input_tokens


def test_a_stream_is_anthropics_events_and_adds_up_to_the_whole_answer(claude: anthropic.Anthropic) -> None:
    system = [{"type": "text", "text": "You are a helpful assistant."}]
    args = {"max_tokens": 24, "messages": QUESTION, "system": system, **GREEDY}
    whole = claude.messages.create(model=MODEL, **args)
    events = events_of(claude, **args)
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1:4] == ["content_block_start", "content_block_delta", "content_block_delta"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert events[0].message.content == [] and events[0].message.stop_reason is None
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == whole.content[0].text
    assert events[-2].delta.stop_reason == whole.stop_reason
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    with claude.messages.stream(model=MODEL, **args) as stream:  # the SDK's own accumulator
        assert [block.text for block in stream.get_final_message().content] == [whole.content[0].text]
    raw = httpx.post(f"{claude.base_url}/v1/messages", headers={"x-api-key": KEYS[0]}, timeout=120, json={
        "model": MODEL, "max_tokens": 24, "messages": QUESTION, "stream": True, "temperature": 0})
    assert raw.text.startswith("event: message_start\n") and "event: ping\n" in raw.text  # each event named


def test_stop_sequences_and_max_tokens_say_why_the_answer_ended(claude: anthropic.Anthropic) -> None:
    stopped = claude.messages.create(model=MODEL, max_tokens=24, messages=QUESTION, stop_sequences=["Paris"],
                                     **GREEDY)
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "Paris")
    assert "Paris" not in stopped.content[0].text
    cut = claude.messages.create(model=MODEL, max_tokens=3, messages=QUESTION, **GREEDY)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3


def test_a_forced_tool_call_is_valid_whole_and_streamed(claude: anthropic.Anthropic) -> None:
    args = {"max_tokens": 60, "tools": [WEATHER], "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tool_choice": {"type": "tool", "name": "get_weather"}, **GREEDY}
    message = claude.messages.create(model=MODEL, **args)
    assert message.stop_reason == "tool_use"
    (call,) = message.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id
    jsonschema.validate(call.input, WEATHER["input_schema"])
    events = events_of(claude, **args)
    start = next(e for e in events if e.type == "content_block_start")
    assert (start.content_block.type, start.content_block.name, start.content_block.input) == \
        ("tool_use", "get_weather", {})
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert len(pieces) > 1 and json.loads("".join(pieces)) == call.input  # the arguments stream as written


def test_a_tool_round_trip(claude: anthropic.Anthropic) -> None:
    """The model asks for a tool (forced: a 135M model rarely asks on its own), the result goes back (with
    the assistant's turn as the SDK gives it), and the model answers in text."""
    question = {"role": "user", "content": "What is the weather in Paris?"}
    asked = claude.messages.create(model=MODEL, max_tokens=60, tools=[WEATHER], messages=[question],
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True}, **GREEDY)
    (call,) = asked.content
    turns = [question, asked.to_param(), {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 22 degrees Celsius"},
        {"type": "text", "text": "So, what is it like?"}]}]
    answer = claude.messages.create(model=MODEL, max_tokens=30, tools=[WEATHER], tool_choice={"type": "none"},
                                    messages=turns, **GREEDY)
    assert [b.type for b in answer.content] == ["text"] and answer.content[0].text.strip()
    # The next turn finds the conversation so far in the prefix cache (the first turn's prompt told of the tools,
    # which tool_choice none leaves out: only a turn after `answer` shares its prompt).
    follow_up = [*turns, answer.to_param(), {"role": "user", "content": "Thanks!"}]
    again = claude.messages.create(model=MODEL, max_tokens=5, tools=[WEATHER], tool_choice={"type": "none"},
                                   messages=follow_up, **GREEDY)
    assert again.usage.cache_read_input_tokens >= answer.usage.input_tokens // 16 * 16 - 16
    failed = [*turns[:2], {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                        "content": "city not found", "is_error": True}]}]
    ok = [*turns[:2], {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                    "content": "city not found"}]}]
    count = {"model": MODEL, "tools": [WEATHER]}
    assert claude.messages.count_tokens(messages=failed, **count).input_tokens > \
        claude.messages.count_tokens(messages=ok, **count).input_tokens  # the model is told it failed


def test_thinking_within_a_budget_is_accepted_from_a_model_that_does_not_think(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(model=MODEL, max_tokens=1100, messages=QUESTION, stop_sequences=["."],
                                     thinking={"type": "enabled", "budget_tokens": 1024}, **GREEDY)
    assert [b.type for b in message.content] == ["text"]
    assert message.usage.output_tokens_details is None  # no thought to count


BAD = [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "AA==",
                                                                              "media_type": "image/png"}}]}]},
     "image blocks are not supported"),
    ({"extra_body": {"temperature": 1.5}}, "temperature"),
    ({"extra_body": {"top_k": -1}}, "top_k"),
    ({"extra_body": {"frobnicate": True}}, "frobnicate is not a field"),
    ({"stop_sequences": [""]}, "stop_sequences.0"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "'nope', which is not among the tools"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking.budget_tokens"),
    ({"max_tokens": 2000, "thinking": {"type": "enabled", "budget_tokens": 1024}, "tools": [WEATHER],
      "tool_choice": {"type": "any"}}, "thinking cannot be enabled while tool_choice forces a tool"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "a user message cannot hold tool_use blocks"),
]


@pytest.mark.parametrize("change,words", BAD, ids=[words for _, words in BAD])
def test_a_bad_field_is_anthropics_400_naming_it(claude: anthropic.Anthropic, change: dict, words: str) -> None:
    args = {"model": MODEL, "max_tokens": 8, "messages": QUESTION, **change}
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(**args)
    assert refused.value.body["type"] == "error"
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    assert words in refused.value.body["error"]["message"]


def test_another_model_is_not_found(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="claude-opus-9", max_tokens=8, messages=QUESTION)
    assert missing.value.body["error"]["type"] == "not_found_error"


def test_either_header_carries_the_key(keyed_server: ServerProcess) -> None:
    by_header = anthropic.Anthropic(base_url=keyed_server.url, api_key=KEYS[1], max_retries=0)  # x-api-key
    bearer = anthropic.Anthropic(base_url=keyed_server.url, auth_token=KEYS[1], max_retries=0)  # Authorization
    for client in (by_header, bearer):
        assert client.messages.count_tokens(model=MODEL, messages=QUESTION).input_tokens > 0
    wrong = anthropic.Anthropic(base_url=keyed_server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        wrong.messages.create(model=MODEL, max_tokens=8, messages=QUESTION)
    assert refused.value.body["error"]["type"] == "authentication_error"
    # The SDK will not send a request without a key; plain HTTP can.
    keyless = httpx.post(f"{keyed_server.url}/v1/messages",
                         json={"model": MODEL, "max_tokens": 8, "messages": QUESTION})
    assert keyless.status_code == 401 and keyless.json()["error"]["type"] == "authentication_error"
