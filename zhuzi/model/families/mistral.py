"""Mistral: Llama's layer with a sliding window on every layer (config.json's sliding_window). llama.cpp's
converter writes it as a llama without its window, and such a file loads as the llama family."""
from zhuzi.model.families.base import Family

FAMILY = Family("mistral", "MistralForCausalLM", "llama", gguf_permuted_qk=True)
