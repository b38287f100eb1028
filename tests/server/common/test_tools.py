"""Forced and strict tool calls: the grammars of server/common/tools.py in each tool format against the real SmolLM2
tokenizer, as it is (the markers are text) and with the markers as tokens (Qwen's <tool_call>/</tool_call> added
tokens, the other families' special ones), decoded from seeded random logits and parsed by the server's own
OutputParser, streamed and whole."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from zhuzi.detokenizer import IncrementalDetokenizer
from zhuzi.model.loader import default_model_path
from zhuzi.sample.grammar import GrammarCompiler
from zhuzi.sample.sampler import SamplingRow, apply_grammar_masks
from zhuzi.sampling_params import SamplingParams, StructuredOutputsParams
from zhuzi.server.common.parsers import OutputParser, ParsedText
from zhuzi.server.common.request import NamedTool
from zhuzi.server.common.tool_formats import FORMATS, Hermes, ToolFormat
from zhuzi.server.common.tool_formats.mistral import Mistral
from zhuzi.server.common.tools import template_renders_tools, tool_grammar, with_calls_as_text, with_generic_tools
from zhuzi.tokenizer import TOOL_MARKERS, Tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

EOS = 2
FUNCTIONS = [
    {"name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}},
    {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"], "additionalProperties": False}},
    {"name": "now"},
]
SCHEMAS = {f["name"]: f.get("parameters") or {"type": "object"} for f in FUNCTIONS}
NAMED = NamedTool("get_weather")
HERMES = Hermes(FUNCTIONS)


@pytest.fixture(scope="module", params=["text markers", "added-token markers"])
def setup(request) -> tuple[Tokenizer, GrammarCompiler, torch.Tensor]:
    """A tokenizer (SmolLM2's, or SmolLM2's plus the tool-call markers as tokens), its compiler, and logits
    favouring the formats' punctuation and markers, so that random replies end in tens of tokens."""
    hf = Tokenizer.load(default_model_path()).hf
    if request.param == "added-token markers":
        hf.add_tokens(["<tool_call>", "</tool_call>"])
        hf.add_special_tokens({"additional_special_tokens": sorted(TOOL_MARKERS)})
    tokenizer = Tokenizer(hf)
    vocab = len(tokenizer)
    bonus = torch.zeros(vocab)
    for i, text in enumerate(tokenizer.token_bytes[:vocab]):
        if any(c in text for c in b'"{}[],:<>\n()=') or text.strip().isdigit():
            bonus[i] = 4.0
    bonus[EOS] = 6.0
    return tokenizer, GrammarCompiler(hf, vocab, [EOS]), bonus


def sample(setup, grammar: str, seed: int, max_tokens: int = 300) -> list[int]:
    tokenizer, compiler, bonus = setup
    matcher = compiler.matcher(StructuredOutputsParams(grammar=grammar))
    generator = torch.Generator().manual_seed(seed)
    tokens = []
    for _ in range(max_tokens):
        logits = torch.randn(1, len(bonus), generator=generator) * 2 + bonus
        apply_grammar_masks(logits, [SamplingRow(SamplingParams(), [], [], grammar=matcher)])
        token = int(logits.argmax())
        assert matcher.accept(token)
        if token == EOS:
            return tokens
        tokens.append(token)
        if matcher.is_terminated:
            return tokens
    raise AssertionError(f"no end within {max_tokens} tokens: {tokenizer.decode(tokens)!r}")


def parse_streamed_and_whole(tokenizer: Tokenizer, tokens: list[int], forced: bool,
                             fmt: ToolFormat = HERMES) -> ParsedText:
    """The reply as the server parses it token by token, checked against the whole-text parse."""
    detokenizer = IncrementalDetokenizer(tokenizer, SamplingParams())
    parser = OutputParser(reasoning=False, tools=True, forced=forced, fmt=fmt)
    streamed = ParsedText()
    for token in tokens:
        streamed.extend(parser.feed(detokenizer.step(token)[0]))
    streamed.extend(parser.feed(detokenizer.flush()))
    streamed.extend(parser.finish())
    text = "".join(detokenizer.step(t)[0] for t in tokens) if False else tokenizer.decode(
        tokens, skip_special_tokens=False)
    whole = OutputParser(reasoning=False, tools=True, forced=forced, fmt=fmt).parse(text)
    assert [(c.index, c.name, c.arguments) for c in streamed.tool_calls] == \
        [(c.index, c.name, c.arguments) for c in whole.tool_calls]
    assert streamed.content == whole.content
    return streamed


def added_tokens(tokenizer: Tokenizer) -> dict[str, int]:
    return dict(tokenizer.hf.get_added_vocab())


def calls(setup, tool_choice, parallel: bool, seed: int) -> list[tuple[str, dict]]:
    tokenizer = setup[0]
    grammar = tool_grammar(HERMES, FUNCTIONS, tool_choice, parallel, added_tokens(tokenizer))
    assert grammar is not None and grammar.forced
    parsed = parse_streamed_and_whole(tokenizer, sample(setup, grammar.grammar, seed), forced=True)
    assert parsed.content == ""
    out = [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]
    for name, arguments in out:
        jsonschema.validate(arguments, SCHEMAS[name])
    return out


def test_named_tool_choice_yields_one_valid_call_to_that_function(setup):
    for seed in range(6):
        [(name, arguments)] = calls(setup, NAMED, True, seed)
        assert name == "get_weather" and set(arguments) <= {"city", "unit"}  # strict: no other keys


