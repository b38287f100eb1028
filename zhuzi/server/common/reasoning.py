"""Which reasoning parser reads a model's thought, beside its tool format: the one its vocabulary's tags make
(<think>...</think>; Gemma 4's thought channel; harmony's analysis channel for gpt-oss), or the one
--reasoning-parser names (vLLM's names), which must be the vocabulary's own; "none" reads no thought (its text
is content). OutputParser reads thought tags, HarmonyParser the analysis channel.
"""
from __future__ import annotations

from zhuzi.server.common.tool_formats import HARMONY
from zhuzi.tokenizer import THOUGHT_TAGS, ThoughtTags, Tokenizer

NONE = "none"
THOUGHTS = {"deepseek_r1": THOUGHT_TAGS[0], "qwen3": THOUGHT_TAGS[0], "gemma4": THOUGHT_TAGS[1]}
REASONING_PARSERS = (*THOUGHTS, HARMONY, NONE)


def check_reasoning_parser(name: str | None) -> None:
    """ValueError for a --reasoning-parser that is none of the parsers (checked before the model loads)."""
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser: no parser {name!r}; choose from {', '.join(REASONING_PARSERS)}")


def thought_tags(name: str | None, tokenizer: Tokenizer) -> ThoughtTags | None:
    """The tags the reply's thought is read by (None: no thought to read, or harmony's channel); ValueError for
    a name that is none of the parsers, or whose tags the vocabulary does not hold."""
    check_reasoning_parser(name)
    if tokenizer.harmony:
        if name not in (None, HARMONY):
            raise ValueError(f"--reasoning-parser {name}: this model speaks gpt-oss's harmony format ({HARMONY!r})")
        return None
    if name == HARMONY:
        raise ValueError(f"--reasoning-parser {HARMONY}: this model does not speak gpt-oss's harmony format")
    if name == NONE:
        return None
    own = tokenizer.thought_tags
    if name is not None and own != THOUGHTS[name]:
        tags = THOUGHTS[name]
        raise ValueError(f"--reasoning-parser {name}: this model's vocabulary has no {tags.open} and {tags.close} "
                         "as its thought's tags")
    return own
