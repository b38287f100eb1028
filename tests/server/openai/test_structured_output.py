"""Structured output end to end: a real `zhuzi serve` (SmolLM2-135M-Instruct), the official openai client.

Every response to a JSON schema parses and validates with jsonschema; forced tool calls carry
arguments valid under their function's parameters, streamed and not; regex, choice and grammar
outputs match; bad constraints and unknown fields get 400s naming the field. The schemas are
bounded (strict objects, short strings, few items) so that a 135M model finishes them.
"""
from __future__ import annotations

import ast
import json
import re

import httpx
import jsonschema
import openai
import pytest
from server_process import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"

SCHEMAS = {
    "nested objects, required fields": ("Describe a person and where they live.", {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "address": {"type": "object",
                        "properties": {"city": {"type": "string", "maxLength": 20},
                                       "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"]}},
        "required": ["name", "address"]}),
    "arrays and enums": ("Describe a T-shirt.", {
        "type": "object",
        "properties": {"colors": {"type": "array", "items": {"enum": ["red", "green", "blue", "black"]},
                                  "minItems": 1, "maxItems": 3},
                       "size": {"enum": ["S", "M", "L", "XL"]}},
        "required": ["colors", "size"]}),
    "numbers with bounds": ("Rate the movie Titanic.", {
        "type": "object",
        "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5},
                       "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                       "score": {"type": "number", "minimum": 0, "maximum": 10}},
        "required": ["stars", "year", "score"]}),
    "anyOf": ("How can I contact you?", {
        "type": "object",
        "properties": {"contact": {"anyOf": [
            {"type": "object", "properties": {"email": {"type": "string", "format": "email", "maxLength": 40}},
             "required": ["email"]},
            {"type": "object", "properties": {"phone": {"type": "string", "pattern": "^[0-9]{10}$"}},
             "required": ["phone"]}]}},
        "required": ["contact"]}),
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": schema}}


def validate(text: str, schema: dict) -> dict:
    document = json.loads(text)
    jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker()).validate(document)
    return document


# ------------------------------------------------------------------ JSON

@pytest.mark.parametrize("name", SCHEMAS)
def test_json_schema_responses_parse_and_validate(client: openai.OpenAI, name: str) -> None:
    question, schema = SCHEMAS[name]
    reply = client.chat.completions.create(model=MODEL, messages=ask(question), temperature=0, max_tokens=150,
                                           response_format=json_schema_format(schema))
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    validate(choice.message.content, schema)


def test_sampled_choices_each_validate_and_streaming_gives_the_same_text(client: openai.OpenAI) -> None:
    question, schema = SCHEMAS["arrays and enums"]
    args = {"model": MODEL, "messages": ask(question), "temperature": 1.0, "seed": 7, "n": 3, "max_tokens": 150,
            "response_format": json_schema_format(schema)}
    reply = client.chat.completions.create(**args)
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        validate(choice.message.content, schema)
    texts = {i: "" for i in range(3)}
    for chunk in client.chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert [texts[i] for i in range(3)] == [c.message.content for c in reply.choices]


def test_json_object_is_an_object_and_max_tokens_can_cut_it_short(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=ask("Describe Paris as JSON."), temperature=0,
                                           max_tokens=200, response_format={"type": "json_object"},
                                           logprobs=True, top_logprobs=3)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and isinstance(json.loads(choice.message.content), dict)
    assert reply.usage.completion_tokens > 3
    assert all(len(t.top_logprobs) <= 3 and t.logprob <= 0 for t in choice.logprobs.content)
    cut = client.chat.completions.create(model=MODEL, messages=ask("Describe Paris as JSON."), temperature=0,
                                         max_tokens=3, response_format={"type": "json_object"}).choices[0]
    assert cut.finish_reason == "length" and choice.message.content.startswith(cut.message.content)


# ------------------------------------------------------------------ regex, choice, grammar

