"""The OpenAI Agents SDK (openai-agents), unmodified, over /v1/responses of a real `zhuzi serve` (the session's
server with two API keys, SmolLM2-135M-Instruct at temperature 0): a plain run, a streamed run, and an agent
whose function tool runs and whose result goes back to the model. Tracing is off, so that nothing is sent to
OpenAI's host: the only server the SDK reaches is zhuzi. Every Response and stream is checked against the Open
Responses specification's schema as it passes (open_responses.py)."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator

import agents
import httpx
import openai
import pytest
from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner, function_tool
from agents.agent import ToolsToFinalOutputResult
from conftest import KEYS
from open_responses import AsyncSpecTransport, SpecTransport
from server_process import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"
SETTINGS = ModelSettings(temperature=0, max_tokens=64)
LOCAL = RunConfig(tracing_disabled=True)


@pytest.fixture(scope="module", autouse=True)
def no_tracing() -> Iterator[None]:
    agents.set_tracing_disabled(True)
    yield
    agents.set_tracing_disabled(False)


@pytest.fixture
def model(keyed_server: ServerProcess) -> OpenAIResponsesModel:
    """A client for each test: an async client's connections belong to the event loop of the run that used it."""
    client = openai.AsyncOpenAI(base_url=keyed_server.api, api_key=KEYS[0], max_retries=0, timeout=120,
                                http_client=httpx.AsyncClient(transport=AsyncSpecTransport()))
    return OpenAIResponsesModel(MODEL, client)


@pytest.fixture(scope="module")
def answer(keyed_server: ServerProcess) -> str:
    """What zhuzi answers the agent's request itself, through the openai client."""
    client = openai.OpenAI(base_url=keyed_server.api, api_key=KEYS[0], max_retries=0, timeout=120,
                           http_client=httpx.Client(transport=SpecTransport()))
    return client.responses.create(model=MODEL, instructions="Be brief.", input=QUESTION, temperature=0,
                                   max_output_tokens=64).output_text


def test_a_plain_run_ends_with_zhuzis_answer(model: OpenAIResponsesModel, answer: str) -> None:
    agent = Agent(name="brief", instructions="Be brief.", model=model, model_settings=SETTINGS)
    result = Runner.run_sync(agent, QUESTION, run_config=LOCAL)
    assert result.final_output == answer and "Paris" in answer
    (response,) = result.raw_responses
    assert response.usage.output_tokens > 0 and response.response_id.startswith("resp_")


def test_a_streamed_run_ends_with_the_text_its_deltas_wrote(model: OpenAIResponsesModel, answer: str) -> None:
    agent = Agent(name="brief", instructions="Be brief.", model=model, model_settings=SETTINGS)

    async def run() -> tuple[str, str]:
        streamed = Runner.run_streamed(agent, QUESTION, run_config=LOCAL)
        deltas = [event.data.delta async for event in streamed.stream_events()
                  if event.type == "raw_response_event" and event.data.type == "response.output_text.delta"]
        return streamed.final_output, "".join(deltas)

    final, deltas = asyncio.run(run())
    assert final == deltas == answer


def test_a_function_tool_runs_and_its_result_goes_back(keyed_server: ServerProcess,
                                                       model: OpenAIResponsesModel) -> None:
    """tool_choice required makes SmolLM2 call add (zhuzi's grammar holds the call to the tool's schema); the
    SDK runs it and sends its result back in the next request, whose input items zhuzi stored. The run stops
    after that second answer, whatever it is (SmolLM2 would call add again)."""
    calls: list[tuple[int, int]] = []

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two whole numbers."""
        calls.append((a, b))
        return a + b

    def after_the_second_answer(context: object, results: list) -> ToolsToFinalOutputResult:
        return ToolsToFinalOutputResult(is_final_output=len(calls) == 2, final_output=results[-1].output)

    agent = Agent(name="adder", instructions="Use the tool.", tools=[add], model=model,
                  model_settings=ModelSettings(temperature=0, max_tokens=64, tool_choice="required",
                                               parallel_tool_calls=False),
                  tool_use_behavior=after_the_second_answer)
    result = Runner.run_sync(agent, "What is 2 plus 3?", run_config=LOCAL)
    assert calls[0] == (2, 3) and len(result.raw_responses) == 2
    (first_call,) = result.raw_responses[0].output
    assert first_call.type == "function_call" and first_call.name == "add"
    client = openai.OpenAI(base_url=keyed_server.api, api_key=KEYS[0], max_retries=0, timeout=120)
    sent = client.responses.input_items.list(result.raw_responses[1].response_id, order="asc").data
    returned = [item for item in sent if item.type == "function_call_output"]
    assert [(item.call_id, item.output) for item in returned] == [(first_call.call_id, "5")]
