"""Mixtral: Llama's attention, Mixture-of-Experts MLPs (softmax router, top-2, renormalized). Its
checkpoint names the router and experts block_sparse_moe.gate / .experts.{e}.w1|w2|w3; the decoder reads
them under Qwen-MoE's names. llama.cpp writes it as a llama file with experts."""
import re

from zhuzi.model.families.sparse import SparseFamily

EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class Mixtral(SparseFamily):
    def hf_tensor_name(self, stored: str) -> str:
        m = re.fullmatch(r"(model\.layers\.\d+)\.block_sparse_moe\.(gate|experts\.\d+\.w[123])\.weight", stored)
        if m is None:
            return stored
        part = m[2] if m[2] == "gate" else m[2][:-2] + EXPERT_NAMES[m[2][-2:]]
        return f"{m[1]}.mlp.{part}.weight"


FAMILY = Mixtral("mixtral", "MixtralForCausalLM", "llama", gguf_permuted_qk=True,
                 expert_width_key="intermediate_size", normalizes_top_k=True)
