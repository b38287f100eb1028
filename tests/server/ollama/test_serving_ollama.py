"""Ollama's API end to end: the official `ollama` client, unmodified, against a real `zhuzi serve` (the session's
server with two API keys, sent as Ollama's client sends OLLAMA_API_KEY: Authorization: Bearer), SmolLM2-135M-Instruct
at temperature 0. Its answers are checked against the chat endpoint's for the same request: every API runs the one
chat path."""
from __future__ import annotations

import json

import httpx
import jsonschema
import ollama
import pytest
from conftest import CAPITAL, KEYS
from server_process import ServerProcess

import zhuzi

MODEL = "SmolLM2-135M-Instruct"
GREEDY = {"temperature": 0, "seed": 7, "num_predict": 24}
AUTH = {"Authorization": f"Bearer {KEYS[0]}"}


def get_weather(city: str) -> str:
    """Current weather in a city.

    Args:
      city: The city's name
    """
    return "Sunny, 22 degrees Celsius"


@pytest.fixture(scope="module")
def client(keyed_server: ServerProcess) -> ollama.Client:
    return ollama.Client(host=keyed_server.url, headers=AUTH, timeout=120)


def chat_completion(server: ServerProcess, **body) -> dict:
    """The chat endpoint's answer to the same request, greedy."""
    response = httpx.post(f"{server.api}/chat/completions", headers=AUTH, timeout=120,
                          json={"model": MODEL, "temperature": 0, "seed": 7, **body})
    response.raise_for_status()
    return response.json()


def test_the_model_is_listed_shown_and_running(client: ollama.Client, keyed_server: ServerProcess) -> None:
    (listed,) = client.list().models
    assert listed.model == f"{MODEL}:latest" and listed.size > 1_000_000 and len(listed.digest) == 64
    assert (listed.details.format, listed.details.family) == ("gguf", "llama")
    assert listed.details.parameter_size.endswith("M")
    shown = client.show(MODEL)
    assert client.show(f"{MODEL}:latest").modelinfo == shown.modelinfo
    assert shown.capabilities == ["completion", "tools"]  # SmolLM2 does not think
    assert shown.modelinfo["general.architecture"] == "llama" and "<|im_start|>" in shown.template
    (running,) = client.ps().models
    assert running.model == listed.model and running.size_vram == 0  # on the CPU
    assert running.context_length == shown.modelinfo["llama.context_length"] > 0
    assert running.expires_at.year == 9999  # loaded for the server's life, whatever keep_alive says
    version = httpx.get(f"{keyed_server.url}/api/version")  # the client has no call for it
    assert version.json() == {"version": zhuzi.__version__}


def test_a_chat_whole_and_streamed_is_the_chat_endpoints_answer(client: ollama.Client, keyed_server: ServerProcess,
                                                                capital_answer: str) -> None:
    whole = client.chat(model=MODEL, messages=CAPITAL, options=GREEDY, keep_alive="5m")
    assert whole.done and whole.done_reason == "stop" and whole.message.role == "assistant"
    assert whole.message.content == capital_answer and whole.message.tool_calls is None
    unthinking = client.chat(model=MODEL, messages=CAPITAL, options=GREEDY, think=False)  # a model that never thinks
    assert unthinking.message.content == capital_answer and unthinking.message.thinking is None
    usage = chat_completion(keyed_server, messages=CAPITAL, max_tokens=24)["usage"]
    assert (whole.prompt_eval_count, whole.eval_count) == (usage["prompt_tokens"], usage["completion_tokens"])
    assert whole.prompt_eval_duration > 0 and whole.eval_duration > 0 and whole.load_duration >= 0
    assert whole.total_duration >= whole.load_duration + whole.prompt_eval_duration + whole.eval_duration
    parts = list(client.chat(model=MODEL, messages=CAPITAL, options=GREEDY, stream=True, keep_alive=0))
    assert [part.done for part in parts] == [False] * (len(parts) - 1) + [True] and len(parts) > 2
    assert "".join(part.message.content for part in parts) == whole.message.content
    last = parts[-1]
    assert (last.done_reason, last.eval_count, last.prompt_eval_count) == ("stop", whole.eval_count,
                                                                           whole.prompt_eval_count)
    assert all(part.eval_count is None for part in parts[:-1])  # the counts come once, at the end
    raw = httpx.post(f"{keyed_server.url}/api/chat", headers=AUTH, timeout=120,
                     json={"model": MODEL, "messages": CAPITAL, "options": GREEDY})  # streamed by default
    assert raw.headers["content-type"] == "application/x-ndjson"
    lines = [json.loads(text) for text in raw.text.splitlines()]
    assert "".join(x["message"]["content"] for x in lines) == capital_answer and lines[-1]["done"]


