"""Gemma 3 270M (base) as people download it, a Q4_K_M GGUF: float32 gives transformers' greedy tokens, its
perplexity is llama-perplexity's, and its SentencePiece tokenizer streams whole characters only."""
import json
import subprocess
import sys

import pytest
import torch

from zhuzi import LLM, SamplingParams
from zhuzi.bench.datasets import read_sharegpt, sharegpt_messages
from zhuzi.bench.llamacpp import LlamaCppError, find_tool
from zhuzi.detokenizer import IncrementalDetokenizer
from zhuzi.tokenizer import Tokenizer

pytestmark = pytest.mark.models

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def llm32(gemma3):
    return LLM(str(gemma3), dtype="float32", kv_cache_memory="256MiB")


def test_float32_greedy_tokens_are_transformers(gemma3, llm32):
    """transformers' GGUF loader dequantizes the same blocks and takes the converter's 1 back off the norms."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(gemma3.parent, gguf_file=gemma3.name, dtype=torch.float32)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for prompt, out in zip(PROMPTS, llm32.generate(PROMPTS, params)):
        assert out.prompt_token_ids[0] == 2  # Gemma's <bos>, which the model needs
        ids = torch.tensor([out.prompt_token_ids])
        with torch.inference_mode():
            expected = hf.generate(ids, max_new_tokens=24, do_sample=False, min_new_tokens=24)[0, ids.shape[1]:]
        assert out.outputs[0].token_ids == expected.tolist(), prompt


def test_the_default_runs_the_files_blocks_and_answers(gemma3):
    llm = LLM(str(gemma3), kv_cache_memory="64MiB")
    assert llm.engine.runner.model.fused is not None  # its local and global layers run fused
    prompt = "The capital of France is Paris. The capital of Germany is"
    text = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].text
    assert "Berlin" in text


def test_perplexity_is_llama_perplexitys_within_one_percent(gemma3, tmp_path):
    """`zhuzi bench accuracy --perplexity` on ShareGPT answers (4 windows of 512 tokens), as served (bf16 over
    the file's blocks), beside llama-perplexity on the same file and text."""
    try:
        find_tool("llama-perplexity")
    except LlamaCppError as e:
        pytest.skip(str(e))
    answers = [m["content"] for r in read_sharegpt(200) for m in sharegpt_messages(r) if m["role"] == "assistant"]
    text = tmp_path / "answers.txt"
    text.write_text("\n\n".join(answers)[:12_000])
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "zhuzi.cli", "bench", "accuracy", "--model", str(gemma3),
                           "--perplexity", str(text), "--window", "512", "--compare", "llama.cpp",
                           "--json-out", str(report)], capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(report.read_text())
    ours, theirs = result["results"]["default"], result["llama_cpp"]
    assert result["windows"] >= 4 and abs(ours / theirs - 1) < 0.01, (ours, theirs)


def test_streaming_shows_whole_characters_of_byte_fallback_tokens(gemma3):
    """Characters outside the vocabulary are byte-fallback tokens (<0xF0> <0x93> <0x80> <0x80>): the stream
    shows nothing for the first three, then the character; spaces are the tokens' ▁."""
    tokenizer = Tokenizer.load(gemma3)
    text = "𓀀 hieroglyphs, 我家的橘猫 a𠀀b — naïve  café\n\tcode()"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert "<0xF0>" in tokenizer.token_strs(ids) and "▁hier" in tokenizer.token_strs(ids)
    detok = IncrementalDetokenizer(tokenizer, SamplingParams())
    pieces = [detok.step(i)[0] for i in ids]
    assert "".join(pieces) == text == tokenizer.decode(ids)
    assert pieces[:4] == ["", "", "", "𓀀"] and not any("\ufffd" in piece for piece in pieces)


def test_chat_without_a_template_is_a_clear_refusal(llm32):
    """The base model's file carries no chat template (tokenizer.chat_template is not in its metadata)."""
    with pytest.raises(ValueError, match="no chat template: use the completions API"):
        llm32.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=4))
