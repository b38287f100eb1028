"""Command line: zhuzi serve | chat | generate | plan | bench."""
from __future__ import annotations

import argparse
import logging
import sys

from zhuzi.config import EngineConfig, parse_bytes, parse_dtype

ENGINE_DEFAULTS = EngineConfig()


def add_engine_arguments(p: argparse.ArgumentParser, model_flag: bool = True) -> None:
    """Options shared by every command that loads a model."""
    if model_flag:
        p.add_argument("--model", "-m", default=None, help="HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default=ENGINE_DEFAULTS.dtype, help="bfloat16 (default) or float32")
    p.add_argument("--kv-cache-memory", default=ENGINE_DEFAULTS.kv_cache_memory, help="KV pool size, e.g. 1GiB")
    p.add_argument("--max-model-len", type=int, default=None, help="context window (default: the checkpoint's)")
    p.add_argument("--max-num-seqs", type=int, default=ENGINE_DEFAULTS.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=ENGINE_DEFAULTS.max_num_batched_tokens)
    p.add_argument("--long-prefill-token-threshold", type=int, default=ENGINE_DEFAULTS.long_prefill_token_threshold,
                   help="while others decode, a prompt advances at most this many tokens a step (0: no cap)")
    p.add_argument("--quantization", choices=["int8"], default=None, help="weight-only int8, quantized at load")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=ENGINE_DEFAULTS.enable_prefix_caching)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(model=args.model, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
                        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens, quantization=args.quantization,
                        long_prefill_token_threshold=args.long_prefill_token_threshold,
                        enable_prefix_caching=args.enable_prefix_caching)


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=None)


def sampling_params(args: argparse.Namespace):
    from zhuzi.sampling_params import SamplingParams
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          max_tokens=args.max_tokens, seed=args.seed)


def cmd_generate(args: argparse.Namespace) -> None:
    from zhuzi.llm import LLM
    llm = LLM(**vars(engine_config(args)))
    out = llm.generate(args.prompt, sampling_params(args))[0]
    print(args.prompt + out.outputs[0].text)


def cmd_chat(args: argparse.Namespace) -> None:
    """An interactive chat that streams each reply and keeps the whole history."""
    from zhuzi.engine.engine import Engine
    engine = Engine(engine_config(args))
    params = sampling_params(args)
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    print("zhuzi chat — empty line or Ctrl-D to quit", file=sys.stderr)
    turn = 0
    while True:
        try:
            text = input("> ").strip()
        except EOFError:
            break
        if not text:
            break
        history.append({"role": "user", "content": text})
        engine.add_request(f"chat-{turn}", engine.tokenizer.encode_chat(history), params)
        reply = ""
        while engine.has_unfinished():
            for out in engine.step():
                piece = out.outputs[0].text if out.outputs else ""
                reply += piece
                print(piece, end="", flush=True)
        print()
        history.append({"role": "assistant", "content": reply})
        turn += 1


def cmd_plan(args: argparse.Namespace) -> None:
    """The KV arithmetic of a model, without loading its weights."""
    from zhuzi.model.loader import load_model_config
    c = load_model_config(args.model)
    dtype = parse_dtype(args.dtype)
    value_bytes = dtype.itemsize
    per_token = c.kv_bytes_per_token(value_bytes)
    budget = parse_bytes(args.kv_cache_memory)
    blocks = budget // (per_token * args.block_size)
    capacity = blocks * args.block_size
    weight_bytes = c.decode_weight_bytes(1.0 if args.quantization == "int8" else value_bytes)
    print(f"model: {c.architecture}, {c.num_layers} layers, {c.num_kv_heads} KV heads x {c.head_dim} dims, "
          f"{c.num_parameters / 1e6:.1f} M parameters, {args.dtype}")
    print(f"KV bytes per token: 2 x {c.num_layers} layers x {c.num_kv_heads} kv_heads x {c.head_dim} head_dim "
          f"x {value_bytes} bytes = {per_token:,}")
    print(f"KV pool: {budget:,} bytes = {blocks:,} blocks of {args.block_size} tokens = {capacity:,} tokens")
    print(f"requests of {args.context:,} tokens that fit at once: {capacity // args.context:,}")
    print(f"weight bytes one decode step reads: {weight_bytes:,} ({weight_bytes / 2**20:.0f} MiB)")


def build_parser() -> argparse.ArgumentParser:
    from zhuzi import bench
    from zhuzi.server import app

    parser = argparse.ArgumentParser(prog="zhuzi", description="逐字: LLM inference engine and OpenAI-compatible server")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    app.add_serve_arguments(p)
    p.set_defaults(func=app.serve)

    p = sub.add_parser("generate", help="print the continuation of a prompt")
    p.add_argument("prompt")
    add_engine_arguments(p)
    add_sampling_arguments(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive terminal chat, streamed")
    p.add_argument("--system", default=None, help="a system message to start the conversation")
    add_engine_arguments(p)
    add_sampling_arguments(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("plan", help="KV-cache arithmetic for a model")
    p.add_argument("--model", "-m", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-cache-memory", default="4GiB")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=ENGINE_DEFAULTS.block_size)
    p.add_argument("--quantization", choices=["int8"], default=None)
    p.set_defaults(func=cmd_plan)

    bench.register(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        args.func(args)
    except KeyboardInterrupt:
        pass
    except (ValueError, OSError) as e:
        sys.exit(f"zhuzi: error: {e}")


if __name__ == "__main__":
    main()
