"""Reasoning and tool-call parsing on real template documents.

A Qwen3-style template (written here) renders a whole conversation, assistant
turn included; the part after the generation prompt is exactly what such a
model writes. It is tokenized with the real SmolLM2 tokenizer (plus Qwen's
<think>/<tool_call> added tokens), streamed token by token through the real
incremental detokenizer, and fed to the parser as a server would.
"""
from __future__ import annotations

import json

import pytest
import tiny

from zhuzi.detokenizer import IncrementalDetokenizer
from zhuzi.model.loader import default_model_path
from zhuzi.sampling_params import SamplingParams
from zhuzi.server.common.parsers import OutputParser, ParsedText, opened_thought
from zhuzi.server.openai.protocol import ChatCompletionRequest
from zhuzi.tokenizer import Tokenizer

_SYSTEM_AND_TOOLS = """
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\nCall a tool as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'user' %}
{{- '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}
{%- elif m.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- if m.reasoning_content is string %}{{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}
{{- m.content }}
{%- for call in m.tool_calls or [] %}
{{- '\\n<tool_call>\\n' + ({'name': call.function.name, 'arguments': call.function.arguments} | tojson) }}
{{- '\\n</tool_call>' }}
{%- endfor %}
{%- if not (loop.last and continue_final_message) %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- elif m.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
"""
# Qwen3: thinking is on unless enable_thinking=false, which writes an empty thought into the prompt.
QWEN3_LIKE = _SYSTEM_AND_TOOLS + """
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""
# DeepSeek-R1 style: the template opens the thought, so the model writes only its closing tag.
R1_LIKE = _SYSTEM_AND_TOOLS + """
{{- '<think>\\n' }}
{%- endif %}"""

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
QUESTION = [{"role": "system", "content": "You are a weather bot."},
            {"role": "user", "content": "Weather in Paris and in Zürich?"}]
REASONING = "Two cities, so two calls.\nThe user wrote Zürich with an umlaut."


def _with_template(template: str) -> Tokenizer:
    hf = Tokenizer.load(default_model_path()).hf  # a fresh copy: the tokens added below stay local
    hf.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>"])
    hf.chat_template = template
    return Tokenizer(hf)


@pytest.fixture(scope="module")
def qwen3() -> Tokenizer:
    return _with_template(QWEN3_LIKE)


@pytest.fixture(scope="module")
def r1() -> Tokenizer:
    return _with_template(R1_LIKE)


@pytest.fixture(scope="module")
def gemma4() -> Tokenizer:
    """Gemma 4's markers are special tokens; its thought is a channel (tiny.GEMMA4_TEMPLATE)."""
    hf = Tokenizer.load(default_model_path()).hf
    hf.add_special_tokens({"additional_special_tokens": tiny.GEMMA4_SPECIAL})
    hf.chat_template = tiny.GEMMA4_TEMPLATE
    return Tokenizer(hf)


def model_reply(tok: Tokenizer, question: list[dict], answer: dict, **kwargs) -> tuple[str, list[str]]:
    """(the prompt, the answer as the text pieces a server streams: one per generated token)."""
    prompt = tok.render_chat(question, add_generation_prompt=True, **kwargs)
    document = tok.render_chat(question + [answer], add_generation_prompt=False, **kwargs)
    assert document.startswith(prompt)
    reply = document[len(prompt):].removesuffix("\n")  # a model stops at its <|im_end|>
    ids = tok.encode(reply, parse_special=True)
    detok = IncrementalDetokenizer(tok, SamplingParams())
    return prompt, [detok.step(i)[0] for i in ids] + [detok.flush()]


def stream(parser: OutputParser, pieces: list[str]) -> list[ParsedText]:
    return [parser.feed(piece) for piece in pieces] + [parser.finish()]


def merged(deltas: list[ParsedText]) -> ParsedText:
    total = ParsedText()
    for delta in deltas:
        total.extend(delta)
    return total


def tool_calls_of(parsed: ParsedText) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls]


