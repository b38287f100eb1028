"""Command line: zhuzi serve | chat | generate | plan | models | bench.

Engine and server flags are generated from EngineConfig and ServerConfig (config.py); this module
only adds what belongs to one command. The server is a library the CLI calls, never the reverse.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
from concurrent.futures import Future
from dataclasses import replace

from zhuzi import bench, settings
from zhuzi.config import EngineConfig, ParallelConfig, ServerConfig, parse_bytes

log = logging.getLogger("zhuzi")


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=256)


def sampling_params(args: argparse.Namespace):
    from zhuzi.sampling_params import SamplingParams
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          max_tokens=args.max_tokens)


def cmd_serve(args: argparse.Namespace) -> None:
    from zhuzi.engine.front.core_client import EngineCoreClient
    from zhuzi.engine.front.placement import init_ray
    from zhuzi.engine.worker import tp_worker
    from zhuzi.model.loader import load_model_config
    from zhuzi.server.common.reasoning import check_reasoning_parser
    from zhuzi.server.common.tool_formats import check_tool_parser

    # Tokenizing runs in the server's low-priority worker threads (see serving.py), not in a pool of its own.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    config, engine_config = serve_configs(args)
    check_tool_parser(config.tool_call_parser)  # a parser that does not exist: one line, before the port opens
    check_reasoning_parser(config.reasoning_parser)
    if config.models_dirs and args.model:
        raise ValueError("zhuzi serve takes one MODEL or --models-dir, not both")
    if not config.models_dirs:
        load_model_config(engine_config.model)  # a model zhuzi cannot run: the same
    if engine_config.scheduling_policy is None:  # many keys, many tenants: share the engine fairly
        engine_config.scheduling_policy = "fair" if config.api_keys else "fcfs"
    parallel = ParallelConfig.from_cli_args(args)
    if engine_config.tensor_parallel_size > 1 and tp_worker.torchrun_rank():
        log.info("tensor-parallel rank %s: following rank 0 at %s:%s", os.environ["RANK"],
                 os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))
        tp_worker.run_torchrun_rank(engine_config)
        return
    if parallel.data_parallel_size > 1 and tp_worker.torchrun_rank() is not None:
        raise ValueError("tensor parallelism across machines (RANK set) serves with one engine core: drop "
                         "--data-parallel-size")
    if parallel.engine_process and parallel.data_parallel_backend == "ray":
        init_ray(parallel.ray_address)  # in the main thread, before any other starts
    if config.models_dirs:
        models = _model_set(config, engine_config, parallel, args.given)
        log.info("%d models in %s, each loaded as a request names it: %s", len(models.models),
                 ", ".join(config.models_dirs), ", ".join(models.models))
        _run_server(models, config, models.close)
        return
    log.info("loading %s (%s) in the background; /health answers 503 until it is ready",
             engine_config.model or "the embedded SmolLM2-135M-Instruct", engine_config.precision)
    # Launched before this process starts a thread or runs torch: the engine-core processes are forked and
    # need not import the engine again.
    client = EngineCoreClient(engine_config, parallel, fork=True)
    client.launch()
    loading: Future[EngineCoreClient] = Future()

    def load() -> None:
        try:
            loading.set_result(client.start())
        except BaseException as exc:  # the server reports it as it would its own loader's
            loading.set_exception(exc)

    # The engine cores load while this process imports the HTTP side and starts listening (seconds on two cores).
    threading.Thread(target=load, name="zhuzi-load-engine", daemon=True).start()
    _run_server(loading.result, config, client.close)


def _model_set(config: ServerConfig, engine_config: EngineConfig, parallel: ParallelConfig, given: set[str]):
    """The models the catalog finds in --models-dir, each started as a request names it, with the flags given
    (under --models-preset, its table's beneath them)."""
    from zhuzi.catalog import Catalog
    from zhuzi.engine.front.core_client import EngineCoreClient
    from zhuzi.presets import Presets
    from zhuzi.server.models import ModelSet, ModelSpec, ServedModel, seconds

    keep_alive = seconds(config.keep_alive)
    memory = parse_bytes(config.models_memory) if config.models_memory else None
    entries = {entry.id: entry for entry in Catalog.scan(config.models_dirs).entries()}
    if not entries:
        raise ValueError(f"--models-dir: no model in {', '.join(config.models_dirs)}")
    presets = Presets.read(config.models_preset) if config.models_preset else None
    configs = {name: replace(presets.engine_config(name, engine_config, given) if presets else engine_config,
                             model=str(entry.path)) for name, entry in entries.items()}

    def start(spec: ModelSpec) -> ServedModel:
        if (problem := entries[spec.id].problem) is not None:
            raise ValueError(problem)
        engine = EngineCoreClient(configs[spec.id], parallel).start()
        try:
            return ServedModel.ready(spec.id, engine, config.tool_call_parser, config.reasoning_parser)
        except BaseException:
            engine.close()
            raise

    # Each replica holds the weights and a KV pool.
    source = {name: ModelSpec(name, entry.paths, (entry.size + configs[name].kv_cache_bytes)
                              * parallel.data_parallel_size) for name, entry in entries.items()}
    return ModelSet(source, start, None if keep_alive == "default" else keep_alive, memory)


def _run_server(engine, config: ServerConfig, close) -> None:
    """Serve until a signal (or a failure) ends the server; close() stops the engines after."""
    import uvicorn

    from zhuzi.server.app import create_app
    from zhuzi.server.lifecycle import GracefulServer

    holder: dict[str, uvicorn.Server] = {}

    def stop(reason: str) -> None:
        holder["server"].should_exit = True

    app = create_app(engine, config, on_failure=stop)
    holder["server"] = GracefulServer(uvicorn.Config(app, host=config.host, port=config.port, log_config=None,
                                                     timeout_graceful_shutdown=2))
    try:
        holder["server"].run()
    finally:
        close()
    if (failure := app.state.server.failure) is not None:
        raise SystemExit(f"zhuzi: {failure}")  # exit status 1: a supervisor restarts the server


def serve_configs(args: argparse.Namespace) -> tuple[ServerConfig, EngineConfig]:
    """The server's settings and its model's: the flags', under --models-preset the model's preset beneath them."""
    config, engine_config = ServerConfig.from_cli_args(args), EngineConfig.from_cli_args(args)
    if config.models_preset and not config.models_dirs:
        model_id, engine_config, said = with_preset(config.models_preset, engine_config, args.given,
                                                    config.served_model_name)
        log.info("%s", said)
        if args.model == model_id:  # MODEL named its table, not a file: clients name it so too
            config.served_model_name = model_id
    return config, engine_config


def cmd_generate(args: argparse.Namespace) -> None:
    from zhuzi.llm import LLM
    llm = LLM(**vars(EngineConfig.from_cli_args(args)))
    out = llm.generate(args.prompt, sampling_params(args))[0]
    print(args.prompt + out.outputs[0].text)


def cmd_chat(args: argparse.Namespace) -> None:
    """An interactive chat that streams each reply and keeps the whole history."""
    from zhuzi.engine.core.engine_core import EngineCore
    engine = EngineCore(EngineConfig.from_cli_args(args))
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
    """Weight and KV memory of a model for a context and a number of sequences, without loading its weights."""
    from zhuzi.model import kv_format, native
    from zhuzi.model.decoder import layer_format
    from zhuzi.model.kv_pool import KVShape
    from zhuzi.model.loader import gguf_weights, load_model_config
    config = EngineConfig.from_cli_args(args)
    if args.models_preset:
        _, config, said = with_preset(args.models_preset, config, args.given)
        print(said)
    c = load_model_config(config.model)
    precision, tensors = config.precision, gguf_weights(config.model)
    fmt = layer_format(config.quantization, tensors is not None, config.tensor_parallel_size > 1,
                       precision.weights)
    placement = config.placement(c)
    on_gpu, on_cpu = _weight_sides(c, fmt, precision.weights.itemsize, tensors, placement)
    gpu = config.gpu_plan(c, _gpu_memory(args.gpu_memory, placement), on_gpu)
    plan = config.kv_plan(c, gpu)
    kv_terms = " + ".join(f"2 x {len(g.layers)} layers x {g.kv_heads} kv_heads x {g.head_dim} head_dim x "
                          f"{kv_format.head_bytes(g.head_dim, precision.kv) / g.head_dim:g} bytes"  # q8_0: its scales
                          for g in KVShape.of_model(c).groups)
    q8 = " (q8_0: 8-bit values and an fp16 scale per 32)" if precision.kv == kv_format.Q8_0 else ""
    resident, step, parts = _weight_plan(c, fmt, precision.weights.itemsize, tensors)
    per_seq = plan.sequence_tokens(args.context) * plan.bytes_per_token + plan.sequence_slots * plan.state_bytes
    kv = per_seq * args.sequences
    print(f"model: {c.architecture}, {c.num_layers} layers, {c.num_kv_heads} KV heads x {c.head_dim} dims, "
          f"{c.num_parameters / 1e6:.1f} M parameters" + (f" ({c.active_parameters / 1e6:.1f} M active: top-"
                                                          f"{c.num_experts_per_tok} of {c.num_experts} experts)"
                                                          if c.num_experts else "") + f", weights {fmt or 'dense'}")
    print(f"dtype {config.dtype}: {precision}; {precision.reason}; CPU kernels {native.resolve(config.cpu_kernels)}")
    print(f"weights: {resident:,} bytes ({resident / 2**20:.0f} MiB) in memory: {parts}")
    print(f"KV bytes per token: {kv_terms}{q8} = {plan.bytes_per_token:,}")
    if plan.state_bytes:
        drafts = f", {plan.draft_slots} for speculative drafts" if plan.draft_slots else ""
        print(f"recurrent state per sequence: {c.state_layers} layers' states = {plan.state_bytes:,} bytes, "
              f"held {plan.sequence_slots} times while it runs (live, at its last page boundary{drafts})")
    print(f"{args.sequences} x {args.context:,}-token sequences: KV {kv:,} bytes ({kv / 2**20:.0f} MiB), "
          f"with the weights {resident + kv:,} bytes ({(resident + kv) / 2**20:.0f} MiB)")
    if gpu is not None:
        _print_gpu_plan(gpu, placement, on_gpu, on_cpu, plan.bytes_per_token, config)
    pool = gpu.pool_bytes(plan.bytes_per_token) if gpu else config.kv_cache_bytes
    print(f"KV pool: {pool:,} bytes = {plan.num_pages:,} pages of {plan.page_size} tokens "
          f"= {plan.capacity_tokens:,} tokens" + (f", and {plan.state_slots} state slots of {plan.state_bytes:,} "
                                                  f"bytes ({c.state_layers} recurrent layers; {plan.sequence_slots} "
                                                  "per running sequence)" if plan.state_slots else ""))
    if plan.window is not None:
        print(f"sliding window of {plan.window:,} tokens in every layer: a sequence holds at most "
              f"{plan.sequence_tokens(args.context):,} tokens of KV (older pages go back to the pool)")
    fit = plan.capacity_tokens // plan.sequence_tokens(args.context)
    print(f"requests of {args.context:,} tokens that fit at once: "
          f"{min(fit, plan.state_slots // plan.sequence_slots) if plan.state_slots else fit:,}")
    print(f"weight bytes one decode step reads: {step:,} ({step / 2**20:.0f} MiB)")


def _gpu_memory(given: str | None, placement) -> int:
    """The GPU's total bytes: --gpu-memory's, else the GPU's own (0 where no layer is on one)."""
    import torch
    if placement.accelerator.type == "cpu" or not placement.gpu_layers:
        return 0
    if given:
        return parse_bytes(given)
    if placement.accelerator.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"no {placement.accelerator} here to measure: pass its memory as --gpu-memory, e.g. 24GiB")
    return torch.cuda.get_device_properties(placement.accelerator).total_memory


