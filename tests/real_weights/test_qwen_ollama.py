"""The `ollama` Python client, unmodified, on a real tool-calling model: Qwen2.5-Coder-0.5B-Instruct's GGUF behind a
real `zhuzi serve` (tests/real_weights/conftest.py), greedy: the model listed and shown, a chat whole and streamed,
generate, and a tool call that the client gets in Ollama's shape, whose result goes back for the answer."""
from __future__ import annotations

import jsonschema
import ollama
import pytest
from server.server_process import ServerProcess

pytestmark = pytest.mark.models

GREEDY = {"temperature": 0, "seed": 7, "num_predict": 48}
QUESTION = [{"role": "user", "content": "What's the weather like in Paris right now?"}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def get_weather(city: str) -> str:
    """Get the current weather in a city.

    Args:
      city: The city's name
    """
    return '{"temperature_celsius": 23, "sky": "sunny"}'


@pytest.fixture(scope="module")
def client(qwen_server: ServerProcess) -> ollama.Client:
    return ollama.Client(host=qwen_server.url, timeout=600)


@pytest.fixture(scope="module")
def model(client: ollama.Client) -> str:
    (listed,) = client.list().models
    return listed.model


def test_the_gguf_is_listed_and_shown_as_a_qwen2_with_tools(client: ollama.Client, model: str) -> None:
    (listed,) = client.list().models
    assert model.endswith(":latest") and listed.size > 300_000_000  # the 0.5B's Q4_K_M file
    assert (listed.details.format, listed.details.family) == ("gguf", "qwen2")
    shown = client.show(model)
    assert "tools" in shown.capabilities and shown.modelinfo["general.architecture"] == "qwen2"
    assert "<tool_call>" in shown.template


def test_a_chat_whole_and_streamed_say_the_same(client: ollama.Client, model: str) -> None:
    asked = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    whole = client.chat(model=model, messages=asked, options=GREEDY)
    assert whole.done and "Paris" in whole.message.content and whole.eval_count > 0
    parts = list(client.chat(model=model, messages=asked, options=GREEDY, stream=True))
    assert len(parts) > 2 and [part.done for part in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(part.message.content for part in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count


def test_generate_answers_a_prompt_whole_and_streamed(client: ollama.Client, model: str) -> None:
    prompt = "Write a Python function that returns the square of a number."
    whole = client.generate(model=model, prompt=prompt, options=GREEDY)
    assert "def " in whole.response and whole.done_reason in ("stop", "length")
    parts = list(client.generate(model=model, prompt=prompt, options=GREEDY, stream=True))
    assert "".join(part.response for part in parts) == whole.response and parts[-1].done


def test_the_model_calls_the_tool_and_answers_from_its_result(client: ollama.Client, model: str) -> None:
    """Ollama's API has no tool_choice: the 0.5B calls get_weather on its own, at temperature 0."""
    first = client.chat(model=model, messages=QUESTION, tools=[get_weather], options=GREEDY)
    (call,) = first.message.tool_calls
    assert call.function.name == "get_weather" and not first.message.content
    jsonschema.validate(dict(call.function.arguments), CITY)  # an object, as Ollama gives arguments
    assert "paris" in call.function.arguments["city"].lower()
    streamed = list(client.chat(model=model, messages=QUESTION, tools=[get_weather], options=GREEDY, stream=True))
    assert [c for part in streamed for c in part.message.tool_calls or []] == [call]
    result = {"role": "tool", "tool_name": "get_weather", "content": get_weather(**call.function.arguments)}
    answer = client.chat(model=model, messages=[*QUESTION, first.message, result], options=GREEDY)
    assert answer.done and not answer.message.tool_calls
    assert "23" in answer.message.content and "sunny" in answer.message.content.lower()
