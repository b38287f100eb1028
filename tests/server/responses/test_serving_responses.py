"""OpenAI's Responses API end to end: the official `openai` client against a real `zhuzi serve` (the session's
server with two API keys), SmolLM2-135M-Instruct at temperature 0; stored conversations across turns, keys
and a killed server. Every Response and stream the client reads is checked against the Open Responses
specification's schema as it passes (open_responses.py)."""
from __future__ import annotations

import json
import signal
from typing import Any, get_args

import httpx
import jsonschema
import openai
import pydantic
import pytest
from conftest import KEYS
from open_responses import SpecTransport, check_event, check_response, check_stream
from openai.types.responses import ResponseStreamEvent
from server_process import IN_THREAD, ServerProcess, running_server

MODEL = "SmolLM2-135M-Instruct"
GREEDY = {"model": MODEL, "temperature": 0, "max_output_tokens": 24}
PAGE = 16  # tokens per KV page: the prefix cache's unit
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def client_for(server: ServerProcess, key: str = KEYS[0]) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api, api_key=key, max_retries=0, timeout=120,
                         http_client=httpx.Client(transport=SpecTransport()))


@pytest.fixture(scope="module")
def client(keyed_server: ServerProcess) -> openai.OpenAI:
    return client_for(keyed_server)


def test_a_plain_answer(client: openai.OpenAI, capital_answer: str) -> None:
    response = client.responses.create(input="What is the capital of France?", **GREEDY)
    assert response.object == "response" and response.status == "completed" and response.model == MODEL
    assert response.output_text == capital_answer and "Paris" in capital_answer
    (message,) = response.output
    assert (message.type, message.role, message.status) == ("message", "assistant", "completed")
    usage = response.usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens and 0 < usage.output_tokens < 24
    assert usage.output_tokens_details.reasoning_tokens == 0
    instructed = client.responses.create(input="What is the capital of France?", instructions="Be brief.",
                                         **GREEDY | {"max_output_tokens": 1})
    assert instructed.instructions == "Be brief." and instructed.usage.input_tokens != usage.input_tokens
    assert (instructed.status, instructed.incomplete_details.reason) == ("incomplete", "max_output_tokens")


def test_the_response_reports_the_sampling_the_engine_used(client: openai.OpenAI) -> None:
    """The Open Responses specification's fields, each as the response was run: the engine's sampling values
    after its defaults (a temperature under its minimum is that minimum), plain text as the format."""
    plain = client.responses.create(input="What is the capital of France?", **GREEDY)
    assert (plain.temperature, plain.top_p, plain.top_logprobs, plain.background, plain.max_tool_calls) == (
        0, 1, 0, False, None)
    assert plain.model_extra["presence_penalty"] == plain.model_extra["frequency_penalty"] == 0
    assert plain.text.format.type == "text" and plain.created_at <= plain.completed_at
    assert (plain.safety_identifier, plain.prompt_cache_key) == (None, None)
    tuned = client.responses.create(input="What is the capital of France?", **GREEDY | {
        "temperature": 0.001, "top_p": 0.5}, background=False, max_tool_calls=None,  # what zhuzi does, as sent
        extra_body={"presence_penalty": 0.5, "frequency_penalty": -0.5})
    assert (tuned.temperature, tuned.top_p) == (0.01, 0.5)
    assert (tuned.model_extra["presence_penalty"], tuned.model_extra["frequency_penalty"]) == (0.5, -0.5)
    cut = client.responses.create(input="What is the capital of France?", **GREEDY | {"max_output_tokens": 1})
    assert (cut.status, cut.completed_at, cut.incomplete_details.reason) == ("incomplete", None, "max_output_tokens")


def test_the_specification_check_refuses_what_the_specification_does(keyed_server: ServerProcess) -> None:
    """The check that every answer here passes fails a Response without a field the specification requires,
    an event it does not name, and a stream that does not end with [DONE]."""
    body = {"input": "What is the capital of France?", **GREEDY, "max_output_tokens": 2}
    answer = httpx.post(f"{keyed_server.api}/responses", json=body, timeout=120,
                        headers={"Authorization": f"Bearer {KEYS[0]}"}).json()
    check_response(answer)
    with pytest.raises(jsonschema.ValidationError, match="'completed_at' is a required property"):
        check_response({name: value for name, value in answer.items() if name != "completed_at"})
    events = raw_events(keyed_server, body)
    with pytest.raises(AssertionError, match="response.reasoning_text.delta"):
        check_event({**events[3][1], "type": "response.reasoning_text.delta"})
    stream = "".join(f"event: {name}\ndata: {json.dumps(event)}\n\n" for name, event in events)
    assert check_stream(stream + "data: [DONE]\n\n") == events
    with pytest.raises(AssertionError, match="does not end with"):
        check_stream(stream)


