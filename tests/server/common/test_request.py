"""The chat request inside the server (server/common/request.py): its messages and tools render for the chat
template exactly as OpenAI's wire models dump them, and a tool choice is checked once, naming the field. A tool
conversation (a call, its result, the answer) comes from each API in the same shape and renders with real
templates (templates/: Qwen2.5's, as the Qwen2.5-Coder GGUF files carry it, Mistral Nemo's, Mistral Small 3.2's
and Gemma 4's, from their models' repositories, Apache-2.0; SmolLM2's, which ignores tools) as their authors
wrote them; a malformed history is a 400 naming the API's field."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from zhuzi.model.loader import default_model_path
from zhuzi.server.anthropic import protocol as a
from zhuzi.server.anthropic import serving as anthropic
from zhuzi.server.anthropic.serving import NAMES as ANTHROPIC_NAMES
from zhuzi.server.common.errors import ApiError
from zhuzi.server.common.request import ChatRequest, Message, NamedTool, Tool
from zhuzi.server.common.tools import with_calls_as_text, with_generic_tools
from zhuzi.server.ollama import protocol as o
from zhuzi.server.ollama import serving as ollama
from zhuzi.server.openai.protocol import ChatCompletionRequest, ChatMessage, ToolDef
from zhuzi.server.responses import protocol as rp
from zhuzi.server.responses import serving as responses
from zhuzi.tokenizer import Tokenizer

TEMPLATES = Path(__file__).parent / "templates"

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


# ---------------------------------------------------------------- a tool conversation from each API

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
QUESTION, RESULT, ANSWER = "What's the weather in Paris?", '{"celsius": 23}', "It is 23 °C in Paris."


def openai_chat(calls: list[dict], results: list[dict]) -> ChatRequest:
    return ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": None, "tool_calls": calls},
        *results, {"role": "assistant", "content": ANSWER}, {"role": "user", "content": "Thanks"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]}).chat()


def anthropic_chat(calls: list[dict], results: list[dict]) -> ChatRequest:
    return anthropic.chat_request(a.MessagesRequest.model_validate({"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": calls},
        {"role": "user", "content": results}, {"role": "assistant", "content": ANSWER},
        {"role": "user", "content": "Thanks"}], "tools": [{"name": "get_weather", "input_schema": WEATHER}]}))


def ollama_chat(calls: list[dict], results: list[dict]) -> ChatRequest:
    messages = [o.Message.model_validate(m) for m in [
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": "", "tool_calls": calls},
        *results, {"role": "assistant", "content": ANSWER}, {"role": "user", "content": "Thanks"}]]
    return ChatRequest(ollama.chat_messages(messages), tools=[Tool("get_weather", None, WEATHER)])


def responses_chat(calls: list[dict], results: list[dict]) -> ChatRequest:
    body = rp.ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": QUESTION}, *calls, *results, {"role": "assistant", "content": ANSWER},
        {"role": "user", "content": "Thanks"}],
        "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER}]})
    return responses.chat_request(body, [], responses.input_items(body))


def weather_call(api: str, call_id: str = "call_1", arguments: Any = None) -> dict:
    """A call of get_weather in the API's words; arguments: JSON text (OpenAI's, the Responses API's) or an
    object (Anthropic's, Ollama's)."""
    arguments = {"city": "Paris"} if arguments is None else arguments
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"openai": {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": text}},
            "anthropic": {"type": "tool_use", "id": call_id, "name": "get_weather", "input": arguments},
            "ollama": {"function": {"name": "get_weather", "arguments": arguments}},
            "responses": {"type": "function_call", "call_id": call_id, "name": "get_weather",
                          "arguments": text}}[api]


def weather_result(api: str, call_id: str = "call_1") -> dict:
    return {"openai": {"role": "tool", "tool_call_id": call_id, "content": RESULT},
            "anthropic": {"type": "tool_result", "tool_use_id": call_id, "content": RESULT},
            "ollama": {"role": "tool", "tool_name": "get_weather", "content": RESULT},
            "responses": {"type": "function_call_output", "call_id": call_id, "output": RESULT}}[api]


CHATS = {"openai": openai_chat, "anthropic": anthropic_chat, "ollama": ollama_chat, "responses": responses_chat}


def conversation(api: str, call_id: str = "call_1", arguments: Any = None) -> ChatRequest:
    return CHATS[api]([weather_call(api, call_id, arguments)], [weather_result(api, call_id)])


def with_template(name: str) -> Tokenizer:
    """SmolLM2's tokenizer with a family's chat template (its own, for smollm2)."""
    hf = Tokenizer.load(default_model_path()).hf
    if name != "smollm2":
        hf.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    return Tokenizer(hf)


def rendered(tokenizer: Tokenizer, chat: ChatRequest) -> str:
    messages, args = chat.template_messages(), chat.template_args()
    if "tools" not in tokenizer.template_variables:  # as the server does for a template that ignores tools
        messages = with_generic_tools(with_calls_as_text(messages), args["tools"])
    return tokenizer.render_chat(messages, **args)


# Qwen2.5's (Hermes) format: the call's arguments an object inside <tool_call>, the result a user turn's
# <tool_response>.
QWEN_HISTORY = f"""<|im_start|>user
{QUESTION}<|im_end|>
<|im_start|>assistant
<tool_call>
{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}
</tool_call><|im_end|>
<|im_start|>user
<tool_response>
{RESULT}
</tool_response><|im_end|>
<|im_start|>assistant
{ANSWER}<|im_end|>
<|im_start|>user
Thanks<|im_end|>
<|im_start|>assistant
"""


@pytest.mark.parametrize("template", ["qwen2.5", "gemma-4", "smollm2"])
def test_every_api_brings_a_tool_conversation_to_the_template_alike(template: str) -> None:
    tokenizer = with_template(template)
    documents = {api: rendered(tokenizer, conversation(api)) for api in CHATS}
    assert len(set(documents.values())) == 1, documents
    document = documents["openai"]
    if template == "qwen2.5":
        assert document.endswith(QWEN_HISTORY)
    if template == "gemma-4":  # its own notation for the arguments, which needs them as an object
        assert "<|tool_call>call:get_weather{city:<|\"|>Paris<|\"|>}<tool_call|>" \
               '<|tool_response>response:get_weather{value:<|"|>{"celsius": 23}<|"|>}<tool_response|>' in document
    if template == "smollm2":  # the generic format: the call written as the model writes one
        assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' \
               "</tool_call><|im_end|>\n<|im_start|>tool\n" + RESULT in document


def test_a_tool_result_takes_the_name_of_the_call_it_answers() -> None:
    for api in CHATS:
        assert conversation(api).template_messages()[2]["name"] == "get_weather", api


def test_a_call_without_arguments_may_send_them_empty() -> None:
    """Models write "" for a function without parameters, and agents send it back so: the template reads {}."""
    tokenizer = with_template("qwen2.5")
    for api in ("openai", "responses"):
        assert '{"name": "get_weather", "arguments": {}}' in rendered(tokenizer, conversation(api, arguments=""))


MISTRAL_HISTORY = {  # the call and its result, as each template writes them with the id <id>
    "mistral-nemo": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "<id>"}]<|im_end|>'
                    f'[TOOL_RESULTS]{{"content": {RESULT}, "call_id": "<id>"}}[/TOOL_RESULTS]',
    "mistral-small-3.2": '[TOOL_CALLS]get_weather[CALL_ID]<id>[ARGS]{"city": "Paris"}<|im_end|>'
                         f"[TOOL_RESULTS]<id>[TOOL_CONTENT]{RESULT}[/TOOL_RESULTS]"}


@pytest.mark.parametrize("template", list(MISTRAL_HISTORY))
def test_mistral_reads_every_call_id_as_its_nine_characters(template: str) -> None:
    """Mistral's templates refuse ids of another length: zhuzi's (call_...) reach them as nine characters, the
    call's and its result's alike; an id of Mistral's own form stays."""
    tokenizer = with_template(template)
    document = rendered(tokenizer, conversation("openai", call_id="call_8f2a7c1e9b0d4e6f"))
    call_id = document.partition(MISTRAL_HISTORY[template].partition("<id>")[0])[2][:9]
    assert len(call_id) == 9 and call_id.isalnum()
    assert MISTRAL_HISTORY[template].replace("<id>", call_id) in document
    own = MISTRAL_HISTORY[template].replace("<id>", "a1B2c3D4e")
    assert own in rendered(tokenizer, conversation("openai", call_id="a1B2c3D4e"))


