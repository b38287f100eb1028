"""A real tool-calling model through the openai client: Qwen2.5-Coder-0.5B-Instruct, whose template renders the
tools and which writes Hermes <tool_call> blocks, asked about the weather with a get_weather tool: its call,
the tool's result back as a `tool` message, an answer that uses it; calls forced by tool_choice; calls
streamed as OpenAI's deltas."""
import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.models

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city's name"}},
                   "required": ["city"]}}}
QUESTION = [{"role": "user", "content": "What's the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def client(qwen_server):
    return openai.OpenAI(api_key="none", base_url=qwen_server.api, max_retries=0, timeout=600)


def ask(client: openai.OpenAI, messages: list, **extra):
    return client.chat.completions.create(model=client.models.list().data[0].id, messages=messages,
                                          tools=[WEATHER], temperature=0, max_tokens=64, **extra)


def test_a_weather_question_calls_the_tool_and_the_answer_uses_its_result(client):
    """The 0.5B writes its call as bare JSON (no tags), which the server parses as llama.cpp does. Given the
    result it answers by writing its call again and then the result's data, so the client asks for the final
    answer with tool_choice "none" (calls stay text): the answer carries what only the tool message said."""
    first = ask(client, QUESTION).choices[0]
    assert first.finish_reason == "tool_calls" and not first.message.content
    [call] = first.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert "paris" in json.loads(call.function.arguments)["city"].lower()
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_celsius": 23, "sky": "sunny"}'}
    answer = ask(client, QUESTION + [first.message.model_dump(exclude_none=True), result],
                 tool_choice="none").choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    assert "23" in answer.message.content and "sunny" in answer.message.content.lower()


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_tool_choice_forces_a_valid_call(client, choice):
    """Even to a greeting: one call (parallel_tool_calls false), its arguments valid under the schema."""
    reply = ask(client, [{"role": "user", "content": "Hello! Who are you?"}], tool_choice=choice,
                parallel_tool_calls=False).choices[0]
    assert reply.finish_reason == "tool_calls"
    [call] = reply.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_a_streamed_call_comes_as_tool_calls_deltas(client):
    whole = ask(client, QUESTION).choices[0].message.tool_calls[0]
    deltas = [chunk.choices[0] for chunk in ask(client, QUESTION, stream=True) if chunk.choices]
    calls = [d.delta.tool_calls[0] for d in deltas if d.delta.tool_calls]
    assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather" and calls[0].index == 0
    assert json.loads("".join(c.function.arguments or "" for c in calls)) == json.loads(whole.function.arguments)
    assert deltas[-1].finish_reason == "tool_calls"