def test_a_stream_is_numbered_events_that_add_up_to_the_whole_answer(client: openai.OpenAI) -> None:
    args = {"input": "What is the capital of France?", **GREEDY}
    whole = client.responses.create(**args)
    events = list(client.responses.create(stream=True, **args))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    with client.responses.stream(**args) as stream:  # the SDK's own accumulator checks the events' order
        assert stream.get_final_response().output_text == whole.output_text


def test_a_conversation_by_previous_response_id_is_read_from_the_prefix_cache(client: openai.OpenAI) -> None:
    first = client.responses.create(input="What is the capital of France?", **GREEDY)
    second = client.responses.create(input="And of Germany?", previous_response_id=first.id, **GREEDY)
    third = client.responses.create(input="And of Italy?", previous_response_id=second.id, **GREEDY)
    assert "Berlin" in second.output_text and "Rome" in third.output_text
    for before, after in ((first, second), (second, third)):
        # The new turn's prompt holds the earlier one and its answer, and its whole pages come from the cache.
        assert after.usage.input_tokens > before.usage.input_tokens + before.usage.output_tokens
        assert after.usage.input_tokens_details.cached_tokens >= before.usage.input_tokens // PAGE * PAGE > 0
        assert after.previous_response_id == before.id


def test_get_delete_and_input_items(client: openai.OpenAI) -> None:
    first = client.responses.create(input="What is the capital of France?", metadata={"topic": "geography"},
                                    **GREEDY)
    items = [{"role": "user", "content": "Thanks."}, {"role": "user", "content": [
        {"type": "input_text", "text": "And of Spain?"}]}]
    second = client.responses.create(input=items, previous_response_id=first.id, **GREEDY)
    got = client.responses.retrieve(second.id)
    assert (got.id, got.output_text, got.usage, got.previous_response_id) == \
        (second.id, second.output_text, second.usage, first.id)
    assert client.responses.retrieve(first.id).metadata == {"topic": "geography"}
    listed = client.responses.input_items.list(second.id, order="asc")
    assert [[part.text for part in item.content] for item in listed.data] == [["Thanks."], ["And of Spain?"]]
    assert all(item.id.startswith("msg_") and item.role == "user" for item in listed.data)
    newest = client.responses.input_items.list(second.id, limit=1)  # newest first, by default
    assert [item.id for item in newest.data] == [listed.data[-1].id] and newest.has_more
    assert [item.id for item in client.responses.input_items.list(second.id, limit=1, after=newest.data[0].id)
            ] == [listed.data[0].id]
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as broken:  # its conversation lost a turn
        client.responses.create(input="More?", previous_response_id=second.id, **GREEDY)
    assert broken.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(input="Hello", store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_stored_response_belongs_to_the_key_that_made_it(keyed_server: ServerProcess,
                                                           client: openai.OpenAI) -> None:
    mine = client.responses.create(input="What is the capital of France?", **GREEDY)
    other = client_for(keyed_server, KEYS[1])
    for attempt in (lambda: other.responses.retrieve(mine.id), lambda: other.responses.input_items.list(mine.id),
                    lambda: other.responses.delete(mine.id),
                    lambda: other.responses.create(input="And?", previous_response_id=mine.id, **GREEDY)):
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert client.responses.retrieve(mine.id).output_text == mine.output_text  # still there for its owner
    with pytest.raises(openai.AuthenticationError):
        client_for(keyed_server, "wrong").responses.create(input="Hi", **GREEDY)
    keyless = httpx.get(f"{keyed_server.api}/responses/{mine.id}")
    assert keyless.status_code == 401 and keyless.json()["error"]["code"] == "invalid_api_key"


def test_a_forced_call_is_valid_whole_and_streamed_and_its_result_goes_back(client: openai.OpenAI) -> None:
    args = {"input": "What is the weather in Paris?", "tools": [WEATHER], **GREEDY, "max_output_tokens": 60,
            "tool_choice": {"type": "function", "name": "get_weather"}}
    asked = client.responses.create(**args)
    (call,) = asked.output
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    events = list(client.responses.create(stream=True, **args))
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert len(pieces) > 1 and "".join(pieces) == done.arguments == call.arguments
    answer = client.responses.create(previous_response_id=asked.id, tools=[WEATHER], tool_choice="none", **GREEDY,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "Sunny, 22 degrees Celsius"}])
    assert answer.output[0].type == "message" and answer.output_text.strip()
    assert answer.usage.input_tokens_details.cached_tokens > 0


