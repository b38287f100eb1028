"""The offline API on the embedded SmolLM2 GGUF, against transformers on the same file."""
import pytest
import torch

from zhuzi import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a little",
           "The three primary colors are"]


@pytest.fixture(scope="module")
def llm32():
    return LLM(dtype="float32")


def test_greedy_matches_transformers_on_the_gguf(llm32, hf_smollm2):
    outs = llm32.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, min_tokens=32))
    for prompt, out in zip(PROMPTS, outs):
        ids = llm32.tokenizer.encode(prompt)
        with torch.no_grad():
            ref = hf_smollm2.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, len(ids):].tolist(), prompt


def test_chat_answers_paris():
    llm = LLM()  # the default: bf16
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=30))[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # ended on <|im_end|>, not on the length limit


def test_generate_accepts_token_ids_and_one_params_per_prompt(llm32):
    ids = llm32.tokenizer.encode(PROMPTS[0])
    a, b = llm32.generate([ids, PROMPTS[0]], [SamplingParams(temperature=0, max_tokens=3),
                                              SamplingParams(temperature=0, max_tokens=5)])
    assert a.prompt_token_ids == b.prompt_token_ids == ids
    assert b.outputs[0].token_ids[:3] == a.outputs[0].token_ids
    assert (a.outputs[0].finish_reason, len(b.outputs[0].token_ids)) == ("length", 5)