def test_generate_templates_the_prompt_unless_raw(client: ollama.Client, keyed_server: ServerProcess,
                                                  capital_answer: str) -> None:
    answer = client.generate(model=MODEL, prompt=CAPITAL[0]["content"], options=GREEDY)
    assert answer.response == capital_answer and answer.done_reason == "stop"
    streamed = list(client.generate(model=MODEL, prompt=CAPITAL[0]["content"], options=GREEDY, stream=True))
    assert "".join(part.response for part in streamed) == capital_answer and streamed[-1].done
    prompt = "The capital of France is"
    raw = client.generate(model=MODEL, prompt=prompt, raw=True, options={**GREEDY, "num_predict": 5})
    completion = httpx.post(f"{keyed_server.api}/completions", headers=AUTH, timeout=120, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 5, "temperature": 0}).json()
    assert raw.response == completion["choices"][0]["text"]
    assert (raw.done_reason, raw.eval_count, raw.prompt_eval_count) == (
        "length", 5, completion["usage"]["prompt_tokens"])


def test_an_empty_request_loads_the_model(client: ollama.Client) -> None:
    loaded = client.generate(model=MODEL, keep_alive="10m")
    assert (loaded.done, loaded.done_reason, loaded.response) == (True, "load", "")
    assert client.chat(model=MODEL, messages=[]).done_reason == "load"


def test_options_num_predict_and_stop_end_the_answer(client: ollama.Client, capital_answer: str) -> None:
    cut = client.chat(model=MODEL, messages=CAPITAL, options={**GREEDY, "num_predict": 3})
    assert (cut.done_reason, cut.eval_count) == ("length", 3)
    assert capital_answer.startswith(cut.message.content)
    stopped = client.chat(model=MODEL, messages=CAPITAL, options={**GREEDY, "stop": ["Paris"]})
    assert stopped.done_reason == "stop" and "Paris" in capital_answer and "Paris" not in stopped.message.content
    assert capital_answer.startswith(stopped.message.content) and stopped.eval_count < 24
    penalized = client.chat(model=MODEL, messages=CAPITAL, options={**GREEDY, "repeat_penalty": 1.3,
                                                                     "top_k": 1, "top_p": 0.5, "min_p": 0.1})
    assert penalized.done and penalized.eval_count > 0


def test_logprobs_come_with_each_token(client: ollama.Client) -> None:
    whole = client.chat(model=MODEL, messages=CAPITAL, options=GREEDY, logprobs=True, top_logprobs=2)
    assert len(whole.logprobs) == whole.eval_count and whole.done_reason == "stop"
    # the tokens of the reply, its end-of-turn token included (counted, as the chat endpoint's usage counts it)
    assert "".join(entry.token for entry in whole.logprobs) == whole.message.content + "<|im_end|>"
    for entry in whole.logprobs:  # greedy: the token drawn is the likeliest
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == entry.logprob >= entry.top_logprobs[1].logprob
    parts = list(client.generate(model=MODEL, prompt=CAPITAL[0]["content"], options=GREEDY, logprobs=True,
                                 stream=True))
    assert [e.token for part in parts for e in part.logprobs or []] == [e.token for e in whole.logprobs]


CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False}


def test_format_holds_the_answer_to_json(client: ollama.Client) -> None:
    asked = [{"role": "user", "content": "Name the capital of France as JSON."}]
    shaped = client.chat(model=MODEL, messages=asked, format=CITY, options={**GREEDY, "num_predict": 40})
    assert shaped.done_reason == "stop"
    jsonschema.validate(json.loads(shaped.message.content), CITY)
    generated = client.generate(model=MODEL, prompt=asked[0]["content"], format=CITY, options=GREEDY)
    jsonschema.validate(json.loads(generated.response), CITY)
    any_json = client.chat(model=MODEL, messages=asked, format="json", options={**GREEDY, "num_predict": 60})
    if any_json.done_reason == "stop":  # a JSON object the model closed (a free one may run past 60 tokens)
        assert isinstance(json.loads(any_json.message.content), dict)
    else:
        assert any_json.message.content.lstrip().startswith("{")


TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                         "parameters": {"type": "object", "required": ["city"], "properties": {
                                             "city": {"type": "string", "description": "The city's name"}}}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
# SmolLM2 never calls a tool on its own, and Ollama has no tool_choice: a prefilled assistant turn, which Ollama
# continues, opens the call and its arguments, and the model writes the rest (the argument's name and value).
LED = [*QUESTION, {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": {"'}]


def calls_of(message: ollama.Message) -> list[tuple[str, dict]]:
    return [(c.function.name, dict(c.function.arguments)) for c in message.tool_calls or []]


def reference_calls(server: ServerProcess, messages: list[dict]) -> tuple[list[tuple[str, dict]], str]:
    continued = messages[-1]["role"] == "assistant"
    (choice,) = chat_completion(server, messages=messages, tools=[TOOL], max_tokens=60,
                                continue_final_message=continued, add_generation_prompt=not continued)["choices"]
    message = choice["message"]
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or []]
    return calls, message["content"] or ""


def test_tools_offered_get_the_chat_endpoints_decision(client: ollama.Client, keyed_server: ServerProcess) -> None:
    whole = client.chat(model=MODEL, messages=QUESTION, tools=[get_weather], options={**GREEDY, "num_predict": 60})
    assert (calls_of(whole.message), whole.message.content) == reference_calls(keyed_server, QUESTION)
    assert whole.done_reason in ("stop", "length")


def test_a_tool_call_in_ollamas_shape_whole_streamed_and_answered(client: ollama.Client,
                                                                  keyed_server: ServerProcess) -> None:
    options = {**GREEDY, "num_predict": 60}
    whole = client.chat(model=MODEL, messages=LED, tools=[get_weather], options=options)
    ((name, arguments),) = calls_of(whole.message)
    assert name == "get_weather"
    jsonschema.validate(arguments, TOOL["function"]["parameters"])  # arguments are an object, as Ollama's
    assert (calls_of(whole.message), whole.message.content) == reference_calls(keyed_server, LED)
    streamed = list(client.chat(model=MODEL, messages=LED, tools=[get_weather], options=options, stream=True))
    assert [c for part in streamed for c in part.message.tool_calls or []] == list(whole.message.tool_calls)
    raw = httpx.post(f"{keyed_server.url}/api/chat", headers=AUTH, timeout=120, json={
        "model": MODEL, "messages": LED, "tools": [TOOL], "options": options, "stream": False}).json()
    (call,) = raw["message"]["tool_calls"]
    assert call["function"]["index"] == 0 and call["id"]
    result = {"role": "tool", "tool_name": name, "content": get_weather(**arguments)}
    answer = client.chat(model=MODEL, messages=[*QUESTION, whole.message, result], tools=[get_weather],
                         options=options)
    assert answer.done and answer.message.content and answer.prompt_eval_count > whole.prompt_eval_count


@pytest.mark.parametrize("body,status,words", [
    ({"model": "llama3.2"}, 404, "llama3.2"),
    ({"options": {"temperature": "hot"}}, 400, "options.temperature"),
    ({"options": {"temperature": -1}}, 400, "options.temperature"),
    ({"options": {"num_gpu": 1}}, 400, "options.num_gpu: is a load-time option"),
    ({"options": {"num_ctx": 10**9}}, 400, "options.num_ctx"),
    ({"think": True}, 400, "does not support thinking"),
    ({"messages": [{"role": "user", "content": "hi", "images": ["AA=="]}]}, 400, "messages.0.images"),
    ({"format": {"type": "nonsense"}}, 400, "format"),
    ({"frobnicate": 1}, 400, "frobnicate is not a field"),
    ({"keep_alive": "soon"}, 400, "keep_alive"),
    ({"think": "high"}, 400, "think"),
    ({"options": {"typical_p": 0.5}}, 400, "options.typical_p: is not supported"),
])
def test_a_bad_request_gets_ollamas_error_and_status(keyed_server: ServerProcess, body: dict, status: int,
                                                     words: str) -> None:
    response = httpx.post(f"{keyed_server.url}/api/chat", headers=AUTH, timeout=120,
                          json={"model": MODEL, "messages": CAPITAL, "stream": False, **body})
    assert response.status_code == status
    error = response.json()
    assert list(error) == ["error"] and words in error["error"]


def test_the_client_hears_the_error(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as refused:
        client.chat(model="llama3.2", messages=CAPITAL)
    assert refused.value.status_code == 404 and "llama3.2" in refused.value.error
    with pytest.raises(ollama.ResponseError) as unknown:
        client.show("llama3.2")
    assert unknown.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as unserved:
        client.copy(MODEL, "mine")  # model management: zhuzi serves the one model it was started with
    # a path no route matches still answers in Ollama's shape: the client reads a message, not a dict
    assert unserved.value.status_code == 404 and unserved.value.error == "Not Found"


def test_a_server_with_keys_refuses_a_client_without_one(keyed_server: ServerProcess) -> None:
    anonymous = ollama.Client(host=keyed_server.url, timeout=120)
    for call in (anonymous.list, lambda: anonymous.chat(model=MODEL, messages=CAPITAL)):
        with pytest.raises(ollama.ResponseError) as refused:
            call()
        assert refused.value.status_code == 401
    wrong = ollama.Client(host=keyed_server.url, headers={"Authorization": "Bearer wrong"}, timeout=120)
    with pytest.raises(ollama.ResponseError) as refused:
        wrong.generate(model=MODEL, prompt="hi")
    assert refused.value.status_code == 401


def test_embed_and_the_deprecated_embeddings_give_the_v1_embeddings_vectors(client: ollama.Client,
                                                                           keyed_server: ServerProcess) -> None:
    texts = ["The capital of France is Paris.", "Once upon a time"]
    embedded = client.embed(model=MODEL, input=texts)
    v1 = httpx.post(f"{keyed_server.api}/embeddings", headers=AUTH, timeout=60,
                    json={"model": MODEL, "input": texts, "encoding_format": "float"}).json()
    for got, want in zip(embedded.embeddings, v1["data"]):  # bf16 without --deterministic: a batch's rounding
        assert got == pytest.approx(want["embedding"], abs=1e-2)
    assert embedded.prompt_eval_count == v1["usage"]["prompt_tokens"] and embedded.total_duration > 0
    assert client.embeddings(model=MODEL, prompt=texts[1]).embedding == pytest.approx(embedded.embeddings[1], abs=1e-2)
    with pytest.raises(ollama.ResponseError, match="dimensions") as refused:
        client.embed(model=MODEL, input="hi", dimensions=8)
    assert refused.value.status_code == 400
    with pytest.raises(ollama.ResponseError, match="maximum context length"):  # (truncate true cuts it to fit)
        client.embed(model=MODEL, input="word " * 9000, truncate=False)
    assert httpx.post(f"{keyed_server.url}/api/embed", json={"model": MODEL, "input": "hi"}).status_code == 401