def test_thinking_reply_splits_into_reasoning_then_content(qwen3: Tokenizer) -> None:
    answer = {"role": "assistant", "reasoning_content": REASONING, "content": "Paris: 18 °C. Zürich: 12 °C."}
    prompt, pieces = model_reply(qwen3, QUESTION, answer)
    deltas = stream(OutputParser(reasoning=True, tools=False, prefill=opened_thought(prompt)), pieces)
    total = merged(deltas)
    assert (total.reasoning_content, total.content) == (REASONING, "Paris: 18 °C. Zürich: 12 °C.")
    first_content = next(i for i, d in enumerate(deltas) if d.content)
    assert not any(d.reasoning_content for d in deltas[first_content:])
    assert not any("<" in d.content + d.reasoning_content for d in deltas), "a tag leaked out in pieces"
    whole = OutputParser(reasoning=True, tools=False).parse("".join(pieces))
    assert (whole.reasoning_content, whole.content) == (total.reasoning_content, total.content)


def test_tool_calls_stream_as_openai_does_with_json_arguments(qwen3: Tokenizer) -> None:
    answer = {"role": "assistant", "reasoning_content": REASONING, "content": "Let me check.", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}]}
    prompt, pieces = model_reply(qwen3, QUESTION, answer, tools=[WEATHER_TOOL])
    deltas = stream(OutputParser(reasoning=True, tools=True, prefill=opened_thought(prompt)), pieces)
    total = merged(deltas)
    assert total.content == "Let me check."
    assert total.reasoning_content == REASONING
    assert tool_calls_of(total) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Zürich"})]
    starts = [call for delta in deltas for call in delta.tool_calls if call.id is not None]
    assert [(call.index, call.name) for call in starts] == [(0, "get_weather"), (1, "get_weather")]
    assert len({call.id for call in total.tool_calls}) == 2


def test_template_that_opens_the_thought_leaves_only_the_closing_tag(r1: Tokenizer) -> None:
    answer = {"role": "assistant", "reasoning_content": REASONING, "content": "Sunny in both."}
    prompt, pieces = model_reply(r1, QUESTION, answer)
    assert prompt.endswith("<think>\n") and "<think>" not in "".join(pieces)
    total = merged(stream(OutputParser(reasoning=True, tools=False, prefill=opened_thought(prompt)), pieces))
    assert (total.reasoning_content, total.content) == (REASONING, "Sunny in both.")


def test_reply_cut_off_inside_the_thought_is_all_reasoning(qwen3: Tokenizer) -> None:
    answer = {"role": "assistant", "reasoning_content": REASONING, "content": "Paris: 18 °C."}
    prompt, pieces = model_reply(qwen3, QUESTION, answer)
    cut = pieces[:8]  # max_tokens ran out mid-thought
    total = merged(stream(OutputParser(reasoning=True, tools=False, prefill=opened_thought(prompt)), cut))
    assert total.content == ""
    assert total.reasoning_content and REASONING.startswith(total.reasoning_content)


def test_thinking_switched_off_gives_plain_content(qwen3: Tokenizer) -> None:
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    answer = {"role": "assistant", "reasoning_content": "", "content": "Paris: 18 °C."}
    prompt, pieces = model_reply(qwen3, QUESTION, answer, **kwargs)
    assert prompt.endswith("<think>\n\n</think>\n\n") and opened_thought(prompt) == ""
    total = merged(stream(OutputParser(reasoning=True, tools=False, prefill=opened_thought(prompt)), pieces))
    assert (total.reasoning_content, total.content) == ("", "Paris: 18 °C.")


def test_gemma4_thought_channel_splits_into_reasoning_then_content(gemma4: Tokenizer) -> None:
    """Its channel tags are special tokens, shown all the same (skip_special_tokens keeps a thought's tags), and
    the channel's name is no part of the reasoning."""
    tags = gemma4.thought_tags
    reply = f"<|channel>thought\n{REASONING}<channel|>Paris: 18 °C.<turn|>"
    detok = IncrementalDetokenizer(gemma4, SamplingParams())
    pieces = [detok.step(i)[0] for i in gemma4.encode(reply, parse_special=True)] + [detok.flush()]
    assert "".join(pieces) == reply.removesuffix("<turn|>")  # the turn's end is not shown
    deltas = stream(OutputParser(reasoning=True, tools=False, tags=tags), pieces)
    assert (merged(deltas).reasoning_content, merged(deltas).content) == (REASONING, "Paris: 18 °C.")
    assert not any("<" in d.content + d.reasoning_content for d in deltas), "a tag leaked out in pieces"
    thinking = gemma4.render_chat(QUESTION, add_generation_prompt=True, chat_template_kwargs={"enable_thinking": True})
    assert opened_thought(thinking, tags) == "<|channel>thought"  # the template opened it: the reply only closes it
    total = merged(stream(OutputParser(reasoning=True, tools=False, prefill=opened_thought(thinking, tags), tags=tags),
                          pieces[2:]))
    assert (total.reasoning_content, total.content) == (REASONING, "Paris: 18 °C.")
    plain = gemma4.render_chat(QUESTION, add_generation_prompt=True)
    assert plain.endswith("<|channel>thought\n<channel|>") and opened_thought(plain, tags) == ""


