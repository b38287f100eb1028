"""Forced calls in each family's format, through the server: a tiny random Llama with SmolLM2's vocabulary plus
the families' markers (as the tokens they are), greedy, served with a template that writes calls as the family does, so
that the server reads and forces calls in that format; named in tool_choice, the call comes back as tool_calls
(the OpenAI client, whole and streamed) and as a tool_use block (the Anthropic client)."""
from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest
import tiny
from server_process import ServerProcess, running_server

from zhuzi.model.loader import default_model_path
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


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("markers")
    hf = Tokenizer.load(default_model_path()).hf
    hf.add_tokens(["<tool_call>", "</tool_call>"])
    hf.add_special_tokens({"additional_special_tokens": sorted(TOOL_MARKERS)})
    tiny.build("llama", directory, vocab_size=len(hf))
    hf.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module", params=list(CALLS))
def family(request, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp(request.param)
    shutil.copytree(checkpoint, directory, dirs_exist_ok=True)
    hf = Tokenizer.load(directory).hf
    hf.chat_template = TEMPLATE.replace("CALL", CALLS[request.param])
    hf.save_pretrained(directory)
    # one server per format (each template's choice is under test), each as cheap as a server gets: its engine
    # in a thread of the server process, a small KV pool
    with running_server(directory / "server.log", str(directory), "--dtype", "float32", "--num-threads", "1",
                        "--served-model-name", "tiny", "--no-engine-process", "--kv-cache-memory", "4MiB") as server:
        assert f"tool calls in {request.param}'s format" in server.log.read_text()
        yield server


def test_a_named_call_comes_back_as_tool_calls_in_each_format(family: ServerProcess) -> None:
    client = openai.OpenAI(base_url=family.api, api_key="none", max_retries=0, timeout=120)
    args = {"model": "tiny", "messages": QUESTION, "tools": [TOOL], "max_tokens": 300, "temperature": 0,
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
    claude = anthropic.Anthropic(base_url=family.url, api_key="none", max_retries=0, timeout=120)
    message = claude.messages.create(model="tiny", max_tokens=300, messages=QUESTION, tool_choice={
        "type": "tool", "name": "get_weather"}, tools=[{"name": "get_weather", "input_schema": TOOL["function"][
            "parameters"]}], extra_body={"temperature": 0})
    assert message.stop_reason == "tool_use"
    (block,) = message.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.input["city"] in CITY["enum"]
