"""The OpenAI Agents SDK (openai-agents), unmodified, on a real tool-calling model: an agent with a function tool,
run streamed over /v1/responses of a real `zhuzi serve` of Qwen2.5-Coder-0.5B-Instruct's GGUF
(tests/real_weights/conftest.py), greedy. The call is forced (tool_choice names the tool), so the test checks zhuzi,
not how often a 0.5B model decides to call; the tool runs with the model's arguments and the run stops there
(stop_on_first_tool). The conversation then goes on in a second streamed run with tool_choice "none": offered
the tool again, the 0.5B calls it again (as tests/real_weights/test_qwen_tools.py finds through the openai client),
where asked to answer it answers from the tool's result. Tracing is off, so nothing is sent to OpenAI's host."""
from __future__ import annotations

import asyncio

import openai
import pytest
from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner, function_tool
from server.server_process import ServerProcess

pytestmark = pytest.mark.models

LOCAL = RunConfig(tracing_disabled=True)


async def streamed(agent: Agent, given: str | list) -> tuple[object, list[str], list]:
    """A streamed run: its result, its text deltas, and the items it produced, in order."""
    run = Runner.run_streamed(agent, given, max_turns=2, run_config=LOCAL)
    deltas, items = [], []
    async for event in run.stream_events():
        if event.type == "raw_response_event" and event.data.type == "response.output_text.delta":
            deltas.append(event.data.delta)
        elif event.type == "run_item_stream_event":
            items.append(event.item)
    return run, deltas, items


def test_a_function_tool_runs_and_the_answer_uses_its_result(qwen_server: ServerProcess) -> None:
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city.

        Args:
            city: The city's name.
        """
        cities.append(city)
        return '{"temperature_celsius": 23, "sky": "sunny"}'

    async def conversation() -> tuple:
        client = openai.AsyncOpenAI(base_url=qwen_server.api, api_key="none", max_retries=0, timeout=600)
        name = (await client.models.list()).data[0].id
        caller = Agent(name="weather", instructions="Answer with the tool's data.", tools=[get_weather],
                       model=OpenAIResponsesModel(name, client), tool_use_behavior="stop_on_first_tool",
                       model_settings=ModelSettings(temperature=0, max_tokens=96, tool_choice="get_weather",
                                                    parallel_tool_calls=False))
        called = await streamed(caller, "What's the weather like in Paris right now?")
        answerer = caller.clone(model_settings=ModelSettings(temperature=0, max_tokens=96, tool_choice="none"))
        return called, await streamed(answerer, called[0].to_input_list())

    (called, _, call_items), (answered, deltas, answer_items) = asyncio.run(conversation())
    assert [item.type for item in call_items] == ["tool_call_item", "tool_call_output_item"]
    call, output = call_items
    assert call.raw_item.name == "get_weather" and output.raw_item["call_id"] == call.raw_item.call_id
    assert len(cities) == 1 and "paris" in cities[0].lower()
    assert called.final_output == output.output  # stop_on_first_tool: the tool's result ends the run
    assert [item.type for item in answer_items] == ["message_output_item"] and len(cities) == 1
    final = answered.final_output
    assert len(deltas) > 1 and "".join(deltas) == final  # the answer came as it was written
    assert "23" in final and "sunny" in final.lower()
