"""The chat request inside the server (server/common/request.py): its messages and tools render for the chat
template exactly as OpenAI's wire models dump them, and a tool choice is checked once, naming the field."""
from __future__ import annotations

import pytest

from zhuzi.server.anthropic.serving import NAMES as ANTHROPIC_NAMES
from zhuzi.server.common.errors import ApiError
from zhuzi.server.common.request import ChatRequest, Message, NamedTool, Tool
from zhuzi.server.openai.protocol import ChatMessage, ToolDef

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}], "name": "ann"},
    {"role": "assistant", "content": None, "reasoning_content": "They greet.",
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
                    {"type": "function", "function": {"name": "g"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "2"},
    {"role": "assistant", "content": "", "tool_calls": []},
]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}},
         {"type": "function", "function": {"name": "g", "description": "Gee."}}]


@pytest.mark.parametrize("message", MESSAGES)
def test_a_message_renders_as_openais_wire_model_dumps_it(message: dict) -> None:
    wire = ChatMessage.model_validate(message)
    assert wire.chat("messages.0").template() == wire.model_dump(exclude_none=True)


@pytest.mark.parametrize("tool", TOOLS)
def test_a_tool_renders_as_openais_wire_model_dumps_it(tool: dict) -> None:
    wire = ToolDef.model_validate(tool)
    assert wire.function.chat().template() == wire.model_dump(exclude_none=True)


def test_template_args_carry_the_tools_and_the_choice_in_the_templates_words() -> None:
    request = ChatRequest([Message("user", "hi")], tools=[Tool("f")], tool_choice=NamedTool("f"),
                          chat_template_kwargs={"enable_thinking": False})
    assert request.template_args() == {
        "tools": [{"type": "function", "function": {"name": "f"}}], "add_generation_prompt": True,
        "continue_final_message": False,
        "chat_template_kwargs": {"enable_thinking": False, "tool_choice": {"type": "function", "function": {
            "name": "f"}}}}
    assert ChatRequest([Message("user", "hi")]).template_args()["tools"] is None


@pytest.mark.parametrize("choice", ["required", NamedTool("f")])
def test_a_forcing_tool_choice_needs_tools(choice) -> None:
    with pytest.raises(ApiError) as refused:
        ChatRequest([Message("user", "hi")], tool_choice=choice)
    assert (refused.value.status, refused.value.param) == (400, "tool_choice")


def test_a_named_tool_choice_must_name_a_tool() -> None:
    with pytest.raises(ApiError) as refused:
        ChatRequest([Message("user", "hi")], tools=[Tool("f"), Tool("g")], tool_choice=NamedTool("h"))
    assert refused.value.param == "tool_choice"
    assert refused.value.message == "tool_choice names 'h', which is not among the tools ['f', 'g']"
    for choice in ("none", "auto", None):
        assert ChatRequest([Message("user", "hi")], tool_choice=choice).forces_tool_call is False


def test_an_error_is_renamed_into_the_apis_words() -> None:
    error = ApiError(400, "tools.1.parameters: not a schema", param="tools.1.parameters")
    renamed = error.renamed(ANTHROPIC_NAMES)
    assert (renamed.param, renamed.message) == ("tools.1.input_schema", "tools.1.input_schema: not a schema")
    assert ApiError(400, "model", param="model").renamed(ANTHROPIC_NAMES).param == "model"