# ---------------------------------------------------------------- a malformed history: 400, naming the field

def refusal(build: Any) -> ApiError:
    with pytest.raises(ApiError) as refused:
        build()
    assert refused.value.status == 400
    assert refused.value.message.startswith(f"{refused.value.param}: ")
    return refused.value


@pytest.mark.parametrize(("api", "param"), [("openai", "messages.2.tool_call_id"),
                                            ("anthropic", "messages.2.content.0.tool_use_id"),
                                            ("responses", "input.2.call_id")])
def test_a_result_that_answers_no_call_is_refused(api: str, param: str) -> None:
    error = refusal(lambda: CHATS[api]([weather_call(api)], [weather_result(api, "call_9")]))
    assert error.param == param and "'call_9' is the id of no earlier tool call" in error.message


def test_an_ollama_result_of_a_function_no_call_called_is_refused() -> None:
    result = {**weather_result("ollama"), "tool_name": "get_time"}
    error = refusal(lambda: ollama_chat([weather_call("ollama")], [result]))
    assert error.param == "messages.2.tool_name" and "no earlier tool call is of 'get_time'" in error.message


@pytest.mark.parametrize("api", list(CHATS))
def test_a_result_before_any_call_is_refused(api: str) -> None:
    first = {"anthropic": {"role": "user", "content": [weather_result(api)]}, "responses": weather_result(api)}
    build = {"openai": lambda: ChatCompletionRequest.model_validate(
                 {"messages": [{"role": "user", "content": "Hi"}, weather_result(api)]}).chat(),
             "anthropic": lambda: anthropic.chat_request(a.MessagesRequest.model_validate(
                 {"model": "m", "max_tokens": 8, "messages": [first[api]]})),
             "ollama": lambda: ChatRequest(ollama.chat_messages([o.Message.model_validate(weather_result(api))])),
             "responses": lambda: responses.chat_request(
                 body := rp.ResponsesRequest.model_validate({"input": [first[api]]}), [],
                 responses.input_items(body))}
    error = refusal(build[api])
    assert "no assistant message before it calls a tool" in error.message
    assert error.param == {"openai": "messages.1.tool_call_id", "anthropic": "messages.0.content.0.tool_use_id",
                           "ollama": "messages.0.tool_name", "responses": "input.0.call_id"}[api]


