"""A model that speaks harmony, through every API that shows tool calls, against a real `zhuzi serve`: a stand-in
tiny Llama whose tokenizer carries harmony's markers, scripted to call get_weather (tiny.build_harmony). The
switch is the tokenizer's: the prompt is harmony's whatever the checkpoint's template, with the reasoning effort
asked for, and the reply's commentary message to functions.get_weather comes back as a tool call."""
from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx
import ollama
import openai
import pytest
import tiny
from open_responses import SpecTransport
from server_process import IN_THREAD, ServerProcess, running_server

from zhuzi.tokenizer import Tokenizer

pytestmark = pytest.mark.long  # a minute or more: handed out first (tests/conftest.py)

REPLY = ["<|channel|>", "commentary to=functions.get_weather json", "<|message|>", '{"city": "Paris"}', "<|call|>"]
THOUGHT = ["<|channel|>", "analysis", "<|message|>", "Paris is warm", "<|end|>", "<|start|>", "assistant"]
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Gets the weather.",
                                           "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def gptoss(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Tokenizer]]:
    directory = tmp_path_factory.mktemp("harmony")
    tiny.build_harmony(directory, REPLY)
    with running_server(directory / "server.log", str(directory), "--dtype", "float32", "--num-threads", "1",
                        "--served-model-name", "gptoss", *IN_THREAD) as server:
        yield server, Tokenizer.load(directory)


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The stand-in scripted to think on the analysis channel, message after message, until max_tokens."""
    directory = tmp_path_factory.mktemp("harmony-thinker")
    tiny.build_harmony(directory, THOUGHT)
    with running_server(directory / "server.log", str(directory), "--dtype", "float32", "--num-threads", "1",
                        "--served-model-name", "gptoss", *IN_THREAD) as server:
        yield server


@pytest.fixture
def client(gptoss: tuple[ServerProcess, Tokenizer]) -> openai.OpenAI:
    """Its Responses are checked against the Open Responses specification as they pass (open_responses.py)."""
    return openai.OpenAI(base_url=gptoss[0].api, api_key="none", max_retries=0, timeout=120,
                         http_client=httpx.Client(transport=SpecTransport()))


def test_chat_renders_harmony_with_the_effort_and_returns_the_call(client: openai.OpenAI,
                                                                   gptoss: tuple[ServerProcess, Tokenizer]) -> None:
    reply = client.chat.completions.create(model="gptoss", messages=QUESTION, tools=TOOLS, temperature=0,
                                           reasoning_effort="high", extra_body={"return_token_ids": True})
    prompt = gptoss[1].decode(reply.prompt_token_ids, skip_special_tokens=False)
    assert prompt.startswith("<|start|>system<|message|>") and "\nReasoning: high\n" in prompt
    assert "type get_weather = (_: {\ncity: string,\n}) => any;" in prompt
    assert prompt.endswith("<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant")
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})


def test_a_streamed_call_and_a_reply_without_tools(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model="gptoss", messages=QUESTION, tools=TOOLS, temperature=0,
                                                 stream=True))
    first, *rest = [call for chunk in chunks if chunk.choices for call in chunk.choices[0].delta.tool_calls or []]
    assert (first.index, first.function.name) == (0, "get_weather") and first.id  # then the arguments in pieces
    assert all(c.index == 0 and c.id is None and c.function.name is None for c in rest) and len(rest) > 1
    assert "".join(c.function.arguments for c in [first, *rest]) == '{"city": "Paris"}'
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    plain = client.chat.completions.create(model="gptoss", messages=QUESTION, temperature=0)
    assert plain.choices[0].message.content == '{"city": "Paris"}'  # no tools offered: the message is text


def test_the_render_endpoint_shows_harmony_and_a_constrained_reply_is_refused(
        client: openai.OpenAI, gptoss: tuple[ServerProcess, Tokenizer]) -> None:
    rendered = gptoss[0].post("/v1/chat/completions/render", {"messages": QUESTION, "reasoning_effort": "low"})
    assert rendered["prompt"] == gptoss[1].decode(rendered["token_ids"], skip_special_tokens=False)
    assert "\nReasoning: low\n" in rendered["prompt"]
    shown = gptoss[0].post("/inspect/document", {"messages": QUESTION})
    assert shown["text"] == gptoss[1].decode(shown["token_ids"], skip_special_tokens=False)
    assert "".join(t["token"] for t in shown["tokens"] if t["author"] == "user") == "Weather in Paris?"
    with pytest.raises(openai.BadRequestError, match="harmony"):
        client.chat.completions.create(model="gptoss", messages=QUESTION, response_format={"type": "json_object"})


def test_messages_responses_and_ollama_return_the_call(client: openai.OpenAI,
                                                      gptoss: tuple[ServerProcess, Tokenizer]) -> None:
    claude = anthropic.Anthropic(base_url=gptoss[0].url, api_key="none", max_retries=0, timeout=120)
    message = claude.messages.create(model="gptoss", max_tokens=64, messages=QUESTION, tools=[
        {"name": "get_weather", "description": "Gets the weather.", "input_schema": WEATHER}],
        output_config={"effort": "low"})
    assert message.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in message.content] == [("tool_use", "get_weather", {"city": "Paris"})]
    response = client.responses.create(model="gptoss", input="Weather in Paris?", reasoning={"effort": "low"},
                                       tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER}])
    [item] = response.output
    assert (item.type, item.name, json.loads(item.arguments)) == ("function_call", "get_weather", {"city": "Paris"})
    chat = ollama.Client(host=gptoss[0].url, timeout=120).chat(model="gptoss", messages=QUESTION, tools=TOOLS,
                                                               think="high")
    [call] = chat.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", {"city": "Paris"})


def test_the_analysis_channel_is_reasoning_in_every_api(thinker: ServerProcess) -> None:
    client = openai.OpenAI(base_url=thinker.api, api_key="none", max_retries=0, timeout=120,
                           http_client=httpx.Client(transport=SpecTransport()))
    reply = client.chat.completions.create(model="gptoss", messages=QUESTION, temperature=0, max_tokens=16)
    message, usage = reply.choices[0].message, reply.usage
    assert message.model_extra["reasoning_content"] == "Paris is warmParis is warm" and not message.content
    assert usage.completion_tokens_details.reasoning_tokens == 7  # the first message, to its <|end|>
    chunks = list(client.chat.completions.create(model="gptoss", messages=QUESTION, temperature=0, max_tokens=16,
                                                 stream=True))
    pieces = [c.choices[0].delta.model_extra.get("reasoning_content") for c in chunks if c.choices]
    assert len([p for p in pieces if p]) > 1 and "".join(p for p in pieces if p) == "Paris is warmParis is warm"
    claude = anthropic.Anthropic(base_url=thinker.url, api_key="none", max_retries=0, timeout=120)
    blocks = claude.messages.create(model="gptoss", max_tokens=7, messages=QUESTION).content
    assert [(b.type, b.thinking) for b in blocks] == [("thinking", "Paris is warm")]
    response = client.responses.create(model="gptoss", input="Weather in Paris?", max_output_tokens=7)
    assert [item.type for item in response.output] == ["reasoning"]
    assert response.output[0].content[0].text == "Paris is warm"
    chat = ollama.Client(host=thinker.url, timeout=120).chat(model="gptoss", messages=QUESTION, think="low",
                                                             options={"num_predict": 7})
    assert chat.message.thinking == "Paris is warm" and not chat.message.content