def _print_gpu_plan(gpu, placement, on_gpu: int, on_cpu: int, bytes_per_token: int, config: EngineConfig) -> None:
    """Both memories: the GPU's (weights, reserve, KV of its layers) and the CPU's (the rest), and the tokens
    that fit by the seed's arithmetic."""
    gib, n = 2**30, placement.gpu_layers
    print(f"placement (--n-gpu-layers {config.n_gpu_layers}): {placement}")
    print(f"GPU: {gpu.total / gib:.2f} GiB x {gpu.utilization:g} (--gpu-memory-utilization) = {gpu.budget:,} bytes: "
          f"weights of {n} layers {on_gpu:,} ({on_gpu / gib:.2f} GiB, dense: GGUF blocks dequantized to bf16 at "
          f"load) + reserve {gpu.reserve:,} (activations, CUDA context) + KV {max(gpu.kv_bytes, 0):,}")
    print(f"tokens that fit: ({gpu.budget:,} - {gpu.weights:,} - {gpu.reserve:,}) / {gpu.kv_bytes_per_token:,} KV "
          f"bytes a token on the GPU = {gpu.tokens:,}")
    cpu_kv = gpu.tokens * (bytes_per_token - gpu.kv_bytes_per_token)
    print(f"CPU: weights {on_cpu:,} ({on_cpu / gib:.2f} GiB) + KV of its layers {cpu_kv:,} "
          f"({bytes_per_token - gpu.kv_bytes_per_token:,} bytes a token) = {on_cpu + cpu_kv:,} bytes")
    gpu.check(config.page_size, n)


