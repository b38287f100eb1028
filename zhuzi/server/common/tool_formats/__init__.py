"""Tool-call formats, one module each: how a family writes its calls, how they read back, the grammar that forces
them. A model's format is the one its chat template writes (or the one --tool-call-parser names, vLLM's names);
gpt-oss's harmony ("openai") has a parser of its own (harmony_parser.py). A new format is one ToolFormat class,
added to FORMATS (and its special-token markers to the tokenizer's TOOL_MARKERS).
"""
from __future__ import annotations

from zhuzi.server.common.tool_formats.format import Call, ToolFormat
from zhuzi.server.common.tool_formats.gemma4 import Gemma4
from zhuzi.server.common.tool_formats.hermes import Hermes
from zhuzi.server.common.tool_formats.llama3 import Llama3Json
from zhuzi.server.common.tool_formats.mistral import Mistral
from zhuzi.server.common.tool_formats.pythonic import Pythonic
from zhuzi.server.common.tool_formats.qwen3_coder import Qwen3Coder

# In the order templates are matched: a template may hold another format's marker too (Qwen3-Coder's <tool_call>).
FORMATS: tuple[type[ToolFormat], ...] = (Qwen3Coder, Gemma4, Mistral, Pythonic, Llama3Json, Hermes)
HARMONY = "openai"  # gpt-oss's harmony format
PARSER_NAMES = (HARMONY, *(f.name for f in FORMATS))


def check_tool_parser(name: str | None) -> None:
    """ValueError for a --tool-call-parser that is none of the formats (checked before the model loads)."""
    if name is not None and name not in PARSER_NAMES:
        raise ValueError(f"--tool-call-parser: no parser {name!r}; choose from {', '.join(PARSER_NAMES)}")


def tool_format(name: str | None, template: str, harmony: bool) -> type[ToolFormat] | None:
    """The format a model's calls are read in: the one named, else the one its template writes (Hermes' when it
    writes none: zhuzi's generic tool prompt teaches it); None for a harmony model. ValueError for a name that
    is none of them, or that does not fit the model."""
    check_tool_parser(name)
    if harmony:
        if name not in (None, HARMONY):
            raise ValueError(f"--tool-call-parser {name}: this model speaks gpt-oss's harmony format ({HARMONY!r})")
        return None
    if name == HARMONY:
        raise ValueError(f"--tool-call-parser {HARMONY}: this model does not speak gpt-oss's harmony format")
    if name is not None:
        return next(f for f in FORMATS if f.name == name)
    return next((f for f in FORMATS if f.detect(template)), Hermes)


__all__ = ["FORMATS", "HARMONY", "PARSER_NAMES", "Call", "Hermes", "ToolFormat", "check_tool_parser", "tool_format"]
