"""Qwen2 (Qwen2.5, Qwen2.5-Coder): Llama's layer with a bias on Q, K and V."""
from zhuzi.model.families.base import Family

FAMILY = Family("qwen2", "Qwen2ForCausalLM", "qwen2", qkv_bias=True)
