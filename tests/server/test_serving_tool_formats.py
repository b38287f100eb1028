"""Calls in each family's format, through the server: a tiny random Llama with SmolLM2's vocabulary plus the
families' markers (as the tokens they are), greedy, served with a template that writes calls as the family does, so
that the server reads and forces calls in that format. Named in tool_choice, the call comes back as tool_calls
(the OpenAI client, whole and streamed) and as a tool_use block (the Anthropic client); cut short by max_tokens,
it comes back as its text, and stop_reason says so. Ollama's API cannot force a call: the model prefers the
markers (and closing braces) to any other token, so that, held by a JSON format (a grammar) to calls or a bare
call's JSON, it calls unasked, and the ollama client gets the calls' arguments as objects."""
from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import anthropic
import ollama
import openai
import pytest
import tiny
import torch
from server_process import IN_THREAD, ServerProcess, running_server

from zhuzi.model.loader import default_model_path
from zhuzi.server.common.tool_formats import FORMATS
from zhuzi.tokenizer import TOOL_MARKERS, Tokenizer

CALLS = {  # how each family's template writes an assistant's call
    "hermes": "{{ '<tool_call>\\n' + ({'name': c.function.name, 'arguments': c.function.arguments} | tojson) "
              "+ '\\n</tool_call>' }}",
    "qwen3_coder": "{{ '<tool_call>\\n<function=' + c.function.name + '>\\n' }}{% for k, v in c.function.arguments"
                   ".items() %}{{ '<parameter=' + k + '>\\n' + (v | string) + '\\n</parameter>\\n' }}{% endfor %}"
                   "{{ '</function>\\n</tool_call>' }}",
    "mistral": "{{ '[TOOL_CALLS]' + c.function.name + '[ARGS]' + (c.function.arguments | tojson) }}",
    "llama3_json": "{{ '<|python_tag|>' + ({'name': c.function.name, 'parameters': c.function.arguments} | tojson) }}",
    "pythonic": "{{ '<|tool_call_start|>[' + c.function.name + '()]<|tool_call_end|>' }}",
    "gemma4": "{{ '<|tool_call>call:' + c.function.name + '{}<tool_call|>' }}",
}
TEMPLATE = """{%- if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}
{%- for c in m.tool_calls or [] %}CALL{% endfor %}<|im_end|>\n{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"""
CITY = {"type": "string", "enum": ["Paris", "Rome", "Zürich"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": CITY}, "required": ["city"],
                       "additionalProperties": False}}}  # a random model would write keys of its own on and on
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
# The JSON format given to Ollama's client: where the model writes no marker, a bare call (Hermes' and Llama 3's
# parsers read one as a call).
BARE_CALL = {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": TOOL["function"][
    "parameters"]}, "required": ["name", "arguments"], "additionalProperties": False}


def prefer(model: torch.nn.Module, ids: list[int]) -> None:
    """Make the model write one of ids wherever it may: the residual stream's first dimension is the same large
    number after every token (no layer writes to it), and only these tokens' rows of the head read it."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0
            layer.mlp.down_proj.weight[0] = 0
        model.model.embed_tokens.weight[:, 0] = 50.0
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight[:, 0] = 0
        model.lm_head.weight[ids, 0] = 100.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("markers")
    hf = Tokenizer.load(default_model_path()).hf
    hf.add_tokens(["<tool_call>", "</tool_call>"])
    hf.add_special_tokens({"additional_special_tokens": sorted(TOOL_MARKERS)})
    model = tiny.build("llama", directory, vocab_size=len(hf), tie_word_embeddings=False)
    # the markers, and "}": the ollama client drops additionalProperties, and a random model would write keys of
    # its own on and on
    prefer(model, hf.convert_tokens_to_ids(["<tool_call>", "</tool_call>", *sorted(TOOL_MARKERS), "\"}", "}"]))
    model.save_pretrained(directory)
    hf.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server of a model per format (each template's choice is under test), named for its format: one
    server start, not one per format (seconds each), each model's engine in a thread of it, a small KV pool."""
    models = tmp_path_factory.mktemp("formats")
    for name, call in CALLS.items():
        shutil.copytree(checkpoint, models / name)
        hf = Tokenizer.load(models / name).hf
        hf.chat_template = TEMPLATE.replace("CALL", call)
        hf.save_pretrained(models / name)
    with running_server(models / "server.log", "--models-dir", str(models), "--dtype", "float32", "--num-threads",
                        "1", "--kv-cache-memory", "4MiB", *IN_THREAD) as server:
        yield server


