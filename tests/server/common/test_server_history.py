"""A malformed tool-call history through the official clients, unmodified, against a real `zhuzi serve` (the
session's server with API keys): each API answers 400 with its own error object, naming the message's index and
field, before anything runs; a history as agents send it (a call without arguments sent as "") is answered."""
from __future__ import annotations

import anthropic
import ollama
import openai
import pytest
from conftest import KEYS
from server_process import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What's the weather in Paris?"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def call(arguments: str = '{"city": "Paris"}', call_id: str = "call_1") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


def chat_history(calls: list[dict], call_id: str = "call_1") -> list[dict]:
    return [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": call_id, "content": "23 C"}]


@pytest.fixture(scope="module")
def client(keyed_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(api_key=KEYS[0], base_url=keyed_server.api, max_retries=0, timeout=120)


@pytest.mark.parametrize(("messages", "param", "words"), [
    (chat_history([call()], "call_2"), "messages.2.tool_call_id", "'call_2' is the id of no earlier tool call"),
    (chat_history([call('{"city": "Par')]), "messages.1.tool_calls.0.function.arguments", "must be JSON text"),
    (chat_history([call('["Paris"]')]), "messages.1.tool_calls.0.function.arguments", "must be a JSON object"),
    (chat_history([call()])[:1] + chat_history([call()])[2:], "messages.1.tool_call_id",
     "no assistant message before it calls a tool"),
], ids=["unknown-id", "not-json", "not-an-object", "no-call"])
def test_openai_chat_refuses_a_malformed_history(client: openai.OpenAI, messages: list, param: str,
                                                  words: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert refused.value.body["param"] == param
    assert refused.value.body["message"].startswith(f"{param}: ") and words in refused.value.body["message"]


def test_a_call_without_arguments_sent_back_empty_is_answered(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=chat_history([call("")]), max_tokens=1)
    assert reply.choices[0].finish_reason == "length"


def test_the_responses_api_refuses_a_malformed_history(client: openai.OpenAI) -> None:
    items = [{"role": "user", "content": QUESTION},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "Paris"},
             {"type": "function_call_output", "call_id": "call_1", "output": "23 C"}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input=items, max_output_tokens=16, store=False)
    assert refused.value.body["param"] == "input.1.arguments" and "must be JSON text" in refused.value.body["message"]
    items[1]["arguments"] = "{}"
    items[2]["call_id"] = "call_2"
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input=items, max_output_tokens=16, store=False)
    assert refused.value.body["param"] == "input.2.call_id"


def test_anthropic_messages_refuses_a_result_of_no_call(keyed_server: ServerProcess) -> None:
    claude = anthropic.Anthropic(base_url=keyed_server.url, api_key=KEYS[0], max_retries=0, timeout=120)
    messages = [{"role": "user", "content": QUESTION},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                   "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "text", "text": "Here:"},
                                             {"type": "tool_result", "tool_use_id": "toolu_2", "content": "23 C"}]}]
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model=MODEL, max_tokens=1, messages=messages,
                               tools=[{"name": "get_weather", "input_schema": WEATHER}])
    error = refused.value.body["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"] == "messages.2.content.1.tool_use_id: 'toolu_2' is the id of no earlier tool call"


def test_ollama_refuses_a_result_of_no_call(keyed_server: ServerProcess) -> None:
    client = ollama.Client(host=keyed_server.url, headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=120)
    messages = [{"role": "user", "content": QUESTION},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "tool_name": "get_time", "content": "noon"}]
    with pytest.raises(ollama.ResponseError) as refused:
        client.chat(model=MODEL, messages=messages, options={"num_predict": 1})
    assert refused.value.status_code == 400
    assert refused.value.error == "messages.2.tool_name: no earlier tool call is of 'get_time'"
    messages[2]["tool_name"] = "get_weather"  # as Ollama's clients send a result: no id, the function's name
    assert client.chat(model=MODEL, messages=messages, options={"num_predict": 1}).done_reason == "length"
