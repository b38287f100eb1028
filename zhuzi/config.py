"""Configuration: the KV pool's arithmetic over the model's shape (model/model_config.py), and every
engine and server setting. Command-line flags are generated from the settings' fields, so a new
setting is one edit here."""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zhuzi.model import kv_format, native
from zhuzi.model.families import family
from zhuzi.model.kv_pool import KVShape
from zhuzi.model.model_config import ModelConfig
from zhuzi.model.placement import Placement
from zhuzi.settings import Settings, setting


@dataclass(frozen=True)
class KVPlan:
    """The KV pool: K and V of every layer that writes them (kv_pool.py), per token, in pages of page_size tokens;
    and for a hybrid model the state pool beside it, in slots of state_bytes: a running sequence holds two (its
    live state and its state at the last page boundary it crossed) and with speculative decoding draft_slots more
    (its state after each draft), the prefix cache keeps some of the boundary states."""

    bytes_per_token: int
    page_size: int
    num_pages: int
    window: int | None = None  # every layer's sliding window: a sequence holds the pages it reaches
    state_bytes: int = 0  # a hybrid model's recurrent state of one sequence
    state_slots: int = 0
    draft_slots: int = 0  # of a running sequence's slots, those for speculative drafts

    SLOTS_PER_SEQUENCE = 3  # live, boundary, and one cached boundary state per sequence the engine runs

    @classmethod
    def of(cls, model: ModelConfig, dtype: torch.dtype, budget_bytes: int, page_size: int,
           max_num_seqs: int = 1, draft_slots: int = 0) -> KVPlan:
        """States take what max_num_seqs sequences would hold, at most half of the budget; pages the rest."""
        per_token = KVShape.of_model(model).bytes_per_token(dtype)
        slots = min((cls.SLOTS_PER_SEQUENCE + draft_slots) * max_num_seqs, budget_bytes // 2 // model.state_bytes) \
            if model.state_bytes else 0
        pages = (budget_bytes - slots * model.state_bytes) // (per_token * page_size)
        return cls(per_token, page_size, pages, model.kv_window, model.state_bytes, slots,
                   draft_slots if model.state_bytes else 0)

    @property
    def sequence_slots(self) -> int:
        """The state slots a running sequence holds (at most)."""
        return 2 + self.draft_slots

    def sequence_tokens(self, context: int) -> int:
        """The KV slots a sequence of `context` tokens holds while it decodes: all its pages, or with a sliding
        window the pages its next token's window reaches (window - 1 tokens back) and the page it writes."""
        pages = -(-context // self.page_size)
        if self.window is not None:
            pages = min(pages, -(-(self.window - 1) // self.page_size) + 1)
        return pages * self.page_size

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size


GPU_RESERVE = 2**29  # the seed's 0.5 GB beside weights and KV: activations, the CUDA context, the allocator's slack


@dataclass(frozen=True)
class GPUPlan:
    """A GPU's memory under --gpu-memory-utilization (vLLM's meaning: the fraction of the GPU's total memory the
    engine may use): the weights of the layers on it, a reserve (GPU_RESERVE), and the rest for the KV of those
    layers. The tokens that fit are that rest over the bytes a token's KV takes on the GPU: the seed's safe-tokens
    arithmetic, (free - 0.5 GB) / (2 x layers x kv_heads x head_dim x bytes), with free = total x utilization -
    weights and the pool's own bytes per token."""

    total: int
    utilization: float
    weights: int
    kv_bytes_per_token: int  # of the layers on the GPU
    reserve: int = GPU_RESERVE

    @property
    def budget(self) -> int:
        return int(self.total * self.utilization)

    @property
    def kv_bytes(self) -> int:
        return self.budget - self.weights - self.reserve

    @property
    def tokens(self) -> int:
        return max(self.kv_bytes, 0) // self.kv_bytes_per_token

    def pool_bytes(self, bytes_per_token: int) -> int:
        """The whole pool's bytes (both sides of a split: a page is the same slots of every layer) for the
        tokens the GPU holds."""
        return self.tokens * bytes_per_token

    def check(self, page_size: int, layers: int) -> None:
        """ValueError, in one line, where the GPU's share holds no KV page."""
        if self.tokens < page_size:
            raise ValueError(
                f"the GPU's share ({self.utilization:g} of {self.total / 2**30:.1f} GiB) holds the weights of {layers} "
                f"layers ({self.weights / 2**30:.2f} GiB) and a {self.reserve / 2**30:g} GiB reserve but no KV page: "
                "lower --n-gpu-layers or raise --gpu-memory-utilization")


def parse_bytes(text: str | int) -> int:
    """'1GiB' / '512MiB' / '2GB' / '1000000' -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?)B?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot read a memory size from {text!r} (try '1GiB' or '512MiB')")
    number, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    base = 1024 if binary or not unit else 1000
    return int(number * base ** " KMGT".index(unit or " "))


DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
          "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


@dataclass(frozen=True)
class Precision:
    """The dtypes a model runs in: weights as stored (dense ones; quantized formats keep theirs), activations
    (and every matmul that falls to torch), KV cache (kv_format.Q8_0 for q8_0); and why `auto` chose them."""

    weights: torch.dtype
    compute: torch.dtype
    kv: torch.dtype
    reason: str

    @classmethod
    def of(cls, dtype: str, cpu_kernels: str, device: str = "cpu", kv_cache_dtype: str = "auto") -> Precision:
        p = cls._of(dtype, cpu_kernels, device)
        if kv_cache_dtype == "auto":
            return p
        return dataclasses.replace(p, kv=kv_format.NAMES[kv_cache_dtype],
                                   reason=f"{p.reason}; --kv-cache-dtype {kv_cache_dtype}")

    @classmethod
    def _of(cls, dtype: str, cpu_kernels: str, device: str) -> Precision:
        if dtype != "auto":
            d = parse_dtype(dtype)
            return cls(d, d, d, f"--dtype {dtype}")
        if torch.device(device).type != "cpu":
            return cls(torch.bfloat16, torch.bfloat16, torch.bfloat16, f"{device} computes bf16")
        variant = native.resolve(cpu_kernels)
        if native.native_bf16(variant):
            who = "the CPU" if variant == "torch" else f"the {variant} kernels"
            why = f"{who} compute bf16 natively"
            return cls(torch.bfloat16, torch.bfloat16, torch.bfloat16, why)
        # Weights and the KV cache stay bf16 (half the bytes to read), widened in registers by the kernels.
        why = f"no native bf16 in the {variant} kernels: float32 math, bf16 weights and KV cache widened in registers"
        return cls(torch.bfloat16, torch.float32, torch.bfloat16, why)

    def __str__(self) -> str:
        if self.weights == self.compute == self.kv:
            return _name(self.compute)
        if self.weights == self.kv:
            return f"{_name(self.compute)} (weights and KV {_name(self.weights)})"
        return f"{_name(self.compute)} (weights {_name(self.weights)}, KV {kv_format.name(self.kv)})"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, with vLLM's keys and meanings (--speculative-config '{"method": "ngram", ...}').

    ngram: prompt lookup, the tokens that followed the latest earlier occurrence of the longest suffix of
    prompt + output of prompt_lookup_min..prompt_lookup_max tokens (both default to the other, or to 5).
    draft_model: a small model sharing the target's tokenizer proposes, with a KV cache of its own.
    mtp: the checkpoint's multi-token-prediction layer (Qwen3.5 / 3.6) proposes from the target's hidden states.
    max_step_tokens (zhuzi's): drafts join a step only while it computes at most this many tokens; on
    CPU a step of up to 8 rows costs about one row's (the weights are read once), beyond it costs more.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    max_step_tokens: int = 8

    METHODS = ("ngram", "draft_model", "mtp")

    @classmethod
    def parse(cls, value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From the flag's JSON text or the offline API's dict; ValueError says what is wrong, in one line."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        keys = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(value) - keys):
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(keys)}")
        value = dict(value)
        value.setdefault("method", "draft_model" if value.get("model") else None)
        if value["method"] not in cls.METHODS:
            raise ValueError(f"speculative_config: method must be one of {list(cls.METHODS)}, got {value['method']!r}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config: num_speculative_tokens is required")
        if value["method"] == "ngram":  # vLLM: a missing bound takes the other's value, both missing are 5
            low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
            low, high = (5, 5) if low is None and high is None else (high if low is None else low,
                                                                     low if high is None else high)
            value["prompt_lookup_min"], value["prompt_lookup_max"] = low, high
        return cls(**value)

    def __post_init__(self) -> None:
        def count(name: str, low: int = 1, high: int = 64) -> None:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= high:
                raise ValueError(f"speculative_config: {name} must be an integer in [{low}, {high}], got {v!r}")

        count("num_speculative_tokens")
        count("max_step_tokens", 2, 2**20)
        if self.method == "ngram":
            count("prompt_lookup_min")
            count("prompt_lookup_max")
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise ValueError(f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) exceeds "
                                 f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.method in ("ngram", "mtp"):
            if self.model is not None:
                raise ValueError(f"speculative_config: {self.method} takes no model")
        elif not isinstance(self.model, str) or not self.model:
            raise ValueError("speculative_config: draft_model needs a model (an HF directory or a .gguf file)")


@dataclass
class EngineConfig(Settings):
    """Every tunable of the engine in one place; LLM() and the command line fill it."""

    model: str | None = setting(None, "HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct)",
                                flags=["--model", "-m"])
    dtype: str = setting(
        "auto", "auto: bfloat16 where the CPU computes it natively (AVX512-BF16, AMX), else float32 activations "
                "over bfloat16 weights and KV cache; bfloat16 or float32: everything (float32 is the reference)",
        choices=["auto", *DTYPES])
    cpu_kernels: str = setting(
        native.default_choice(), "CPU kernel variant: auto (the best this CPU runs), avx512, avx2-vnni, avx2, "
                                 "neon-i8mm, neon, generic (portable, any CPU), or torch (none); $ZHUZI_CPU_KERNELS "
                                 "sets the default",
        choices=list(native.CHOICES))
    device: str = setting("cpu", "torch device to run the model on: cpu, or an accelerator such as cuda")
    # llama.cpp's name; its -1 (all) is also what vLLM does on a GPU
    n_gpu_layers: int = setting(
        -1, "decoder layers on --device, the first ones: the rest, with the embedding and LM head, stay on the CPU "
            "and its kernels, and a step's hidden state crosses once each way (-1: every layer)")
    gpu_memory_utilization: float = setting(
        0.9, "on a GPU, the fraction of its total memory the engine may use (vLLM's meaning): the weights of its "
             "layers, a 0.5 GiB reserve, and the KV pool the rest (--kv-cache-memory sizes the pool on the CPU)")
    kv_cache_dtype: str = setting(
        "auto", "KV cache format: auto (--dtype's: bf16 under auto), bf16, fp32, or q8_0 (8-bit values, an fp16 "
                "scale per 32: about half of bf16's bytes to read and hold, as llama.cpp's --cache-type-k/-v q8_0)",
        choices=["auto", *kv_format.NAMES])
    kv_cache_memory: str | int = setting("1GiB", "memory for the KV pool, e.g. 1GiB or 512MiB")
    # the flag keeps vLLM's spelling, --block-size, for the same setting
    page_size: int = setting(16, "tokens per KV page", flags=["--block-size"])
    max_model_len: int | None = setting(None, "context window in tokens (default: the checkpoint's)")
    max_num_seqs: int = setting(64, "sequences running at once")
    max_num_batched_tokens: int = setting(512, "tokens one step computes, over all sequences")
    # vLLM's name; off offline, where only throughput counts; a server has streams to protect.
    long_prefill_token_threshold: int = setting(
        0, "while others decode, a prompt advances at most this many tokens a step, so a long prompt "
           "cannot stall the running streams (0: no cap; offline 0, `zhuzi serve` 128)", serve=128)
    enable_prefix_caching: bool = setting(True, "reuse the KV pages of prompt prefixes seen before")
    scheduling_policy: str | None = setting(
        None, "who is served first: fcfs (arrival order), priority (lower `priority` first; a waiting request "
              "preempts running ones of lower priority), fair (each API key an equal share of every step's "
              "tokens, or --tenant-weight's) (default: fair once API keys are configured, else fcfs)",
        choices=["fcfs", "priority", "fair"])
    quantization: str | None = setting(
        None, "weight format: gguf (a .gguf file's own blocks, read in place; the default for a .gguf, but "
              "in float32, the reference, which runs its exact values dense), none (dense in --dtype; the "
              "default for a Hugging Face directory), or quantized at load from the dense values into GGUF "
              "blocks: int8 (Q8_0) or int4 (Q4_1, Q8_0 LM head)",
        choices=["gguf", "none", "int8", "int4"])
    fused_decode: bool = setting(
        True, "run a step of at most 8 decodes as one native call (CPU, bfloat16); off: the per-layer path, "
              "whose bf16 rounding differs (see zhuzi/model/fused.py)")
    pooling: str | None = setting(
        None, "how /v1/embeddings pools the last hidden state: mean (over the input's tokens) or last (its last "
              "token, as Qwen3-Embedding wants) (default: the checkpoint's own, from its GGUF pooling_type or "
              "sentence-transformers config, else mean)", choices=["mean", "last"])
    seed: int = setting(0, "seed of the random stream that unseeded requests sample from")
    tensor_parallel_size: int = setting(
        1, "split every layer across this many processes (torch.distributed: gloo on CPU, NCCL on CUDA); "
           "across machines, start one per rank with MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK set, "
           "as torchrun does")
    num_threads: int | None = setting(None, "torch threads of each engine process (default: the cores shared "
                                            "among data-parallel replicas and tensor-parallel ranks)")
    speculative_config: str | dict | None = setting(
        None, 'speculative decoding, as vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 5, '
              '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' or \'{"method": "draft_model", "model": PATH, '
              '"num_speculative_tokens": 3}\'')
    deterministic: bool = setting(
        False, "batch invariance: a request's tokens at temperature 0 (or with a seed) do not depend on the "
               "batch, chunking or prefix cache around it (every linear in one fixed order per row; CPU)")
    kv_offload_memory: str | int = setting(
        "0", "host memory for KV pages the pool evicts, e.g. 4GiB: a prompt whose prefix is there loads it "
             "instead of computing it (0: no host tier)")
    kv_offload_dir: str | None = setting(
        None, "folder of a disk tier for KV pages: each computed page is also written there (in the "
              "background), so prefixes outlive a restart; corrupt or foreign files are skipped")
    kv_offload_disk: str | int = setting("20GiB", "the disk tier's bound (least recently used pages go first)")
    kv_pinned_memory: str | int = setting(
        "256MiB", "KV pool memory that pinned prefixes (POST /v1/cache/pins) may hold (at most half the pool)")

    def __post_init__(self) -> None:
        SpeculativeConfig.parse(self.speculative_config)  # a bad value fails here, in one line
        native.resolve(self.cpu_kernels)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization is a fraction in (0, 1], got {self.gpu_memory_utilization}")
        if self.n_gpu_layers >= 0 and self.tensor_parallel_size > 1:
            raise ValueError("--n-gpu-layers splits the layers of one process: use --tensor-parallel-size 1")
        if self.dtype != "auto":
            parse_dtype(self.dtype)
        for name in ("kv_cache_memory", "kv_offload_memory", "kv_offload_disk", "kv_pinned_memory"):
            parse_bytes(getattr(self, name))
        if self.kv_tiers and self.tensor_parallel_size > 1:
            raise ValueError("the KV tiers (--kv-offload-memory, --kv-offload-dir) need --tensor-parallel-size 1")
        if self.kv_tiers and not self.enable_prefix_caching:
            raise ValueError("the KV tiers (--kv-offload-memory, --kv-offload-dir) bring pages back through the "
                             "prefix cache: drop --no-enable-prefix-caching")

    @property
    def precision(self) -> Precision:
        """The device's (the CPU's where --n-gpu-layers 0 leaves every layer there)."""
        device = self.device if self.n_gpu_layers else "cpu"
        return Precision.of(self.dtype, self.cpu_kernels, device, self.kv_cache_dtype)

    def placement(self, model: ModelConfig) -> Placement:
        return Placement.of(self.device, self.n_gpu_layers, model.num_layers)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The compute dtype (activations)."""
        return self.precision.compute

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.parse(self.speculative_config)

    @property
    def model_path(self) -> Path:
        """The checkpoint this engine runs: --model, or the embedded SmolLM2's file."""
        from zhuzi.model.loader import default_model_path  # the loader's imports only where a path is asked
        return Path(self.model).expanduser() if self.model else default_model_path()

    @property
    def kv_cache_bytes(self) -> int:
        return parse_bytes(self.kv_cache_memory)

    @property
    def kv_tiers(self) -> bool:
        """Whether a host-memory or disk tier keeps KV pages beyond the pool."""
        return bool(self.kv_offload_dir or parse_bytes(self.kv_offload_memory))

    @property
    def draft_state_slots(self) -> int:
        """A hybrid model's state slots for a speculating sequence's drafts: its state after each, and with prefix
        caching one more for its state at a page boundary among them (kept only once the drafts before it stand)."""
        spec = self.speculative
        return 0 if spec is None else spec.num_speculative_tokens + self.enable_prefix_caching

    def kv_plan(self, model: ModelConfig, gpu: GPUPlan | None = None) -> KVPlan:
        """The pool --kv-cache-memory holds, or with layers on a GPU (gpu), the one the GPU's share holds."""
        budget = gpu.pool_bytes(KVShape.of_model(model).bytes_per_token(self.precision.kv)) if gpu \
            else self.kv_cache_bytes
        return KVPlan.of(model, self.precision.kv, budget, self.page_size, self.max_num_seqs, self.draft_state_slots)

    def gpu_plan(self, model: ModelConfig, total: int, weights: int) -> GPUPlan | None:
        """The GPU's memory (total bytes, weights on it), where layers that keep KV are on a GPU; else None (the
        pool is --kv-cache-memory's)."""
        placement = self.placement(model)
        if placement.accelerator.type == "cpu" or not placement.gpu_layers:
            return None
        shape = KVShape.of(family(model.architecture).layers(model), placement)
        per_token = sum(g.bytes_per_token(self.precision.kv) for g in shape.groups
                        if placement.on_accelerator(g.layers[0]))
        return GPUPlan(total, self.gpu_memory_utilization, weights, per_token) if per_token else None


@dataclass
class ParallelConfig(Settings):
    """Where `zhuzi serve` runs its engine cores: how many, in which processes."""

    engine_process: bool = setting(True, "run the step loop in a process of its own, apart from the HTTP "
                                         "server (--no-engine-process: in a thread of the server's process)")
    data_parallel_size: int = setting(1, "engine cores, each with its own KV cache and threads; requests go "
                                         "to the one holding the longest cached prefix, else the least loaded")
    data_parallel_backend: str = setting("mp", "how the engine cores are placed: local processes (mp) or "
                                               "Ray actors (ray)", choices=["mp", "ray"])
    ray_address: str | None = setting(None, "the Ray cluster to place engine cores on, e.g. HOST:6379 "
                                            "(default: start a local Ray)")
    kv_role: str = setting(
        "both", "each replica's part: both (prefill and decode), or one role per replica, comma-separated, e.g. "
                "prefill,decode: a new prompt is computed on a prefill replica, which ships its KV pages to a "
                "decode replica that streams the reply (ZeroMQ: ipc:// on one host, tcp:// across Ray nodes)")
    max_local_prefill_tokens: int = setting(
        256, "with prefill and decode replicas, a prompt of at most this many tokens the decode replica has not "
             "cached is computed there (a hand-off costs more than a short prefill)")

    ROLES = ("prefill", "decode", "both")

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be at least 1, got {self.data_parallel_size}")
        if self.data_parallel_size > 1 and not self.engine_process:
            raise ValueError("--data-parallel-size needs the engine cores in processes of their own "
                             "(--engine-process)")
        roles = self.kv_roles
        if bad := [r for r in roles if r not in self.ROLES]:
            raise ValueError(f"kv_role: unknown role {bad[0]!r}; choose from {', '.join(self.ROLES)}")
        if len(roles) != self.data_parallel_size:
            raise ValueError(f"kv_role names {len(roles)} roles for --data-parallel-size {self.data_parallel_size}")
        if "prefill" in roles and not {"decode", "both"} & set(roles):
            raise ValueError("kv_role: prefill replicas need a decode (or both) replica to hand their prompts to")

    @property
    def kv_roles(self) -> list[str]:
        """One role per replica ("both" everywhere by default)."""
        roles = [r.strip() for r in self.kv_role.split(",")]
        return roles * self.data_parallel_size if len(roles) == 1 else roles

    @property
    def handoffs(self) -> bool:
        """Whether some replica prefills for others."""
        return "prefill" in self.kv_roles

    def check(self, engine: EngineConfig) -> None:
        """ValueError where these replicas cannot run that engine: a hand-off ships whole pages (one rank's
        pool holds a slice of each) into the decode replica's prefix cache."""
        if self.handoffs and engine.tensor_parallel_size > 1:
            raise ValueError("prefill/decode replicas (--kv-role) need --tensor-parallel-size 1")
        if self.handoffs and not engine.enable_prefix_caching:
            raise ValueError("prefill/decode replicas (--kv-role) hand pages over through the prefix cache: drop "
                             "--no-enable-prefix-caching")


@dataclass
class ServerConfig(Settings):
    """The HTTP side of `zhuzi serve`."""

    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8000, "port to listen on")
    api_keys: list[str] = setting([], "accept this key as 'Authorization: Bearer KEY' (repeatable); "
                                      "none: no authentication", flags=["--api-key"])
    served_model_name: str | None = setting(None, "the model name clients send (default: the file's)")
    models_dirs: list[str] = setting([], "DIR whose models to serve: its GGUF files (a split's parts as one) and "
                                         "Hugging Face directories; `hf`: the Hugging Face cache, `ollama`: "
                                         "Ollama's store (repeatable; `zhuzi models` lists what they hold)",
                                     flags=["--models-dir"])
    models_preset: str | None = setting(None, "a TOML file of engine settings per model: a [default] table and one "
                                              "per model id, each key a flag without its dashes, e.g. "
                                              "max-model-len = 8192 (the flags given here win)")
    tool_call_parser: str | None = setting(None, "read tool calls in this format (hermes, qwen3_coder, mistral, "
                                                 "llama3_json, pythonic, gemma4, openai; default: the one the "
                                                 "chat template writes)")
    reasoning_parser: str | None = setting(None, "read the reply's thought with this parser (deepseek_r1, qwen3, "
                                                 "gemma4, openai: the vocabulary's own; none: read no thought; "
                                                 "default: the one the vocabulary's tags make)")
    keep_alive: str = setting("5m", "with --models-dir: how long a model stays loaded after its last request (a "
                                    "duration as Ollama's keep_alive: 30s, 5m, 1h; negative: for ever)")
    models_memory: str | None = setting(None, "with --models-dir: the bytes the loaded models may hold together "
                                              "(weights and KV pools, e.g. 8GiB); the least recently used idle "
                                              "one unloads to make room (default: no bound)")
    rate_limit_rpm: int | None = setting(None, "requests per minute per key")
    rate_limit_tpm: int | None = setting(None, "prompt + completion tokens per minute per key")
    max_waiting: int = setting(256, "sequences that may queue beyond --max-num-seqs before 429 (with "
                                    "--models-dir: beyond each model's, one room for all)")
    max_request_body_bytes: int = setting(8 * 2**20, "larger request bodies get 413")
    request_timeout: float | None = setting(None, "seconds after which a request still running ends with "
                                                  "finish_reason 'abort' (default: no limit)")
    shutdown_timeout: float = setting(30.0, "on SIGTERM or SIGINT, seconds the running requests may take to "
                                            "finish before they end with finish_reason 'abort'")
    responses_store: str | None = setting(None, "the SQLite file that keeps /v1/responses' stored responses and "
                                                "each key's token usage (default: responses.sqlite3 in zhuzi's "
                                                "cache directory, $ZHUZI_CACHE or ~/.cache/zhuzi)")
    responses_ttl: float = setting(30 * 24 * 3600.0, "seconds a stored conversation is kept after its latest "
                                                     "response (0: for ever)")
    engine_stall_timeout: float = setting(60.0, "seconds the engine may hold pending work without finishing a "
                                                "step before /health says 503 and the server exits (0: never)")
    tenant_weights: list[str] = setting([], "KEY=W: under --scheduling-policy fair, the API key KEY weighs W "
                                            "(default 1) in the shares of every step (repeatable)",
                                        flags=["--tenant-weights"])
    quota_tokens_per_day: list[str] = setting([], "KEY=N: the API key KEY may use N prompt + generated tokens a "
                                                  "day, UTC (repeatable); beyond that its requests get 429",
                                              flags=["--quota-tokens-per-day"])
    quota_file: str | None = setting(None, "a file of KEY=N lines (# comments), read as --quota-tokens-per-day")

    weights: dict[str, float] = field(init=False, repr=False)  # API key -> its weight in the fair shares
    quotas: dict[str, int] = field(init=False, repr=False)  # API key -> tokens it may use a day

    def __post_init__(self) -> None:
        """Reads the keyed settings (and the quota file) once; a bad value fails here, in one line."""
        self.weights = {key: _number(text, float, "--tenant-weights", key)
                        for key, text in self._keyed(self.tenant_weights, "--tenant-weights").items()}
        lines = list(self.quota_tokens_per_day)
        if self.quota_file is not None:
            try:
                text = open(self.quota_file, encoding="utf-8").read()
            except OSError as exc:
                raise ValueError(f"--quota-file: cannot read {self.quota_file}: {exc.strerror}") from None
            lines += [line for line in (raw.split("#")[0].strip() for raw in text.splitlines()) if line]
        self.quotas = {key: _number(text, int, "--quota-tokens-per-day", key)
                       for key, text in self._keyed(lines, "--quota-tokens-per-day").items()}

    def _keyed(self, items: list[str], flag: str) -> dict[str, str]:
        """KEY=VALUE items, each KEY one of --api-key."""
        out = {}
        for item in items:
            key, sep, value = item.rpartition("=")
            if not sep or not key:
                raise ValueError(f"{flag} takes KEY=VALUE, got {item!r}")
            if key not in self.api_keys:
                raise ValueError(f"{flag}: {key[:4]}... is not one of the --api-key keys")
            out[key] = value
        return out


def _number(text: str, kind: type, flag: str, key: str) -> Any:
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not value > 0 or value == float("inf"):
        raise ValueError(f"{flag}: the value for {key[:4]}... must be a positive {kind.__name__}, got {text!r}")
    return value
