"""Which reasoning parser reads a model's thought: its vocabulary's tags, or the named parser where it fits."""
import functools

import pytest

from zhuzi.model.loader import default_model_path
from zhuzi.server.common.reasoning import thought_tags
from zhuzi.tokenizer import HARMONY_MARKERS, THOUGHT_TAGS, Tokenizer


@functools.cache
def vocabulary(kind: str) -> Tokenizer:
    """SmolLM2's vocabulary as it is, with Qwen's <think> tags, or with harmony's markers."""
    hf = Tokenizer.load(default_model_path()).hf
    if kind == "think":
        hf.add_tokens(["<think>", "</think>"])
    elif kind == "harmony":
        hf.add_special_tokens({"additional_special_tokens": list(HARMONY_MARKERS)})
    return Tokenizer(hf)


@pytest.mark.parametrize("kind, name, tags", [
    ("plain", None, None), ("think", None, THOUGHT_TAGS[0]), ("think", "qwen3", THOUGHT_TAGS[0]),
    ("think", "deepseek_r1", THOUGHT_TAGS[0]), ("think", "none", None), ("harmony", None, None),
    ("harmony", "openai", None),
])
def test_the_vocabulary_or_the_named_parser_gives_the_tags(kind: str, name: str | None, tags) -> None:
    assert thought_tags(name, vocabulary(kind)) == tags


@pytest.mark.parametrize("kind, name, error", [
    ("think", "gemma4", "has no <|channel> and <channel|>"), ("plain", "qwen3", "has no <think> and </think>"),
    ("plain", "openai", "does not speak"), ("harmony", "qwen3", "speaks gpt-oss's harmony"),
    ("think", "granite", "no parser 'granite'"),
])
def test_a_parser_that_does_not_fit_the_vocabulary_is_an_error(kind: str, name: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        thought_tags(name, vocabulary(kind))