def test_malformed_tool_call_stays_in_content_as_written(qwen3: Tokenizer) -> None:
    text = 'Calling.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>'
    prompt = qwen3.render_chat(QUESTION, tools=[WEATHER_TOOL])
    ids = qwen3.encode(text, parse_special=True)
    detok = IncrementalDetokenizer(qwen3, SamplingParams())
    pieces = [detok.step(i)[0] for i in ids] + [detok.flush()]
    total = merged(stream(OutputParser(reasoning=True, tools=True, prefill=opened_thought(prompt)), pieces))
    assert total.tool_calls == []
    assert total.content == text


def test_without_reasoning_or_tools_text_passes_through_untouched() -> None:
    """SmolLM2 has no <think> tokens and a request without tools: tags are just text."""
    text = "  <think>not a thought</think>\n<tool_call>{\"name\": \"x\"}</tool_call>  \n"
    parser = OutputParser(reasoning=False, tools=False)
    assert merged(stream(parser, list(text))) == ParsedText(content=text)


@pytest.mark.parametrize("pieces", [['{"name": "get_weather", "arguments": {"city": "Paris"}}'],
                                    list('\n{"name": "get_weather", "arguments": {"city": "Par}is"}}\n\nDone.')])
def test_a_reply_that_is_a_calls_json_alone_is_a_call(pieces: list[str]) -> None:
    """Qwen2.5-Coder-0.5B answers a tool question with the call's JSON and no tags, as llama.cpp accepts."""
    total = merged(stream(OutputParser(reasoning=False, tools=True), pieces))
    [(name, arguments)] = tool_calls_of(total)
    assert name == "get_weather" and arguments["city"] in ("Paris", "Par}is")
    assert total.content == ("Done." if len(pieces) > 1 else "")


@pytest.mark.parametrize("text", ['{"name": "Bob", "age": 3}', '{"name": "f", "arguments": {"a": 1}', 'Use {"name": '
                                  '"f", "arguments": {}} here', '{"answer": 42}'])
def test_json_that_is_no_whole_untagged_call_stays_content(text: str) -> None:
    """Only a reply that opens with exactly {"name": ..., "arguments": {...}} is a call; other JSON is text (a call
    cut short, whose start went out, dropped)."""
    dropped = [0] if text.startswith('{"name": "f", "arguments": {') else []
    for pieces in ([text], list(text)):
        assert merged(stream(OutputParser(reasoning=False, tools=True), pieces)) == ParsedText(content=text,
                                                                                               dropped=dropped)
    assert OutputParser(reasoning=False, tools=False).parse('{"name": "f", "arguments": {}}').tool_calls == []


def test_continued_assistant_message_finishes_a_prefilled_call() -> None:
    """continue_final_message: the client wrote the start of the call, the model writes the rest."""
    prefill = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    parser = OutputParser(reasoning=False, tools=True, prefill=prefill)
    total = merged(stream(parser, ['is', '"}}', '\n</tool_call>']))
    assert tool_calls_of(total) == [("get_weather", {"city": "Paris"})]
    assert total.content == ""


def test_continued_malformed_call_returns_only_the_models_text() -> None:
    prefill = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    parser = OutputParser(reasoning=False, tools=True, prefill=prefill)
    total = merged(stream(parser, ['is", oops', '</tool_call> ok']))
    assert total.tool_calls == []
    assert total.content == 'is", oops</tool_call> ok'


