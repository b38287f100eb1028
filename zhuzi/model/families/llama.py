"""Llama (SmolLM2, Llama 3.x): the layer every other family is told apart from. llama.cpp's converter
orders its Q/K rows for interleaved RoPE; the model turns them as the file has them."""
from zhuzi.model.families.base import Family

FAMILY = Family("llama", "LlamaForCausalLM", "llama", gguf_permuted_qk=True)
