"""Qwen2.5-Coder-0.5B's Q4_K_M file as people download it: float32 (its blocks' exact values) gives
transformers' greedy tokens; the default keeps the file's blocks mapped in place, resident in about the
file's size; and its perplexity is llama-perplexity's on the same text."""
import json
import subprocess
import sys

import pytest
import torch

from zhuzi import LLM, SamplingParams
from zhuzi.model.blocks import BlockWeight

pytestmark = pytest.mark.models

PROMPTS = ["def fibonacci(n):", "The capital of France is", "# Sort a list of numbers in Python\n"]


def test_float32_greedy_tokens_are_transformers(qwen_small):
    """transformers' GGUF loader dequantizes the same blocks (qwen2's Q/K are not permuted)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(qwen_small.parent, gguf_file=qwen_small.name, dtype=torch.float32)
    llm = LLM(str(qwen_small), dtype="float32", kv_cache_memory="256MiB")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params)):
        ids = torch.tensor([out.prompt_token_ids])
        with torch.inference_mode():
            expected = hf.generate(ids, max_new_tokens=16, do_sample=False, min_new_tokens=16)[0, ids.shape[1]:]
        assert out.outputs[0].token_ids == expected.tolist(), prompt


RESIDENT = """
import json, sys
from pathlib import Path
def rss():
    status = Path("/proc/self/status").read_text().splitlines()
    return int(next(line for line in status if line.startswith("VmRSS")).split()[1]) << 10
from zhuzi import LLM, SamplingParams
from zhuzi.tokenizer import Tokenizer
Tokenizer.load(sys.argv[1])  # the tokenizer's memory is not the weights'
before = rss()
llm = LLM(sys.argv[1], kv_cache_memory="32MiB")
llm.generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=4))
print(json.dumps({"weights": rss() - before}))
"""


def test_weights_stay_the_files_blocks_resident_about_its_size(qwen_small):
    """Loading and answering adds ~the file's size to the process (its blocks, mapped), not a dequantized
    copy (bf16 would be 2.6x)."""
    done = subprocess.run([sys.executable, "-c", RESIDENT, str(qwen_small)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    resident = json.loads(done.stdout.splitlines()[-1])["weights"]
    assert resident <= 1.15 * qwen_small.stat().st_size


def test_every_matrix_runs_on_its_blocks(qwen_small):
    llm = LLM(str(qwen_small), kv_cache_memory="32MiB")
    model = llm.engine.runner.model
    layers = [model.lm_head] + [getattr(layer, p) for layer in model.layers for p in ("qkv", "o", "gate_up", "down")]
    assert all(type(layer).__name__ == "BlockLinear" for layer in layers)
    assert isinstance(model.embed, BlockWeight) and model.fused is not None
    reply = llm.chat([{"role": "user", "content": "Write a Python function that returns the square of x."}],
                     SamplingParams(temperature=0, max_tokens=48))[0].outputs[0].text
    assert "def " in reply and "return" in reply and "x" in reply
