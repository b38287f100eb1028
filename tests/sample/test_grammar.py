"""Structured output: whatever the logits, what comes out obeys the constraint.

The first half drives the grammar matchers with seeded random logits (a bonus on JSON's
structural tokens, so documents close in tens of tokens as a real model's do) against the real
SmolLM2 tokenizer: the grammar alone decides what is legal. The second half runs the real model
through the engine: mixed batches, n > 1, preemption, chunked prefill, prefix caching, stop
strings, logprobs and max_tokens with constraints.
"""
from __future__ import annotations

import ast
import json
import re

import jsonschema
import pytest
import torch

from zhuzi import LLM, SamplingParams
from zhuzi.sample.grammar import GrammarCompiler, GrammarMatcher
from zhuzi.sample.sampler import SamplingRow, apply_grammar_masks
from zhuzi.sampling_params import InvalidRequest, StructuredOutputsParams

pytestmark = pytest.mark.usefixtures("one_thread")

EOS = 2
VOCAB = 49152
SEEDS = range(8)

SCHEMAS = {
    "nested objects, required": {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "minLength": 1, "maxLength": 20},
                    "address": {"type": "object",
                                "properties": {"city": {"type": "string", "maxLength": 20},
                                               "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                                "required": ["city", "zip"]},
                },
                "required": ["name", "address"],
            },
        },
        "required": ["person"],
    },
    "arrays and enums": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
            "mode": {"enum": ["fast", "slow", 3, None, {"x": [1]}]},
            "pair": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "boolean"}], "items": False},
        },
        "required": ["tags", "mode", "pair"],
        "additionalProperties": False,
    },
    "numbers with bounds": {
        "type": "object",
        "properties": {
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "count": {"type": "integer", "minimum": 1, "maximum": 100},
            "temp": {"type": "number", "exclusiveMinimum": -10.5, "exclusiveMaximum": 50},
            "step": {"type": "integer", "multipleOf": 5},
        },
        "required": ["score", "count", "temp", "step"],
    },
    "anyOf, const, type lists": {
        "type": "object",
        "properties": {
            "value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 5},
                                {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"]}]},
            "kind": {"const": "item"},
            "note": {"type": ["string", "null"], "maxLength": 10},
        },
        "required": ["value", "kind", "note"],
    },
    "recursive $ref": {
        "$defs": {"node": {"type": "object",
                           "properties": {"v": {"type": "integer"},
                                          "children": {"type": "array", "items": {"$ref": "#/$defs/node"},
                                                       "maxItems": 2}},
                           "required": ["v"], "additionalProperties": False}},
        "$ref": "#/$defs/node",
    },
    "string formats": {
        "type": "object",
        "properties": {"email": {"type": "string", "format": "email"},
                       "id": {"type": "string", "format": "uuid"},
                       "ip": {"type": "string", "format": "ipv4"},
                       "day": {"type": "string", "format": "date"}},
        "required": ["email", "id", "ip", "day"],
        "additionalProperties": False,
    },
    "top-level array": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 2, "maxItems": 4},
}


@pytest.fixture(scope="module")
def structural_bonus(smollm2_tokenizer) -> torch.Tensor:
    bonus = torch.zeros(VOCAB)
    for i, text in enumerate(smollm2_tokenizer.token_bytes[:VOCAB]):
        if any(c in text for c in b'"{}[],:@') or text.strip().isdigit():
            bonus[i] = 4.0
    bonus[EOS] = 4.0
    return bonus


def mask(logits: torch.Tensor, matchers: list[GrammarMatcher | None]) -> None:
    """The sampler's masking step, for rows whose grammars are matchers (None: a free row)."""
    apply_grammar_masks(logits, [SamplingRow(SamplingParams(), [], [], grammar=m) for m in matchers])