@pytest.mark.parametrize(("api", "param"), [("openai", "messages.1.tool_calls.0.function.arguments"),
                                            ("responses", "input.1.arguments")])
@pytest.mark.parametrize(("arguments", "why"), [('{"city": "Par', "must be JSON text"),
                                                ('["Paris"]', "must be a JSON object"),
                                                ('"Paris"', "must be a JSON object")])
def test_arguments_that_are_not_a_json_object_are_refused(api: str, param: str, arguments: str, why: str) -> None:
    error = refusal(lambda: conversation(api, arguments=arguments))
    assert error.param == param and why in error.message


def test_a_call_without_its_functions_name_is_refused() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "", "arguments": "{}"}}
    error = refusal(lambda: openai_chat([call], [weather_result("openai")]))
    assert error.param == "messages.1.tool_calls.0.function.name"


def test_ollama_results_without_ids_answer_their_calls_in_order() -> None:
    """Ollama's clients send neither call ids nor result ids: each result answers the first unanswered call of
    its tool_name (of any function, with no tool_name)."""
    calls = [weather_call("ollama", arguments={"city": city}) for city in ("Paris", "Rome")]
    calls.append({"function": {"name": "get_time", "arguments": {}}})
    results = [{"role": "tool", "tool_name": "get_time", "content": "noon"},
               {"role": "tool", "tool_name": "get_weather", "content": "sunny"},
               {"role": "tool", "content": "rain"}]
    chat = ollama_chat(calls, results)
    ids = [call.id for call in chat.messages[1].tool_calls]
    assert [(m.tool_call_id, m.name) for m in chat.messages[2:5]] == [
        (ids[2], "get_time"), (ids[0], "get_weather"), (ids[1], "get_weather")]


def test_stored_turns_are_not_checked_again() -> None:
    """A Responses follow-up carries the stored turns before its input: a stored call (no source) is not this
    request's to fix, and the new result may answer it."""
    stored = [{"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Pa',
               "id": "fc_1", "status": "completed"}]
    body = rp.ResponsesRequest.model_validate({"input": [weather_result("responses")]})
    chat = responses.chat_request(body, stored, responses.input_items(body))
    assert chat.messages[-1].name == "get_weather"
