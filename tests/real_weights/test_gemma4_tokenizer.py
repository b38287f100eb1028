"""Gemma 4's real tokenizer as llama.cpp's converter writes it (tokenizer model "gemma4": BPE with merges), from
the vocabulary file llama.cpp keeps for its tokenizer tests (models/ggml-vocab-gemma-4.gguf, beside the test texts
and the ids transformers' tokenizer gave them). Found in llama.cpp's source tree under $LLAMA_CPP_DIR (default
~/.cache/llama.cpp, where its build script unpacks llama-cpp-python's); skipped without it."""
import os
from pathlib import Path

import pytest

from zhuzi.model.gguf_header import read_gguf_header
from zhuzi.tokenizer import Tokenizer

pytestmark = pytest.mark.models

VOCAB = "llama_cpp_python-*/vendor/llama.cpp/models/ggml-vocab-gemma-4.gguf"
SEPARATOR = "\n__ggml_vocab_test__\n"  # between the test texts (llama.cpp's convert_hf_to_gguf_update.py)


@pytest.fixture(scope="module")
def vocab() -> Path:
    home = Path(os.environ.get("LLAMA_CPP_DIR") or Path.home() / ".cache/llama.cpp")
    found = sorted(home.glob(VOCAB), reverse=True)
    if not found:
        pytest.skip(f"no llama.cpp source tree with Gemma 4's vocabulary in {home}")
    return found[0]


@pytest.fixture(scope="module")
def tokenizer(vocab: Path) -> Tokenizer:
    return Tokenizer.load(vocab)


def test_the_texts_encode_to_transformers_ids_and_decode_back(vocab, tokenizer):
    assert read_gguf_header(vocab).metadata["tokenizer.ggml.model"] == "gemma4"
    texts = vocab.with_name(vocab.name + ".inp").read_text().split(SEPARATOR)
    expected = vocab.with_name(vocab.name + ".out").read_text().split("\n")
    assert len(texts) > 40
    for text, ids in zip(texts, expected, strict=False):
        assert tokenizer.encode(text, add_special_tokens=False) == [int(i) for i in ids.split()], text
        assert tokenizer.decode([int(i) for i in ids.split()], skip_special_tokens=False) == text


def test_a_chat_with_a_tool_call_and_thinking_encodes_as_its_template_renders_it(tokenizer):
    """The file's template renders; only its markers are control ids (<bos> and the turns'), the thought
    channel's and the tool call's markers whole tokens, as transformers' render-then-encode gives them."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "A city's weather",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": '{"temp": 21}'},
                {"role": "assistant", "content": "21 degrees."}, {"role": "user", "content": "ünïcödé 你好 🦙"}]
    for thinking in (False, True):
        kwargs = {"enable_thinking": thinking}
        ids = tokenizer.encode_chat(messages, tools=tools, chat_template_kwargs=kwargs)
        assert ids == tokenizer.hf.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False,
                                                       add_generation_prompt=True, **kwargs)
        assert tokenizer.decode(ids, skip_special_tokens=False) == \
            tokenizer.render_chat(messages, tools=tools, chat_template_kwargs=kwargs)
        assert ids[:2] == [tokenizer.hf.bos_token_id, tokenizer.special_id("<|turn>")]
        assert tokenizer.hf.convert_tokens_to_ids("<|tool_call>") in ids
    assert tokenizer.think_ids == tuple(tokenizer.hf.convert_tokens_to_ids(["<|channel>", "<channel|>"]))
    assert tokenizer.encode("Hi") == tokenizer.encode("Hi", add_special_tokens=False)  # the template writes <bos>
