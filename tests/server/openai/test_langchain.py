"""LangChain's ChatOpenAI (langchain-openai), unmodified, against the session's default `zhuzi serve`
(SmolLM2-135M-Instruct): a streamed reply, with_structured_output with a pydantic model (OpenAI's json_schema
response format, and function calling), and bind_tools with the tool forced. The model is small: the
structured answers hold because zhuzi's grammars constrain them, so these tests are about the protocol."""
from __future__ import annotations

import pytest
from pydantic import BaseModel
from server_process import ServerProcess

pytest.importorskip("langchain_openai", reason="make test-clients installs it")
from langchain_core.messages import AIMessageChunk  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
pytestmark = pytest.mark.clients


class City(BaseModel):
    name: str
    country: str


@tool
def get_weather(city: str) -> str:
    """Current weather in a city."""
    return "Sunny, 22 degrees Celsius"


@pytest.fixture(scope="module")
def chat(server: ServerProcess) -> ChatOpenAI:
    # room for a JSON object however the grammar lets the model space it (a cut one is no call)
    return ChatOpenAI(model=MODEL, base_url=server.api, api_key="none", temperature=0, max_tokens=64,
                      max_retries=0, timeout=120)


def test_a_streamed_reply_is_the_whole_reply_in_pieces(chat: ChatOpenAI) -> None:
    whole = chat.invoke("What is the capital of France?")
    chunks = list(chat.stream("What is the capital of France?", stream_usage=True))
    assert len(chunks) > 2 and all(isinstance(c, AIMessageChunk) for c in chunks)
    streamed = sum(chunks[1:], chunks[0])
    assert streamed.content == whole.content and "Paris" in whole.content
    assert streamed.usage_metadata["output_tokens"] == whole.usage_metadata["output_tokens"] > 0


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_gives_the_pydantic_model(chat: ChatOpenAI, method: str) -> None:
    city = chat.with_structured_output(City, method=method).invoke("Name the capital of France and its country.")
    assert isinstance(city, City) and city.name and city.country


def test_bind_tools_with_the_tool_forced_gives_its_call(chat: ChatOpenAI) -> None:
    reply = chat.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
    (call,) = reply.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str) and call["id"]
    assert get_weather.invoke(call).content == "Sunny, 22 degrees Celsius"  # the call runs as LangChain runs it