def test_regex_choice_and_grammar_outputs_match(client: openai.OpenAI) -> None:
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    text = client.completions.create(model=MODEL, prompt="Call me at", max_tokens=30, temperature=0,
                                     extra_body={"structured_outputs": {"regex": phone}}).choices[0].text
    assert re.fullmatch(phone, text, re.ASCII), text
    date = r"\d{4}-\d{2}-\d{2}"
    chat = client.chat.completions.create(model=MODEL, messages=ask("When did the Berlin wall fall?"), temperature=0,
                                          max_tokens=30, extra_body={"guided_regex": date})
    assert re.fullmatch(date, chat.choices[0].message.content, re.ASCII)
    choices = ["Paris", "London", "Berlin"]
    for extra in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        reply = client.chat.completions.create(model=MODEL, messages=ask("What is the capital of France?"),
                                               temperature=0, max_tokens=10, extra_body=extra)
        assert reply.choices[0].message.content in choices and reply.choices[0].finish_reason == "stop"
    grammar = 'start: NUMBER (" + " NUMBER){1,3}\nNUMBER: /[1-9][0-9]{0,2}/'
    sum_ = client.completions.create(model=MODEL, prompt="A sum: ", max_tokens=30, temperature=0,
                                     extra_body={"guided_grammar": grammar}).choices[0]
    text = sum_.text
    assert sum_.finish_reason == "stop"
    tree = ast.parse(text, mode="eval")
    assert all(isinstance(node, (ast.Expression, ast.BinOp, ast.Constant, ast.Add)) for node in ast.walk(tree))


def test_a_regex_this_vocabulary_cannot_write_is_a_400_naming_it(client: openai.OpenAI) -> None:
    """SmolLM2's vocabulary has no token that begins with byte 0xF1, the first of U+611D8: the request, not the
    server, is at fault once the output reaches that character (a fuzzed request found it as a 500)."""
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="Say it:", max_tokens=8,
                                  extra_body={"guided_regex": "-\uc0b9\U000611d8"})
    assert refused.value.body["param"] == "structured_outputs.regex"
    assert "vocabulary cannot write" in refused.value.body["message"]


# ------------------------------------------------------------------ tool calls

def test_a_named_tool_choice_calls_it_with_valid_arguments_streamed_and_not(client: openai.OpenAI) -> None:
    args = {"model": MODEL, "messages": ask("What's the weather like in Paris?"), "tools": [WEATHER, ADD],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "temperature": 0,
            "max_tokens": 80}
    choice = client.chat.completions.create(**args).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    validate(call.function.arguments, WEATHER["function"]["parameters"] | {"additionalProperties": False})
    pieces = [c.choices[0] for c in client.chat.completions.create(**args, stream=True) if c.choices]
    deltas = [d for piece in pieces for d in piece.delta.tool_calls or []]
    assert (deltas[0].id is not None, deltas[0].type, deltas[0].function.name) == (True, "function", "get_weather")
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    assert len(deltas) > 3  # the arguments arrive in pieces, as OpenAI sends them
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments
    assert pieces[-1].finish_reason == "tool_calls" and not any(p.delta.content for p in pieces)


def test_required_calls_a_listed_tool_once_without_parallel_calls(client: openai.OpenAI) -> None:
    choice = client.chat.completions.create(model=MODEL, messages=ask("What is 12 plus 30?"), tools=[WEATHER, ADD],
                                            tool_choice="required", parallel_tool_calls=False, temperature=0,
                                            max_tokens=80).choices[0]
    [call] = choice.message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
    validate(call.function.arguments, schemas[call.function.name])
    assert choice.finish_reason == "tool_calls"


def test_tool_choice_none_never_calls(client: openai.OpenAI) -> None:
    choice = client.chat.completions.create(model=MODEL, messages=ask("What's the weather like in Paris?"),
                                            tools=[WEATHER], tool_choice="none", temperature=0,
                                            max_tokens=30).choices[0]
    assert choice.message.tool_calls is None and choice.message.content


