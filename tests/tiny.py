"""Tiny random Llama / Qwen2 / Qwen3 checkpoints, saved the way Hugging Face saves them, with the
real SmolLM2 tokenizer beside them so text paths work too."""
from __future__ import annotations

from pathlib import Path

import torch
import transformers

from zhuzi.model.loader import default_model_path
from zhuzi.tokenizer import Tokenizer

CLASSES = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
           "qwen3": transformers.Qwen3ForCausalLM}
VOCAB = 1000


def build(arch: str, directory: Path, layers: int = 2, vocab_size: int = VOCAB,
          **overrides) -> transformers.PreTrainedModel:
    cls = CLASSES[arch]
    shape = dict(hidden_size=64, num_hidden_layers=layers, vocab_size=vocab_size, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128, bos_token_id=1, eos_token_id=2,
                 max_position_embeddings=4096, rope_theta=10000.0)
    config = cls.config_class(**(shape | overrides))
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():  # larger than HF's init so that tokens are not near-ties everywhere
        for p in model.parameters():
            p.normal_(0, 0.1)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(1.0)
    model.save_pretrained(directory)
    Tokenizer.load(default_model_path()).hf.save_pretrained(directory)
    return model


THINKING_TEMPLATE = (  # ChatML whose generation prompt opens a thought, as DeepSeek-R1's does
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}"
    "{%- endif %}")


def build_thinking(directory: Path) -> tuple[int, int]:
    """A tiny random Qwen3 that thinks: SmolLM2's tokenizer plus <think> and </think> as added tokens, and a
    template that opens the thought. Returns the two tags' ids."""
    build("qwen3", directory, vocab_size=49152 + 2)
    hf = Tokenizer.load(directory).hf
    hf.add_tokens(["<think>", "</think>"])
    hf.chat_template = THINKING_TEMPLATE
    hf.save_pretrained(directory)
    return tuple(hf.convert_tokens_to_ids(["<think>", "</think>"]))