def _weight_sides(c, fmt: str | None, value_bytes: int, tensors: dict[str, tuple[str, int, int]] | None,
                  placement) -> tuple[int, int]:
    """(bytes on the GPU, bytes on the CPU) of the weights where some layers are on a GPU: every tensor by the
    layer it is in (the embedding and LM head by placement.ends), dense on the GPU (a GGUF's blocks dequantized),
    on the CPU a GGUF's blocks as they are (fmt gguf) or dense."""
    gpu = placement.accelerator.type != "cpu"
    if tensors is not None:
        sides = [0, 0]
        for name, (qtype, nbytes, count) in tensors.items():
            there = gpu and placement.of_tensor(name).type != "cpu"
            dense = there or fmt != "gguf" or qtype in ("F32", "F16", "BF16")
            sides[there] += count * value_bytes if dense else nbytes
        return sides[1], sides[0]
    layers = [c.layer_parameters(i) * value_bytes for i in range(c.num_layers)]
    ends = (c.num_parameters - sum(c.layer_parameters(i) for i in range(c.num_layers))) * value_bytes
    on_gpu = sum(layers[:placement.gpu_layers]) + (ends if placement.ends.type != "cpu" else 0) if gpu else 0
    return on_gpu, sum(layers) + ends - on_gpu


