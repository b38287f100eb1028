"""Every parameter of the anthropic SDK's messages.create and messages.stream, sent through the SDK, unmodified,
to the session's server with API keys: each is served by its meaning or refused with a 400 whose message names
it (docs/serving.md's table). A few tokens each."""
from __future__ import annotations

import json

import anthropic
import pytest
from conftest import KEYS
from pydantic import BaseModel
from server_process import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
HI = [{"role": "user", "content": "Hi"}]
TOOL = {"name": "f", "description": "a function", "input_schema": {"type": "object",
                                                                   "properties": {"a": {"type": "string"}}}}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}

# (field, value, None when served, else words of the refusal); temperature, top_p and top_k are no longer
# parameters of the SDK's create: it sends them in extra_body.
MESSAGES = [
    ("cache_control", {"type": "ephemeral"}, None),
    ("container", "container-1", "code execution containers"),
    ("diagnostics", {"previous_message_id": "msg_1"}, "prefix-cache misses"),
    ("inference_geo", "us", "runs where it was started"),
    ("metadata", {"user_id": "user-1"}, None),
    ("output_config", {"effort": "low"}, None),
    ("service_tier", "standard_only", None),
    ("speed", "standard", None),
    ("speed", "fast", "'standard'"),
    ("stop_sequences", ["\n"], None),
    ("system", [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}], None),
    ("thinking", {"type": "disabled"}, None),
    ("tool_choice", {"type": "any"}, None),
    ("tools", [TOOL], None),
    ("temperature", 0.5, None),
    ("top_p", 0.5, None),
    ("top_k", 5, None),
    ("mcp_servers", [], "MCP servers"),
]
EXTRA = {"tool_choice": {"tools": [TOOL]}}
SDK_PARAMS = {"temperature", "top_p", "top_k", "mcp_servers"}  # sent in extra_body


@pytest.fixture(scope="module")
def claude(keyed_server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(api_key=KEYS[0], base_url=keyed_server.url, max_retries=0, timeout=120)


@pytest.mark.parametrize(("field", "value", "refusal"), MESSAGES, ids=[f"{f}={v}" for f, v, _ in MESSAGES])
def test_each_messages_parameter_is_served_or_refused_by_name(claude: anthropic.Anthropic, field, value,
                                                              refusal) -> None:
    given = {"extra_body": {field: value}} if field in SDK_PARAMS else {field: value}
    args = {"model": MODEL, "max_tokens": 24 if field.startswith("tool") else 2, "messages": HI,
            **EXTRA.get(field, {}), **given}
    if refusal is None:
        message = claude.messages.create(**args)
        assert message.content and message.stop_reason in ("end_turn", "max_tokens", "stop_sequence", "tool_use")
        return
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(**args)
    error = refused.value.body["error"]
    assert field in error["message"] and refusal in error["message"], error


class Capital(BaseModel):
    city: str


def test_an_output_format_holds_the_reply_to_its_schema(claude: anthropic.Anthropic) -> None:
    question = [{"role": "user", "content": "Which city is the capital of France?"}]
    message = claude.messages.create(model=MODEL, max_tokens=48, messages=question,
                                     output_config={"format": {"type": "json_schema", "schema": SCHEMA}})
    assert message.stop_reason == "end_turn" and isinstance(json.loads(message.content[0].text)["city"], str)
    # messages.stream's output_format takes a pydantic type, which the SDK sends as output_config.format
    with claude.messages.stream(model=MODEL, max_tokens=48, messages=question, output_format=Capital) as stream:
        streamed = stream.get_final_message()
    assert isinstance(streamed.content[0].parsed_output, Capital)