def test_a_json_schema_format_holds_the_answer(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}},
              "required": ["capital"], "additionalProperties": False}
    response = client.responses.create(input="What is the capital of France? Answer in JSON.", **GREEDY | {
        "max_output_tokens": 40}, text={"format": {"type": "json_schema", "name": "answer", "schema": schema,
                                                    "strict": True}})
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"


# What the openai and openai-agents SDKs send (openai_responses.py's request builder), each with a value zhuzi honours.
SDK_FIELDS = {"include": ["message.output_text.logprobs", "reasoning.encrypted_content"], "top_logprobs": 2,
              "parallel_tool_calls": False, "truncation": "disabled", "store": False, "metadata": {"run": "sdk"},
              "prompt_cache_key": "agent-1", "prompt_cache_retention": "in_memory", "safety_identifier": "user-1",
              "user": "user-1", "service_tier": "flex", "reasoning": {"effort": "none", "summary": "auto"},
              "text": {"verbosity": "medium"}}


def test_the_fields_the_sdks_send_are_served(client: openai.OpenAI) -> None:
    """Each field does what OpenAI documents: the logprobs are the chat endpoint's for the same tokens, the
    others are echoed as the Response reports them."""
    args = {"input": "What is the capital of France?", **GREEDY}
    response = client.responses.create(**args, **SDK_FIELDS)
    (message,) = response.output
    (text,) = message.content
    assert response.status == "completed" and text.text == response.output_text
    assert "".join(lp.token for lp in text.logprobs) == text.text
    assert all(len(lp.top_logprobs) == 2 and lp.top_logprobs[0].logprob == lp.logprob for lp in text.logprobs)
    chat = client.chat.completions.create(messages=[{"role": "user", "content": args["input"]}], logprobs=True,
                                          top_logprobs=2, model=MODEL, max_tokens=24, temperature=0)
    *chat_text, end = chat.choices[0].logprobs.content  # chat's have the end token too; the output text has not
    assert end.token == "<|im_end|>" and chat.choices[0].message.content == text.text
    assert [(lp.token, lp.bytes) for lp in text.logprobs] == [(lp.token, lp.bytes) for lp in chat_text]
    assert [lp.logprob for lp in text.logprobs] == pytest.approx([lp.logprob for lp in chat_text], abs=1e-3)
    assert (response.top_logprobs, response.truncation, response.service_tier, response.prompt_cache_key,
            response.safety_identifier, response.metadata, response.parallel_tool_calls, response.store) == (
        2, "disabled", "flex", "agent-1", "user-1", {"run": "sdk"}, False, False)
    with pytest.raises(openai.NotFoundError):  # store false
        client.responses.retrieve(response.id)
    plain = client.responses.create(**args)
    assert plain.output[0].content[0].logprobs is None and plain.service_tier == "default"


def sdk_fields(model: pydantic.BaseModel, sent: Any, where: str) -> None:
    """Every field sent is one the SDK's model declares (its models accept extra fields silently)."""
    if isinstance(sent, dict) and isinstance(model, pydantic.BaseModel):
        declared = type(model).model_fields
        extra = set(sent) - set(declared) - OPENAI_EXTRAS
        assert not extra, f"{where}: {extra} not in {type(model).__name__}"
        for name, value in sent.items():
            sdk_fields(getattr(model, name), value, f"{where}.{name}")
    elif isinstance(sent, list) and isinstance(model, list):
        for i, (m, v) in enumerate(zip(model, sent)):
            sdk_fields(m, v, f"{where}.{i}")


# Fields that OpenAI's own Responses carry (its API reference's examples), or that the Open Responses
# specification requires, though the SDK's models lack them: a streamed logprob's bytes, the penalties used.
OPENAI_EXTRAS = {"store", "bytes", "presence_penalty", "frequency_penalty"}
# The SDK's event models by their type (its ResponseStreamEvent union is discriminated by type).
EVENT_MODELS = {get_args(model.model_fields["type"].annotation)[0]: model
                for model in get_args(get_args(ResponseStreamEvent)[0])}