def decode(grammars: GrammarCompiler, tokenizer, bonus: torch.Tensor, params: StructuredOutputsParams,
           seed: int, max_tokens: int = 400) -> str:
    """Greedy decoding of seeded random logits under params; the grammar must end it."""
    matcher = grammars.matcher(params)
    generator = torch.Generator().manual_seed(seed)
    tokens = []
    for _ in range(max_tokens):
        logits = torch.randn(1, VOCAB, generator=generator) * 2 + bonus
        mask(logits, [matcher])
        token = int(logits.argmax())
        assert matcher.accept(token)
        if token == EOS or matcher.is_terminated:
            return smollm2_decode(tokenizer, tokens + ([] if token == EOS else [token]))
        tokens.append(token)
    raise AssertionError(f"no end within {max_tokens} tokens: {tokenizer.decode(tokens)!r}")


def smollm2_decode(tokenizer, tokens: list[int]) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=False)


def validator(schema: dict) -> jsonschema.Validator:
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


# ------------------------------------------------------------------ what the grammars let through

@pytest.mark.parametrize("name", SCHEMAS)
def test_json_schema_outputs_parse_and_validate(grammars, smollm2_tokenizer, structural_bonus, name):
    check = validator(SCHEMAS[name])
    for seed in SEEDS:
        text = decode(grammars, smollm2_tokenizer, structural_bonus, StructuredOutputsParams(json=SCHEMAS[name]), seed)
        check.validate(json.loads(text))


def test_schema_given_as_text_keeps_property_order(grammars, smollm2_tokenizer, structural_bonus):
    schema = '{"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}, ' \
             '"required": ["b", "a"], "additionalProperties": false}'
    text = decode(grammars, smollm2_tokenizer, structural_bonus, StructuredOutputsParams(json=schema), 0)
    assert list(json.loads(text)) == ["b", "a"]


def test_json_object_is_any_object(grammars, smollm2_tokenizer, structural_bonus):
    for seed in SEEDS:
        text = decode(grammars, smollm2_tokenizer, structural_bonus, StructuredOutputsParams(json_object=True), seed)
        assert isinstance(json.loads(text), dict)


def test_whitespace_is_bounded_off_or_as_the_pattern_says(grammars, smollm2_tokenizer, structural_bonus):
    """A model that loves whitespace still ends: JSON's whitespace runs are capped (strings are another matter)."""
    spaces = structural_bonus.clone()
    for i, text in enumerate(smollm2_tokenizer.token_bytes[:VOCAB]):
        if text and not text.strip():
            spaces[i] = 12.0
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}, "maxItems": 5}},
              "required": ["a"], "additionalProperties": False}
    for seed in SEEDS[:4]:
        default = decode(grammars, smollm2_tokenizer, spaces, StructuredOutputsParams(json=schema), seed)
        assert json.loads(default) and re.search(r"\s{4}", default) and not re.search(r"\s{17}", default)
        compact = decode(grammars, smollm2_tokenizer, spaces,
                         StructuredOutputsParams(json=schema, disable_any_whitespace=True), seed)
        assert json.loads(compact) and not re.search(r"\s", compact)
        spaced = decode(grammars, smollm2_tokenizer, spaces,
                        StructuredOutputsParams(json=schema, whitespace_pattern="[ ]{1,2}"), seed)
        assert json.loads(spaced) and re.search(" ", spaced) and not re.search(r"\n|\s{3}", spaced)


def test_disable_additional_properties_closes_objects(grammars, smollm2_tokenizer, structural_bonus):
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}}},
              "required": ["a"]}
    bonus = structural_bonus.clone()
    bonus[smollm2_tokenizer.encode("}")[0]] -= 8  # keep objects open as long as the grammar allows
    bonus[smollm2_tokenizer.encode("},")[0]] -= 8
    opened = set()
    for seed in SEEDS:
        closed = decode(grammars, smollm2_tokenizer, bonus,
                        StructuredOutputsParams(json=schema, disable_additional_properties=True), seed)
        assert list(json.loads(closed)) == ["a"] and set(json.loads(closed)["a"]) <= {"b"}
        opened |= set(json.loads(decode(grammars, smollm2_tokenizer, bonus, StructuredOutputsParams(json=schema),
                                        seed)))
    assert opened - {"a"}  # without the option, extra keys do appear


