"""Which format reads a model's calls: the one its chat template writes (the lines of each family's official
template that write a call), or the one --tool-call-parser names."""
import pytest

from zhuzi.server.common.tool_formats import FORMATS, HARMONY, PARSER_NAMES, Hermes, tool_format
from zhuzi.tokenizer import TOOL_MARKERS

# Each family's template, the lines that write an assistant's call.
TEMPLATES = {
    "hermes": """{{- '<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}""",  # Qwen2.5
    "qwen3_coder": """{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}
        {{- '<parameter=' + args_name + '>\\n' }}""",  # Qwen3-Coder, Qwen3.5
    "mistral": """{{- '[TOOL_CALLS]' }}{{- name + '[ARGS]' + arguments }}""",  # Ministral 3
    "llama3_json": """{{- '<|python_tag|>' + tool_call.name + '.call(' }}""",  # Llama 3.1
    "pythonic": """{{- '<|tool_list_start|>[' }}{{- '<|tool_call_start|>' }}""",  # LFM2
    "gemma4": """{{- '<|tool_call>call:' + function['name'] + '{' -}}""",  # Gemma 4
}


@pytest.mark.parametrize("name", TEMPLATES)
def test_the_template_picks_the_format(name: str) -> None:
    assert tool_format(None, TEMPLATES[name], harmony=False).name == name


def test_a_template_without_calls_gets_hermes_which_the_generic_prompt_teaches() -> None:
    assert tool_format(None, "{{ messages[0].content }}", harmony=False) is Hermes


def test_the_named_parser_wins_over_the_template() -> None:
    assert tool_format("pythonic", TEMPLATES["hermes"], harmony=False).name == "pythonic"
    assert set(PARSER_NAMES) == {HARMONY, *TEMPLATES}


@pytest.mark.parametrize("name, harmony, error", [
    ("hermes_v2", False, "no parser 'hermes_v2'"),
    ("openai", False, "does not speak gpt-oss's harmony format"),
    ("hermes", True, "speaks gpt-oss's harmony format"),
])
def test_a_parser_that_does_not_fit_is_an_error(name: str, harmony: bool, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        tool_format(name, "", harmony)
    assert tool_format(None, "", harmony=True) is None and tool_format(HARMONY, "", harmony=True) is None


def test_every_special_marker_of_a_format_is_shown_to_the_parser() -> None:
    """The detokenizer keeps the special tokens of TOOL_MARKERS in the text: each format's must be among them."""
    for fmt in FORMATS:
        assert set(fmt.markers) <= TOOL_MARKERS, fmt.name
    assert set().union(*(f.markers for f in FORMATS)) == TOOL_MARKERS