def raw_events(server: ServerProcess, body: dict) -> list[tuple[str, dict]]:
    """The stream's events as sent (SSE name and JSON data), each checked against the specification."""
    answer = httpx.post(f"{server.api}/responses", json={**body, "stream": True}, timeout=120,
                        headers={"Authorization": f"Bearer {KEYS[0]}"})
    return check_stream(answer.text)


@pytest.mark.parametrize("body", [
    {"input": "What is the capital of France?", "include": ["message.output_text.logprobs"], "top_logprobs": 1},
    {"input": "What is the weather in Paris?", "tools": [WEATHER], "tool_choice": "required",
     "parallel_tool_calls": False, "max_output_tokens": 60}], ids=["text", "call"])
def test_each_streamed_event_is_the_sdks_event_to_the_letter(keyed_server: ServerProcess, body: dict) -> None:
    """Each event validates as the openai SDK's own event model, with no field it lacks; sequence numbers
    count from 0; each item's added, delta and done events name the same item id and output index."""
    events = raw_events(keyed_server, {**GREEDY, **body})
    parsed = [EVENT_MODELS[name].model_validate(data) for name, data in events]
    for (name, data), event in zip(events, parsed):
        assert name == data["type"] == event.type
        sdk_fields(event, data, event.type)
    assert [event.sequence_number for event in parsed] == list(range(len(parsed)))
    final = parsed[-1].response
    for index, item in enumerate(final.output):
        mine = [event for event in parsed if getattr(event, "output_index", None) == index]
        assert mine[0].type == "response.output_item.added" and mine[-1].type == "response.output_item.done"
        assert {getattr(event, "item_id", None) or event.item.id for event in mine} == {item.id}
        assert all(getattr(event, "content_index", 0) == 0 for event in mine)
    if "include" in body:
        deltas = [lp for event in parsed if event.type == "response.output_text.delta" for lp in event.logprobs]
        whole = final.output[0].content[0].logprobs
        assert [(lp.token, lp.logprob) for lp in deltas] == [(lp.token, lp.logprob) for lp in whole]
        assert "".join(lp.token for lp in deltas) == final.output_text


BAD = [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
     "input_image parts are not supported"),
    ({"tools": [{"type": "web_search"}]}, "web_search tools are not supported"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"include": ["web_search_call.results"]}, "include: web_search_call.results is not supported"),
    ({"include": ["message.output_text.logprob"]}, "include: 'message.output_text.logprob' is not a value"),
    ({"top_logprobs": 2}, "top_logprobs needs include message.output_text.logprobs"),
    ({"truncation": "auto"}, "truncation: auto is not supported"),
    ({"prompt_cache_retention": "24h"}, "prompt_cache_retention: 24h is not supported"),
    ({"service_tier": "scale"}, "service_tier: scale is not supported"),
    ({"text": {"verbosity": "low"}}, "text.verbosity: low is not supported"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options is only allowed when stream is true"),
    ({"background": True}, "background: true is not supported"),
    ({"max_tool_calls": 2}, "max_tool_calls: a limit is not supported"),
    ({"moderation": {}}, "moderation is not supported: zhuzi runs no moderation model"),
    ({"temperature": 3}, "temperature"),
    ({"metadata": {str(i): "x" for i in range(17)}}, "metadata"),
    ({"max_output_tokens": 0}, "max_output_tokens must be"),
    ({"input": []}, "input"),
]


@pytest.mark.parametrize("change,words", BAD, ids=[words for _, words in BAD])
def test_a_bad_field_is_a_400_naming_it(client: openai.OpenAI, change: dict, words: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**{"input": "Hi", **GREEDY, **change})
    assert words in refused.value.body["message"]


def test_a_stored_conversation_outlives_a_killed_server(tmp_path) -> None:
    store = str(tmp_path / "responses.sqlite3")
    dense = ("--quantization", "none", *IN_THREAD)  # as the keyed server (conftest.py): answers that name the cities
    with running_server(tmp_path / "first.log", "--responses-store", store, *dense) as server:
        first = client_for(server, "none").responses.create(input="What is the capital of France?", **GREEDY)
        server.proc.send_signal(signal.SIGKILL)  # no chance to flush or close anything
        server.proc.wait()
    with running_server(tmp_path / "second.log", "--responses-store", store, *dense) as server:
        client = client_for(server, "none")
        assert client.responses.retrieve(first.id).output_text == first.output_text
        second = client.responses.create(input="And of Germany?", previous_response_id=first.id, **GREEDY)
        assert "Berlin" in second.output_text
        assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