def test_without_tool_support_the_template_gets_the_generic_tool_format(server: ServerProcess) -> None:
    """SmolLM2's template ignores tools: zhuzi describes them (and the call format) in the system message."""
    body = {"messages": ask("Weather in Paris?"), "tools": [WEATHER]}
    tokens = httpx.post(server.url + "/tokenize", json=body, timeout=60).json()["tokens"]
    document = httpx.post(server.url + "/detokenize", json={"tokens": tokens}, timeout=60).json()["prompt"]
    assert document.startswith("<|im_start|>system\nYou can call functions.")
    listed = document.split("<tools>\n")[1].split("\n</tools>")[0]
    assert json.loads(listed) == WEATHER and '<tool_call>\n{"name": <function-name>' in document
    tokens = httpx.post(server.url + "/tokenize", json={**body, "tool_choice": "none"}, timeout=60).json()["tokens"]
    assert "<tools>" not in httpx.post(server.url + "/detokenize", json={"tokens": tokens}, timeout=60).json()["prompt"]


# ------------------------------------------------------------------ errors

MESSAGES = ask("hi")
INVALID = [  # (path, body, param)
    (CHAT, {"response_format": {"type": "xml"}}, "response_format.type"),
    (CHAT, {"response_format": {"type": "json_schema"}}, "response_format"),
    (CHAT, {"response_format": json_schema_format({"type": "strin"})}, "response_format.json_schema.schema"),
    (CHAT, {"response_format": json_schema_format({"type": "array", "uniqueItems": True})},
     "response_format.json_schema.schema"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "no spaces!", "schema": {}}}},
     "response_format.json_schema.name"),
    (CHAT, {"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema"),
    (CHAT, {"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
    (CHAT, {"structured_outputs": {}}, "structured_outputs"),
    (CHAT, {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    (CHAT, {"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    (CHAT, {"guided_json": '{"type": '}, "guided_json"),
    (CHAT, {"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    (CHAT, {"guided_choice": []}, "guided_choice"),
    (CHAT, {"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    (CHAT, {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    (CHAT, {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    (CHAT, {"tools": [ADD, {"type": "function", "function": {"name": "f", "parameters": {
        "type": "array", "uniqueItems": True}}}], "tool_choice": "required"}, "tools.1.function.parameters"),
    (CHAT, {"tools": [WEATHER], "structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    (CHAT, {"messages": MESSAGES + [{"role": "assistant", "content": "{"}], "continue_final_message": True,
            "add_generation_prompt": False, "response_format": {"type": "json_object"}}, "continue_final_message"),
    (CHAT, {"foo": 1}, "foo"),
    (CHAT, {"functions": [{"name": "f"}]}, "functions"),
    (CHAT, {"stream": True, "stream_options": {"include_usage": True, "include_obfuscation": True}},
     "stream_options.include_obfuscation"),
    (CHAT, {"messages": [{"role": "user", "content": "hi", "refusal": None}]}, "messages.0.refusal"),
    (COMPLETIONS, {"prompt": "hi", "logprobs": True}, "logprobs"),
    (COMPLETIONS, {"prompt": "hi", "suffix": "!"}, "suffix"),
    (COMPLETIONS, {"prompt": "hi", "structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice"),
]


def test_invalid_constraints_and_unknown_fields_get_400s_naming_the_field(server: ServerProcess,
                                                                          client: openai.OpenAI) -> None:
    with httpx.Client(timeout=60) as http:
        for path, body, param in INVALID:
            body = {"messages": MESSAGES, **body} if path == CHAT else body
            response = http.post(server.url + path, json={"max_tokens": 5, **body})
            assert response.status_code == 400, (body, response.text)
            error = response.json()["error"]
            assert error["param"] == param and param in error["message"], (body, error)
            assert "\n" not in error["message"]
    reply = client.chat.completions.create(model=MODEL, messages=ask("Is water wet?"), max_tokens=5, temperature=0,
                                           extra_body={"guided_choice": ["yes", "no"]}, user="user-4711")
    assert reply.choices[0].message.content in ("yes", "no")  # and the server is none the worse
    assert "for user 'user-4711'" in server.log.read_text()
