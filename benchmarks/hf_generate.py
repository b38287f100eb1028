"""The peer on the same GPU: transformers' generate, batch 1, greedy, a prompt of random tokens, every new token
forced (min_new_tokens); its decode tokens/s (a generate of one token subtracted: the prefill), and the GPU's
memory bandwidth for the roofline (a device-to-device copy, bytes read and written, best of 10).

    python benchmarks/hf_generate.py MODEL_DIR [--prompt-len 128] [--max-tokens 128] [--batch 1]
"""
import argparse
import time

import torch
import transformers


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    return 2 * nbytes / min(timed(lambda: y.copy_(x)) for _ in range(10))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).cuda().eval()
    ids = torch.randint(3, 30000, (args.batch, args.prompt_len), device="cuda")

    def generate(n: int):
        return lambda: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False, pad_token_id=0)

    with torch.inference_mode():
        generate(8)()  # warm-up
        prefill = min(timed(generate(1)) for _ in range(3))
        total = min(timed(generate(args.max_tokens)) for _ in range(3))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    decode = args.batch * (args.max_tokens - 1) / (total - prefill)
    bandwidth = copy_bandwidth()
    roofline = bandwidth / weights * args.batch
    print(f"transformers {transformers.__version__} generate, {torch.cuda.get_device_name()}: batch {args.batch}, "
          f"{args.prompt_len}-token prompt: decode {decode:.1f} tokens/s, prefill {prefill * 1e3:.1f} ms")
    print(f"bandwidth: {bandwidth / 1e9:.0f} GB/s (device-to-device copy, read + written); weights {weights / 1e9:.2f} "
          f"GB: roofline {roofline:.0f} tokens/s, generate at {decode / roofline:.0%} of it")


if __name__ == "__main__":
    main()