def test_required_calls_listed_functions_one_or_more_as_parallel_tool_calls_allows(setup):
    counts, names = set(), set()
    for seed in range(10):
        several = calls(setup, "required", True, seed)
        counts.add(len(several))
        names |= {name for name, _ in several}
        assert len(calls(setup, "required", False, seed)) == 1
    assert max(counts) > 1 and len(names) > 1  # parallel calls do happen, to different functions


def test_strict_functions_hold_auto_calls_to_their_schema_and_leave_text_free(setup):
    tokenizer = setup[0]
    grammar = tool_grammar(HERMES, FUNCTIONS, None, True, added_tokens(tokenizer))
    assert grammar is not None and not grammar.forced
    matcher = setup[1].matcher(StructuredOutputsParams(grammar=grammar.grammar))
    good = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\nDone.'
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "wind": 3}}\n</tool_call>'
    for text, accepted in ((good, True), ("Just text, no call.", True), (bad, False)):
        ids = tokenizer.encode(text, parse_special=True) + [EOS]
        assert (matcher.validate(ids) == len(ids)) == accepted, text
    assert tool_grammar(HERMES, [{"name": "add"}], None, True, {}) is None  # nothing strict: "auto" stays free


# Every format but Hermes (above), Mistral's both ways, each with two calls as its family writes them.
TWO_CALLS = {
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                   "</tool_call>\n<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n</parameter>\n"
                   "</function>\n</tool_call>",
    "gemma4": '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|><|tool_call>call:add{a:1,b:2}<tool_call|>',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
               '{"name": "add", "arguments": {"a": 1, "b": 2}}]',
    "mistral_args": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}',
    "pythonic": '<|tool_call_start|>[get_weather(city="Paris"), add(a=1, b=2)]<|tool_call_end|>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                   '{"name": "add", "parameters": {"a": 1, "b": 2}}',
}
OTHERS = [f(FUNCTIONS) for f in FORMATS if f is not Hermes] + [Mistral(FUNCTIONS, "[ARGS]")]


def format_id(fmt: ToolFormat) -> str:
    return fmt.name + ("_args" if getattr(fmt, "named", False) else "")


@pytest.mark.parametrize("fmt", OTHERS, ids=format_id)
def test_every_format_forces_calls_that_its_parser_reads(setup, fmt: ToolFormat):
    tokenizer, compiler = setup[0], setup[1]
    for seed in range(4):
        for choice, parallel in ((NAMED, True), ("required", True), ("required", False)):
            grammar = tool_grammar(fmt, FUNCTIONS, choice, parallel, added_tokens(tokenizer))
            parsed = parse_streamed_and_whole(tokenizer, sample(setup, grammar.grammar, seed), True, fmt)
            assert parsed.content == "" and parsed.tool_calls
            for call in parsed.tool_calls:
                jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
            assert choice != NAMED or {c.name for c in parsed.tool_calls} == {"get_weather"}
            assert parallel or len(parsed.tool_calls) == 1
    two = TWO_CALLS[format_id(fmt)]
    ids = tokenizer.encode(two, parse_special=True) + [EOS]
    for parallel in (True, False):
        grammar = tool_grammar(fmt, FUNCTIONS, "required", parallel, added_tokens(tokenizer))
        matcher = compiler.matcher(StructuredOutputsParams(grammar=grammar.grammar))
        assert (matcher.validate(ids) == len(ids)) == parallel, two  # two calls as the family writes them
    assert [c.name for c in OutputParser(False, True, fmt=fmt).parse(two).tool_calls] == ["get_weather", "add"]


def test_auto_with_a_json_answer_gives_calls_or_the_answer(setup):
    tokenizer = setup[0]
    answer = StructuredOutputsParams(json={"type": "object", "properties": {"x": {"type": "integer"}},
                                           "required": ["x"], "additionalProperties": False})
    grammar = tool_grammar(HERMES, FUNCTIONS, None, True, added_tokens(tokenizer), answer)
    seen = set()
    for seed in range(12):
        tokens = sample(setup, grammar.grammar, seed)
        parsed = parse_streamed_and_whole(tokenizer, tokens, forced=False)
        if parsed.tool_calls:
            assert parsed.content == ""
            seen.add("calls")
        else:
            assert set(json.loads(parsed.content)) == {"x"}
            seen.add("answer")
    assert seen == {"calls", "answer"}


def test_templates_without_tools_get_the_generic_format_in_the_conversation(setup):
    tokenizer = setup[0]
    assert not template_renders_tools(tokenizer.template_variables)  # SmolLM2's template ignores tools
    tools = [{"type": "function", "function": FUNCTIONS[1]}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12 + 30?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 12, "b": 30}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    document = tokenizer.render_chat(with_generic_tools(with_calls_as_text(messages), tools))
    assert document.startswith("<|im_start|>system\nBe brief.\n\nYou can call functions.")
    assert json.dumps(tools[0], ensure_ascii=False) in document
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 30}}\n</tool_call>' \
           '<|im_end|>' in document
    assert "<|im_start|>tool\n42<|im_end|>" in document
    # A later request that offers no tools still shows the model the call its result answers.
    plain = tokenizer.render_chat(with_calls_as_text(messages))
    assert "You can call functions." not in plain
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 30}}\n</tool_call>' \
           '<|im_end|>' in plain