def test_tool_round_trip_renders_the_call_and_the_result_into_the_next_prompt(qwen3: Tokenizer) -> None:
    """An OpenAI client sends the model's call back (arguments as a JSON string) plus the tool's answer."""
    answer = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    prompt, pieces = model_reply(qwen3, QUESTION, answer, tools=[WEATHER_TOOL])
    call = OutputParser(reasoning=True, tools=True, prefill=opened_thought(prompt)).parse("".join(pieces)).tool_calls[0]
    request = ChatCompletionRequest.model_validate({"tools": [WEATHER_TOOL], "messages": QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'}]}).chat()
    document = qwen3.render_chat(request.template_messages(), **request.template_args())
    assert ('<|im_start|>assistant\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call><|im_end|>\n') in document
    assert document.endswith('<|im_start|>user\n<tool_response>\n{"temperature": 18}\n</tool_response><|im_end|>\n'
                             '<|im_start|>assistant\n')


def test_a_forced_call_streams_as_openai_does_id_and_name_first_then_its_arguments() -> None:
    pieces = ['<tool_call>\n{"na', 'me": "get_', 'weather", "argu', 'ments": {"ci', 'ty": "Pa', 'ris"}',
              '}\n</tool_call>']
    parser = OutputParser(reasoning=False, tools=True, forced=True)
    deltas = stream(parser, pieces)
    calls = [call for delta in deltas for call in delta.tool_calls]
    # the name is out once the arguments begin; then each piece of the arguments as it comes
    assert (calls[0].index, calls[0].name, calls[0].arguments) == (0, "get_weather", '{"ci')
    assert calls[0].id.startswith("call_") and all(c.id is None and c.name is None for c in calls[1:])
    assert [c.arguments for c in calls[1:]] == ['ty": "Pa', 'ris"}']
    whole = OutputParser(reasoning=False, tools=True, forced=True).parse("".join(pieces)).tool_calls
    assert [(c.name, c.arguments) for c in whole] == [("get_weather", '{"city": "Paris"}')]
    assert tool_calls_of(merged(deltas)) == [("get_weather", {"city": "Paris"})] and merged(deltas).content == ""


def test_a_forced_call_cut_short_is_dropped_and_becomes_the_models_text() -> None:
    """max_tokens ran out inside the arguments: the client had the call's start, which the reply drops; the call's
    text is content, and the parser says the call was left open."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    parser = OutputParser(reasoning=False, tools=True, forced=True)
    deltas = stream(parser, list(text))
    assert "".join(call.arguments for delta in deltas for call in delta.tool_calls) == '{"city": "Pa'
    assert deltas[-1].dropped == [0] and parser.failure == "open"
    assert merged(deltas) == ParsedText(content=text, dropped=[0])


def test_a_forced_calls_closing_tag_inside_a_string_is_part_of_its_arguments() -> None:
    """SmolLM2 forced to call, on "What is 17 times 23?": it writes the tag inside the string it never closes,
    then text up to max_tokens. The grammar held the whole reply inside the arguments, and so does the parser:
    the call never closed."""
    text = '<tool_call>\n{"name": "calculator", "arguments": {"expression":  "17 * 23}}</tool_call>  # 17 * 23 = 3'
    for read in (lambda p: p.parse(text), lambda p: merged(stream(p, list(text)))):
        parser = OutputParser(reasoning=False, tools=True, forced=True)
        assert read(parser) == ParsedText(content=text, dropped=[0]) and parser.failure == "open"
    closed = text.replace("}}</tool_call>  # 17 * 23 = 3", '"}}\n</tool_call>')
    [call] = OutputParser(reasoning=False, tools=True, forced=True).parse(closed).tool_calls
    assert json.loads(call.arguments) == {"expression": "17 * 23"}


def test_parallel_tool_calls_false_keeps_only_the_first_call() -> None:
    text = ''.join(f'<tool_call>\n{{"name": "f", "arguments": {{"n": {n}}}}}\n</tool_call>\n' for n in range(3))
    parsed = OutputParser(reasoning=False, tools=True, max_calls=1).parse(text)
    assert tool_calls_of(parsed) == [("f", {"n": 0})] and parsed.content == ""
