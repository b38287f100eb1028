"""Qwen3-MoE (Qwen3-30B-A3B): Qwen3's attention (q/k norms), routed experts (top-8 of 128, renormalized)."""
from zhuzi.model.families.sparse import SparseFamily

FAMILY = SparseFamily("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3moe", qk_norm=True)