@pytest.fixture(scope="module", params=list(CALLS))
def family(request, server: ServerProcess) -> str:
    """The model whose template writes calls in this format, loaded."""
    server.post("/models/load", {"model": request.param})
    assert re.search(rf"model {request.param} loaded in [\d.]+ s: tool calls in {request.param}'s format",
                     server.log.read_text())
    return request.param


def test_a_named_call_comes_back_as_tool_calls_in_each_format(server: ServerProcess, family: str) -> None:
    client = openai.OpenAI(base_url=server.api, api_key="none", max_retries=0, timeout=120)
    args = {"model": family, "messages": QUESTION, "tools": [TOOL], "max_tokens": 300, "temperature": 0,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    choice = client.chat.completions.create(**args).choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in CITY["enum"]
    chunks = list(client.chat.completions.create(stream=True, **args))
    deltas = [d for chunk in chunks for d in chunk.choices[0].delta.tool_calls or []]
    assert not "".join(chunk.choices[0].delta.content or "" for chunk in chunks)  # no byte of call syntax
    assert {d.index for d in deltas} == {0} and deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)
    message = claude.messages.create(model=family, max_tokens=300, messages=QUESTION, tool_choice={
        "type": "tool", "name": "get_weather"}, tools=[{"name": "get_weather", "input_schema": TOOL["function"][
            "parameters"]}], extra_body={"temperature": 0})
    assert message.stop_reason == "tool_use"
    (block,) = message.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.input["city"] in CITY["enum"]


def test_a_call_cut_short_is_its_text_and_stop_reason_says_so(server: ServerProcess, family: str) -> None:
    fmt = next(f for f in FORMATS if f.name == family)
    client = openai.OpenAI(base_url=server.api, api_key="none", max_retries=0, timeout=120)
    args = {"model": family, "messages": QUESTION, "tools": [TOOL], "max_tokens": 4, "temperature": 0,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    choice = client.chat.completions.create(**args).choices[0]
    assert (choice.finish_reason, choice.stop_reason, choice.message.tool_calls) == (
        "length", "unfinished_tool_call", None)
    assert choice.message.content.startswith((fmt.open if fmt.grammar_open is None else fmt.grammar_open) or "{")
    chunks = [chunk.choices[0] for chunk in client.chat.completions.create(stream=True, **args) if chunk.choices]
    assert "".join(c.delta.content or "" for c in chunks) == choice.message.content  # flushed before the end
    assert (chunks[-1].finish_reason, chunks[-1].stop_reason) == ("length", "unfinished_tool_call")


def test_the_ollama_client_gets_calls_with_arguments_as_objects(server: ServerProcess, family: str) -> None:
    client = ollama.Client(host=server.url, timeout=120)
    args = {"model": family, "messages": QUESTION, "tools": [TOOL], "format": BARE_CALL,
            "options": {"temperature": 0, "num_predict": 60}}
    whole = client.chat(**args)
    assert whole.message.tool_calls and all(call.function.name == "get_weather" and call.function.arguments[
        "city"] in CITY["enum"] for call in whole.message.tool_calls)
    streamed = [call for part in client.chat(stream=True, **args) for call in part.message.tool_calls or []]
    assert [c.function for c in streamed] == [c.function for c in whole.message.tool_calls]