REGEXES = [r"\(\d{3}\) \d{3}-\d{4}", r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)", r"(yes|no)( because [a-z ]{1,20})?",
           r"\d{4}-\d{2}-\d{2}"]


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_outputs_match_with_ascii_digits(grammars, smollm2_tokenizer, structural_bonus, pattern):
    for seed in SEEDS:
        text = decode(grammars, smollm2_tokenizer, structural_bonus, StructuredOutputsParams(regex=pattern), seed)
        assert re.fullmatch(pattern, text, re.ASCII), text


def test_choice_outputs_are_one_of_the_choices(grammars, smollm2_tokenizer, structural_bonus):
    choices = ["yes", "yes, sir", "no", 'It\'s "complicated"', "逐字", "<|im_end|>"]
    seen = set()
    for seed in range(40):
        text = decode(grammars, smollm2_tokenizer, structural_bonus, StructuredOutputsParams(choice=choices), seed)
        assert text in choices
        seen.add(text)
    assert len(seen) >= 3  # the random logits do pick among them


@pytest.mark.parametrize("grammar", [
    'start: expr\nexpr: term (("+" | "-") term)*\nterm: factor (("*" | "/") factor)*\n'
    'factor: NUMBER | "(" expr ")"\nNUMBER: /[1-9][0-9]{0,3}/',
    'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= factor (("*" | "/") factor)*\n'
    'factor ::= [1-9] [0-9]? | "(" expr ")"',
], ids=["lark", "gbnf"])
def test_grammar_outputs_are_arithmetic(grammars, smollm2_tokenizer, structural_bonus, grammar):
    allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div)
    for seed in SEEDS:
        text = decode(grammars, smollm2_tokenizer, structural_bonus, StructuredOutputsParams(grammar=grammar), seed)
        tree = ast.parse(text, mode="eval")
        assert all(isinstance(node, allowed) for node in ast.walk(tree)), text


# ------------------------------------------------------------------ what they refuse

