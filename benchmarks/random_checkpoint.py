"""A Hugging Face checkpoint of Qwen2.5-Coder-1.5B's shape with random bf16 weights, and SmolLM2's tokenizer beside
it: what a GPU machine that can fetch nothing benchmarks in place of the real model. A decode step reads the same
bytes as the real model's (its GGUF runs dequantized to bf16 on a GPU); the tokens it writes mean nothing.

    python benchmarks/random_checkpoint.py OUT_DIR TOKENIZER_DIR
"""
import shutil
import sys
from pathlib import Path

import torch
import transformers

# Qwen2.5-Coder-1.5B's config.json, the shapes that set the bytes a step reads
SHAPE = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
             num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
             rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


def main() -> None:
    out, tokenizer = Path(sys.argv[1]), Path(sys.argv[2])
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SHAPE)).to(torch.bfloat16)
    model.save_pretrained(out)
    for file in tokenizer.iterdir():
        shutil.copy(file, out / file.name)
    print(f"{out}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters, bf16")


if __name__ == "__main__":
    main()
