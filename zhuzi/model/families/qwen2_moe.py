"""Qwen2-MoE: Qwen2's attention (QKV bias), routed experts (renormalized as the config says) plus a shared
expert behind a sigmoid gate."""
from zhuzi.model.families.sparse import SparseFamily

FAMILY = SparseFamily("qwen2_moe", "Qwen2MoeForCausalLM", "qwen2moe", qkv_bias=True, gguf_normalizes_top_k=False)