@pytest.mark.parametrize("params, field, words", [
    (dict(json={"type": "array", "uniqueItems": True}), "json", ["uniqueItems"]),
    (dict(json={"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}), "json", ["if", "then"]),
    (dict(json={"oneOf": [{"type": "integer"}, {"type": "number"}]}), "json", ["oneOf"]),
    (dict(json={"type": "string", "format": "zip-code"}), "json", ["zip-code"]),
    (dict(json={"type": "strin"}), "json", ["strin"]),
    (dict(json={"type": "integer", "minimum": 5, "maximum": 1}), "json", ["minimum"]),
    (dict(json={"$ref": "#/$defs/missing"}), "json", ["missing"]),
    (dict(json=False), "json", ["false"]),
    (dict(json='{"type": "object", "properties": '), "json", ["not valid JSON"]),
    (dict(json=[1, 2]), "json", ["object"]),
    (dict(regex="[a-z"), "regex", ["unclosed character class"]),
    (dict(regex="(?<=a)b"), "regex", ["look-around"]),
    (dict(grammar="start: foo"), "grammar", ["foo"]),
    (dict(grammar='start: "a" ("b"'), "grammar", ["')'"]),
    (dict(choice=[]), "choice", ["non-empty"]),
    (dict(choice=["a", 1]), "choice", ["strings"]),
    (dict(json_object=True, disable_any_whitespace=True, whitespace_pattern=" "), "whitespace_pattern",
     ["disable_any_whitespace"]),
])
def test_invalid_constraints_are_refused_naming_the_field(grammars, params, field, words):
    with pytest.raises(InvalidRequest) as info:
        grammars.matcher(StructuredOutputsParams(**params))
    message = str(info.value)
    assert info.value.param == f"structured_outputs.{field}"
    assert message.startswith(f"structured_outputs.{field}: ") and all(w in message for w in words), message
    assert "\n" not in message and len(message) < 400


@pytest.mark.parametrize("given", [{}, {"json": {}, "regex": "a"}])
def test_exactly_one_constraint(given):
    with pytest.raises(InvalidRequest, match="exactly one"):
        StructuredOutputsParams(**given)


# ------------------------------------------------------------------ matcher state (also for speculative decoding)

def test_cached_source_gives_independent_matchers(grammars, smollm2_tokenizer):
    first, second = (grammars.matcher(StructuredOutputsParams(regex=r"[0-9]{3}")) for _ in range(2))
    assert first.accept(smollm2_tokenizer.encode("1")[0])
    assert second.validate(smollm2_tokenizer.encode("123")) == 3  # untouched by first's token
    assert first.validate(smollm2_tokenizer.encode("123")) == 2
    twin = first.copy()
    assert twin.accept(smollm2_tokenizer.encode("2")[0]) and first.validate(smollm2_tokenizer.encode("23")) == 2


def test_rollback_restores_masks_also_after_the_end(grammars, smollm2_tokenizer):
    matcher = grammars.matcher(StructuredOutputsParams(
        json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}, disable_any_whitespace=True))

    def bits() -> torch.Tensor:
        bitmask = torch.zeros(1, matcher.mask_words, dtype=torch.int32)
        matcher.fill_mask(bitmask, 0)
        return bitmask

    ids = smollm2_tokenizer.encode('{"a":12}')
    start = bits()
    assert all(matcher.accept(t) for t in ids[:2])
    middle = bits()
    assert all(matcher.accept(t) for t in ids[2:])
    assert matcher.is_terminated
    assert matcher.accept(EOS)  # the stop token after the end, which llguidance does not count
    matcher.rollback(len(ids) - 2 + 1)
    assert not matcher.is_terminated and torch.equal(bits(), middle)
    matcher.rollback(2)
    assert torch.equal(bits(), start)


def test_validate_commits_nothing_and_forbidden_tokens_change_nothing(grammars, smollm2_tokenizer):
    matcher = grammars.matcher(StructuredOutputsParams(choice=["alpha", "beta"]))
    alpha = smollm2_tokenizer.encode("alpha")
    assert matcher.validate(alpha + [EOS]) == len(alpha) + 1
    assert matcher.validate(smollm2_tokenizer.encode("gamma")) == 0
    assert not matcher.accept(smollm2_tokenizer.encode("gamma")[0])
    assert all(matcher.accept(t) for t in smollm2_tokenizer.encode("beta"))
    assert matcher.is_terminated


def test_model_vocab_wider_than_the_tokenizer_never_allows_the_extra_ids(smollm2_tokenizer):
    padded = GrammarCompiler(smollm2_tokenizer.hf, VOCAB + 100, [EOS])  # as Qwen pads its embedding
    logits = torch.zeros(2, VOCAB + 100)
    mask(logits, [padded.matcher(StructuredOutputsParams(json_object=True)), None])
    assert torch.isinf(logits[0, VOCAB:]).all() and (logits[1] == 0).all()


# ------------------------------------------------------------------ the engine, with the real model

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"enum": ["Paris", "London", "Tokyo"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


def constrained(**options) -> SamplingParams:
    options = {"temperature": 0, "max_tokens": 60, "logprobs": 1, **options}
    return SamplingParams(structured_outputs=StructuredOutputsParams(json=PERSON), **options)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", quantization="gguf", enable_prefix_caching=False)


@pytest.fixture(scope="module")
def chats(llm) -> list[list[int]]:
    topics = ["a teacher", "a pilot", "a painter", "an old sailor"]
    return [llm.tokenizer.encode_chat([{"role": "user", "content": f"Describe {t} as JSON."}]) for t in topics]


@pytest.fixture(scope="module")
def alone(llm, chats):
    return [llm.generate([c], constrained())[0] for c in chats]


def test_constrained_outputs_of_the_real_model_validate(alone):
    check = validator(PERSON)
    for out in alone:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop" and completion.stop_reason is None
        check.validate(json.loads(completion.text))


def test_mixed_batch_constrains_only_its_constrained_rows(llm, chats, alone):
    free = SamplingParams(temperature=0, max_tokens=24, logprobs=1)
    mixed = llm.generate(chats, [constrained() if i % 2 else free for i in range(len(chats))])
    for i, out in enumerate(mixed):
        expected = alone[i] if i % 2 else llm.generate([chats[i]], free)[0]
        assert out.outputs[0].token_ids == expected.outputs[0].token_ids
    assert not mixed[0].outputs[0].text.lstrip().startswith("{")  # the free rows are free


@pytest.mark.parametrize("options", [
    dict(kv_cache_memory=16 * 16 * 46080),  # 16 pages of 16 tokens: sequences are preempted and recomputed
    dict(max_num_batched_tokens=32, enable_prefix_caching=True),  # prompts prefilled in chunks, prefixes shared
])
def test_preemption_chunked_prefill_and_prefix_caching_keep_the_output(chats, alone, options):
    llm = LLM(dtype="float32", quantization="gguf", **options)
    outs = llm.generate(chats + chats[:2], constrained())
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone + alone[:2]]
    if "kv_cache_memory" in options:
        assert llm.engine.scheduler.num_preemptions >= 1
    else:
        assert llm.engine.pages.prefix_hits > 0
    assert llm.engine.pages.num_free_pages == llm.engine.pages.num_pages


def test_n_samples_each_follow_the_grammar_on_their_own(llm):
    out = llm.chat(ASK, constrained(n=4, temperature=1.0, seed=3, max_tokens=80))[0]
    check = validator(PERSON)
    for completion in out.outputs:
        check.validate(json.loads(completion.text))
    assert len({c.text for c in out.outputs}) >= 2  # each took its own path


def test_stop_strings_and_max_tokens_still_cut_the_output_short(llm):
    stopped = llm.chat(ASK, constrained(stop=['"age"']))[0].outputs[0]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", '"age"')
    assert stopped.text.startswith('{') and '"name"' in stopped.text and "age" not in stopped.text
    cut = llm.chat(ASK, constrained(max_tokens=5))[0].outputs[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 5
    with pytest.raises(ValueError):
        json.loads(cut.text)


def test_the_grammar_end_wins_over_min_tokens_and_ignore_eos(llm):
    params = SamplingParams(temperature=0, max_tokens=20, min_tokens=10, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    out = llm.chat([{"role": "user", "content": "Is Paris in France?"}], params)[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"


def test_logprobs_describe_the_masked_distribution(llm, smollm2_tokenizer):
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=20,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    first = llm.chat([{"role": "user", "content": "Is Paris in France?"}], params)[0].outputs[0].logprobs[0]
    starts = {i for i, text in enumerate(smollm2_tokenizer.token_bytes[:VOCAB])
              if text and (b"yes".startswith(text) or b"no".startswith(text))}
    assert set(first) <= starts and len(first) >= 2  # only what the grammar allows, and all of it that fits
    assert sum(torch.tensor([lp.logprob for lp in first.values()]).exp()) == pytest.approx(1, abs=1e-4)


def test_an_invalid_constraint_is_refused_before_anything_runs(llm):
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-z"))
    with pytest.raises(InvalidRequest) as info:
        llm.engine.add_request("bad", [1, 2, 3], bad)
    assert info.value.param == "structured_outputs.regex"
    assert not llm.engine.has_unfinished()
