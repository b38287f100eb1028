"""Qwen3 (dense): Llama's layer with an RMSNorm of each head's q and k, and a head_dim of its own."""
from zhuzi.model.families.base import Family

FAMILY = Family("qwen3", "Qwen3ForCausalLM", "qwen3", qk_norm=True)