def with_preset(file: str, config: EngineConfig, given: set[str],
                name: str | None = None) -> tuple[str, EngineConfig, str]:
    """(the model's id, its settings, what the file gave it) under a presets file: the table of `name`, else of
    MODEL as typed where a table has that name (its `model` key says where the checkpoint is), else of the
    checkpoint's name."""
    from zhuzi.model.loader import model_name
    from zhuzi.presets import Presets
    presets = Presets.read(file)
    model_id = name or (config.model if config.model in presets.tables else model_name(config.model_path))
    if config.model == model_id:
        given = given - {"model"}
    keys = ", ".join(f"{key} = {json.dumps(value)}" for key, value in presets.settings(model_id, given).items())
    said = f"preset [{model_id}] of {file}: {keys or 'nothing, the flags are as given'}"
    return model_id, presets.engine_config(model_id, config, given), said


def cmd_models(args: argparse.Namespace) -> None:
    """The models a server given these --models-dir values would find, as `ollama list` prints its own."""
    from zhuzi.catalog import Catalog, stores_on_disk, table
    sources = args.models_dirs or stores_on_disk()
    if not sources:
        print("zhuzi: no --models-dir given, and no Hugging Face cache or Ollama store here", file=sys.stderr)
    catalog = Catalog.scan(sources)
    print("\n".join(table(catalog.entries())))
    for skipped in catalog.skipped:
        print(f"zhuzi: skipped {skipped.path}: {skipped.reason}", file=sys.stderr)


def _weight_plan(c, fmt: str | None, value_bytes: int,
                 tensors: dict[str, tuple[str, int, int]] | None) -> tuple[int, int, str]:
    """(bytes in memory, bytes a decode step reads, what they are) of a model's weights in format fmt."""
    embed, head = c.vocab_size * c.hidden_size, c.vocab_size * c.hidden_size
    if fmt == "gguf":  # the file's blocks as they are; float tensors in the compute dtype
        by_type: dict[str, int] = {}
        sizes = {name: count * value_bytes if qtype in ("F32", "F16", "BF16") else nbytes
                 for name, (qtype, nbytes, count) in tensors.items()}
        for name, (qtype, _, _) in tensors.items():
            by_type[qtype] = by_type.get(qtype, 0) + sizes[name]
        resident = sum(by_type.values())
        embed = sizes["model.embed_tokens.weight"]
        unread = 0 if c.tie_word_embeddings else embed - embed // c.vocab_size
        experts = sum(size for name, size in sizes.items() if ".mlp.experts." in name)  # a step reads top-k
        unread += experts * (c.num_experts - c.num_experts_per_tok) // max(c.num_experts, 1)
        parts = ", ".join(f"{t} {n / 2**20:.1f} MiB" for t, n in sorted(by_type.items(), key=lambda x: -x[1]))
        return resident, resident - unread, f"the file's blocks ({parts})"
    # int8: Q8_0 blocks (34 bytes per 32), the LM head too; int4: Q4_1 blocks (20 per 32) and a Q8_0 LM head; the
    # embedding stays dense, and a tied one is stored twice (embedding and LM head)
    body_rate, head_rate = {None: (value_bytes, value_bytes), "int8": (34 / 32, 34 / 32),
                            "int4": (20 / 32, 34 / 32)}[fmt]
    body = c.num_parameters - embed - (0 if c.tie_word_embeddings else head)
    resident = int(body * body_rate + embed * value_bytes + (head * head_rate if fmt or not c.tie_word_embeddings
                                                              else 0))
    return resident, c.decode_weight_bytes(body_rate, head_rate), f"{fmt or 'dense'} ({value_bytes}-byte values)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zhuzi",
                                     description="逐字: LLM inference engine and OpenAI-compatible server")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    p.add_argument("model", nargs="?", default=None,
                   help="HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    EngineConfig.add_cli_args(p, skip=("model",), serving=True)
    ParallelConfig.add_cli_args(p)
    ServerConfig.add_cli_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("generate", help="print the continuation of a prompt")
    p.add_argument("prompt")
    EngineConfig.add_cli_args(p)
    add_sampling_arguments(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive terminal chat, streamed")
    p.add_argument("--system", default=None, help="a system message to start the conversation")
    EngineConfig.add_cli_args(p)
    add_sampling_arguments(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("plan", help="KV-cache arithmetic for a model")
    EngineConfig.add_cli_args(p)
    p.add_argument("model", nargs="?", default=argparse.SUPPRESS, metavar="MODEL",
                   help="the model, as --model takes it, or the id of a --models-preset table")
    p.add_argument("--models-preset", default=None, metavar="FILE",
                   help="a TOML file of engine settings per model, as `zhuzi serve --models-preset` reads it: "
                        "MODEL's table and [default] under the flags given here")
    p.add_argument("--context", type=int, default=4096, help="tokens per request (default: %(default)s)")
    p.add_argument("--sequences", type=int, default=1,
                   help="requests of --context tokens at once, for the memory total (default: %(default)s)")
    p.add_argument("--gpu-memory", default=None, metavar="BYTES",
                   help="with --device cuda: the GPU's total memory, e.g. 24GiB (default: the GPU's own, measured)")
    p.set_defaults(func=cmd_plan, kv_cache_memory="4GiB")

    p = sub.add_parser("models", help="list the models in --models-dir directories and whether zhuzi runs them")
    p.add_argument("--models-dir", dest="models_dirs", action="append", default=[], metavar="DIR",
                   help="a models directory, `hf` (the Hugging Face cache) or `ollama` (Ollama's store), as "
                        "`zhuzi serve --models-dir` takes it (repeatable; default: hf and ollama, those there)")
    p.set_defaults(func=cmd_models)

    bench.register(sub)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; args.given: the settings it sets itself, which win over a preset's."""
    parser, argv = build_parser(), sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    args.given = settings.given(parser, argv)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        args.func(args)
    except KeyboardInterrupt:
        pass
    except (ValueError, OSError) as e:
        sys.exit(f"zhuzi: error: {e}")


if __name__ == "__main__":
    main()
