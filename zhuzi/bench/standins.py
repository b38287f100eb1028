"""GGUF stand-ins at the sizes people run: a named model's shape (its config keys, every tensor's name, shape and
Q4_K_M type as llama.cpp's quantizer picks it) filled with real blocks of each type, repeated, and a real file's
tokenizer fitted to the shape's vocabulary. A step's time depends on the bytes, types and shapes it reads, not on
the values the blocks hold, so both engines run a stand-in at the real file's speed (its tokens are noise).

    python -m zhuzi.bench.standins NAME SOURCE.gguf OUT.gguf    # SOURCE: a Q4_K_M file (Q4_K and Q6_K blocks)
"""
from __future__ import annotations

import argparse
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SAMPLE_BYTES = 1 << 20  # of each block type: a whole number of blocks from its largest tensor
Q4_K_M = 15  # llama.cpp's file type of a Q4_K_M file (general.file_type)


@dataclass(frozen=True)
class Linear:
    """A hybrid's gated DeltaNet layers (llama.cpp's ssm.* keys)."""

    key_heads: int
    value_heads: int
    head_dim: int  # of keys and of values
    conv: int = 4
    full_attention_interval: int = 4


@dataclass(frozen=True)
class Shape:
    """A model's shape as its GGUF's config keys say it."""

    title: str  # general.name
    arch: str
    vocab: int
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    context: int
    rope_base: float
    eps: float
    tied: bool = False  # the output matrix is token_embd's
    qkv_bias: bool = False
    qk_norm: bool = False
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int = 0
    linear: Linear | None = None
    # Llama 3.1's long-context RoPE (factor, low and high frequency factors, original context), which the
    # converter writes as a tensor of its own (rope_freqs)
    llama3_rope: tuple[float, float, float, int] | None = None


SHAPES = {
    "qwen2.5-3b": Shape("Qwen2.5 3B Instruct (stand-in)", "qwen2", 151936, 2048, 36, 11008, 16, 2, 128, 32768, 1e6,
                        1e-6, tied=True, qkv_bias=True),
    "qwen2.5-7b": Shape("Qwen2.5 7B Instruct (stand-in)", "qwen2", 152064, 3584, 28, 18944, 28, 4, 128, 32768, 1e6,
                        1e-6, qkv_bias=True),
    # Llama 3's shape and mix; 3.1 adds its long-context RoPE factors
    "llama-3-8b": Shape("Meta Llama 3 8B Instruct (stand-in)", "llama", 128256, 4096, 32, 14336, 32, 8, 128, 8192,
                        5e5, 1e-5),
    "llama-3.1-8b": Shape("Meta Llama 3.1 8B Instruct (stand-in)", "llama", 128256, 4096, 32, 14336, 32, 8, 128,
                          131072, 5e5, 1e-5, llama3_rope=(8.0, 1.0, 4.0, 8192)),
    # All 128 experts of each layer, 12 of its 48 layers: 4.8 GB where the whole file is 18.6 GB.
    "qwen3-30b-a3b-width-12-layers": Shape("Qwen3 30B-A3B width, 12 layers (stand-in)", "qwen3moe", 151936, 2048,
                                           12, 6144, 32, 4, 128, 40960, 1e6, 1e-6, qk_norm=True, experts=128,
                                           experts_used=8, expert_ffn=768),
    "qwen3.5-9b": Shape("Qwen3.5 9B (stand-in)", "qwen35", 248320, 4096, 32, 12288, 16, 4, 256, 262144, 1e7, 1e-6,
                        qk_norm=True, linear=Linear(16, 32, 128)),
}


@dataclass(frozen=True)
class Tensor:
    name: str
    dims: tuple[int, ...]  # ggml's order: a row's length first
    kind: str  # its GGML type's name


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down keep more bits in a Q4_K_M file."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _fitted(kind: str, row: int) -> str:
    """The quantizer's fallback where a row is no whole number of 256-element blocks."""
    if kind in ("Q4_K", "Q6_K") and row % 256:
        kind = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}[kind]
    return "F16" if kind != "F32" and row % 32 else kind


def q4_k_m_type(name: str, dims: tuple[int, ...], rank: int, layer: int, layers: int) -> str:
    """The type llama-quantize gives tensor `name` of a Q4_K_M file (src/llama-quant.cpp's rules for these
    families): norms, biases, vectors, the router and the convolution stay F32; the output matrix Q6_K; attn_v
    (a DeltaNet's attn_qkv alike) and ffn_down Q6_K in the more-bits layers; everything else Q4_K. The
    quantizer counts attn_v and a dense ffn_down in file order, where the converter put the layers in their
    names' order (0, 1, 10, 11, ...): `rank` is a layer's place in it. A tied token_embd is quantized as any
    matrix, as in the published Qwen2.5 files (today's quantizer gives it the output's type)."""
    if len(dims) < 2 or not name.endswith("weight") or name.endswith("_norm.weight") or \
            any(part in name for part in ("ffn_gate_inp", "ssm_conv1d")):
        return "F32"
    if name == "output.weight":
        kind = "Q6_K"
    elif name.endswith(("attn_v.weight", "attn_qkv.weight", "ffn_down.weight")):
        kind = "Q6_K" if _more_bits(rank, layers) else "Q4_K"
    elif name.endswith("ffn_down_exps.weight"):  # a MoE's by the layer its name gives
        kind = "Q6_K" if _more_bits(layer, layers) else "Q4_K"
    else:
        kind = "Q4_K"
    return _fitted(kind, dims[0])


def _layer(s: Shape, i: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    h, hd, q, kv = s.hidden, s.head_dim, s.heads * s.head_dim, s.kv_heads * s.head_dim
    yield "attn_norm.weight", (h,)
    full = s.linear is None or (i + 1) % s.linear.full_attention_interval == 0
    if full:
        gate = 2 if s.arch == "qwen35" else 1  # Qwen3.5's q_proj holds the output gate's rows too
        for part, rows in (("q", gate * q), ("k", kv), ("v", kv)):
            yield f"attn_{part}.weight", (h, rows)
            if s.qkv_bias:
                yield f"attn_{part}.bias", (rows,)
        if s.qk_norm:
            yield "attn_q_norm.weight", (hd,)
            yield "attn_k_norm.weight", (hd,)
        yield "attn_output.weight", (q, h)
    else:
        lin = s.linear
        keys, values = lin.key_heads * lin.head_dim, lin.value_heads * lin.head_dim
        yield "attn_qkv.weight", (h, 2 * keys + values)
        yield "attn_gate.weight", (h, values)
        yield "ssm_conv1d.weight", (lin.conv, 2 * keys + values)
        yield "ssm_dt.bias", (lin.value_heads,)
        yield "ssm_a", (lin.value_heads,)
        yield "ssm_beta.weight", (h, lin.value_heads)
        yield "ssm_alpha.weight", (h, lin.value_heads)
        yield "ssm_norm.weight", (lin.head_dim,)
        yield "ssm_out.weight", (values, h)
    yield ("post_attention_norm.weight" if s.arch == "qwen35" else "ffn_norm.weight"), (h,)
    if s.experts:
        yield "ffn_gate_inp.weight", (h, s.experts)
        yield "ffn_gate_exps.weight", (h, s.expert_ffn, s.experts)
        yield "ffn_up_exps.weight", (h, s.expert_ffn, s.experts)
        yield "ffn_down_exps.weight", (s.expert_ffn, h, s.experts)
    else:
        yield "ffn_gate.weight", (h, s.ffn)
        yield "ffn_up.weight", (h, s.ffn)
        yield "ffn_down.weight", (s.ffn, h)


def tensors(s: Shape) -> list[Tensor]:
    """Every tensor of the shape's Q4_K_M file, in the converter's order: embedding, layers, output."""
    plan = [("token_embd.weight", (s.hidden, s.vocab), 0, 0)]
    if s.llama3_rope:
        plan.append(("rope_freqs.weight", (s.head_dim // 2,), 0, 0))
    order = sorted(range(s.layers), key=str)
    plan += [(f"blk.{i}.{name}", dims, rank, i) for rank, i in enumerate(order) for name, dims in _layer(s, i)]
    plan.append(("output_norm.weight", (s.hidden,), 0, 0))
    if not s.tied:
        plan.append(("output.weight", (s.hidden, s.vocab), 0, 0))
    return [Tensor(name, dims, q4_k_m_type(name, dims, rank, layer, s.layers)) for name, dims, rank, layer in plan]


def llama3_rope_freqs(head_dim: int, theta: float, factor: float, low: float, high: float,
                      original: int) -> np.ndarray:
    """Llama 3.1's long-context RoPE as llama.cpp's converter writes it (rope_freqs): a divisor of each float32
    base frequency, 1 where its wave is shorter than the original context over `high`, `factor` where it is
    longer than the context over `low`, and between them 1 / ((1 - smooth) / factor + smooth)."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim))
    wavelen = 2 * math.pi / freqs.astype(np.float64)
    smooth = (original / wavelen - low) / (high - low)
    blend = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0,
                    np.where(wavelen > original / low, factor, blend)).astype(np.float32)


def config_keys(s: Shape) -> dict[str, int | float | list[int]]:
    """The config keys llama.cpp's converter writes for the shape (and that llama.cpp and zhuzi read)."""
    keys: dict[str, int | float | list[int]] = {
        "block_count": s.layers, "context_length": s.context, "embedding_length": s.hidden,
        "feed_forward_length": s.ffn, "attention.head_count": s.heads, "attention.head_count_kv": s.kv_heads,
        "rope.freq_base": s.rope_base, "attention.layer_norm_rms_epsilon": s.eps}
    if s.head_dim != s.hidden // s.heads or s.arch in ("qwen3moe", "qwen35"):
        keys |= {"attention.key_length": s.head_dim, "attention.value_length": s.head_dim}
    if s.arch == "llama":
        keys |= {"rope.dimension_count": s.head_dim, "vocab_size": s.vocab}
    if s.experts:
        keys |= {"expert_count": s.experts, "expert_used_count": s.experts_used,
                 "expert_feed_forward_length": s.expert_ffn}
    if s.linear:
        lin = s.linear
        keys |= {"ssm.conv_kernel": lin.conv, "ssm.state_size": lin.head_dim, "ssm.group_count": lin.key_heads,
                 "ssm.time_step_rank": lin.value_heads, "ssm.inner_size": lin.value_heads * lin.head_dim,
                 "full_attention_interval": lin.full_attention_interval,
                 "rope.dimension_count": s.head_dim // 4,  # partial RoPE: a quarter of each head
                 "rope.dimension_sections": [11, 11, 10, 0]}  # MRoPE's sections; text positions fill them all
    return {f"{s.arch}.{k}": v for k, v in keys.items()}


# llama.cpp's token types
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5
SPECIAL_IDS = ("bos", "eos", "eot", "padding", "unknown", "sep", "cls", "mask")


def fitted_vocab(tokens: list[str], types: list[int], merges: list[str], ids: dict[str, int],
                 size: int) -> tuple[list[str], list[int], list[str], dict[str, int]]:
    """A byte-level BPE vocabulary of exactly `size` tokens: the first ordinary tokens, then the special ones,
    then "[PAD<i>]" tokens where `size` is larger (as the converter pads Qwen's); the merges whose parts and
    result are kept, and the special ids (bos, eos, ...) renumbered."""
    special = [i for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)]
    ordinary = [i for i, t in enumerate(types) if t == NORMAL][:size - len(special)]
    kept = ordinary + special
    new_id = {old: new for new, old in enumerate(kept)}
    vocab = {tokens[i] for i in ordinary}
    merges = [m for m in merges if all(part in vocab for part in m.split(" ")) and m.replace(" ", "") in vocab]
    pads = range(len(kept), size)
    return ([tokens[i] for i in kept] + [f"[PAD{i}]" for i in pads], [types[i] for i in kept] + [UNUSED] * len(pads),
            merges, {key: new_id[i] for key, i in ids.items() if i in new_id})


def block_samples(reader) -> dict[str, np.ndarray]:
    """Real bytes of each type the reader's file holds: whole blocks from its largest tensor of the type (F32's
    from its norms, the values a vector of the stand-in gets)."""
    from gguf import GGML_QUANT_SIZES

    largest: dict[str, object] = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind == "F32" and not t.name.endswith("norm.weight"):
            continue
        if t.n_bytes > getattr(largest.get(kind), "n_bytes", 0):
            largest[kind] = t
    samples = {}
    for kind, t in largest.items():
        block = GGML_QUANT_SIZES[t.tensor_type][1]
        keep = min(SAMPLE_BYTES, int(t.n_bytes)) // block * block
        samples[kind] = np.asarray(t.data).view(np.uint8).reshape(-1)[:keep].copy()
    return samples


def _nbytes(t: Tensor) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    elements, (block, size) = int(np.prod(t.dims)), GGML_QUANT_SIZES[GGMLQuantizationType[t.kind]]
    return elements // block * size


def _data(t: Tensor, samples: dict[str, np.ndarray], s: Shape) -> np.ndarray:
    if t.name == "rope_freqs.weight":  # values RoPE turns by: the real model's, not blocks'
        return llama3_rope_freqs(s.head_dim, s.rope_base, *s.llama3_rope).view(np.uint8)
    if t.kind not in samples:
        raise ValueError(f"the source file has no {t.kind} blocks for {t.name}")
    data = np.resize(samples[t.kind], _nbytes(t))
    if t.name.endswith("ssm_a"):  # stored as -exp(A_log): a decay rate, negative
        data = -np.abs(data.view(np.float32)).view(np.uint8)
    return data


def _source_fields(reader) -> dict[str, object]:
    """The source's tokenizer keys, as values."""
    return {name: field.contents() for name, field in reader.fields.items() if name.startswith("tokenizer.")}


def synthesize(shape: Shape, source: Path, out: Path) -> Path:
    """Write `shape`'s stand-in to `out`: its config keys, the source's tokenizer fitted to its vocabulary, and
    every tensor of its Q4_K_M type made of the source's blocks of that type, repeated."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(source)
    fields, samples = _source_fields(reader), block_samples(reader)
    ids = {key: fields.pop(f"tokenizer.ggml.{key}_token_id") for key in SPECIAL_IDS
           if f"tokenizer.ggml.{key}_token_id" in fields}
    tokens, types, merges, ids = fitted_vocab(fields.pop("tokenizer.ggml.tokens"),
                                              fields.pop("tokenizer.ggml.token_type"),
                                              fields.pop("tokenizer.ggml.merges", []), ids, shape.vocab)
    plan = tensors(shape)
    writer = GGUFWriter(out, shape.arch)
    writer.add_name(shape.title)
    writer.add_file_type(Q4_K_M)
    writer.add_quantization_version(2)
    for key, value in config_keys(shape).items():
        if isinstance(value, list):
            writer.add_array(key, value)
        else:
            (writer.add_float32 if isinstance(value, float) else writer.add_uint32)(key, value)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if merges:
        writer.add_token_merges(merges)
    for key, token in ids.items():
        writer.add_uint32(f"tokenizer.ggml.{key}_token_id", token)
    for key, value in fields.items():
        kind = reader.fields[key].types[0]
        writer.add_key_value(key, value, kind, sub_type=reader.fields[key].types[-1]
                             if kind == GGUFValueType.ARRAY else None)
    for t in plan:
        writer.add_tensor_info(t.name, tuple(reversed(t.dims)), np.dtype(np.float32), _nbytes(t),
                               raw_dtype=GGMLQuantizationType[t.kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in plan:
        writer.write_tensor_data(_data(t, samples, shape))
    writer.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=sorted(SHAPES))
    parser.add_argument("source", type=Path, help="a Q4_K_M GGUF: its tokenizer and its blocks of each type")
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    synthesize(SHAPES[args.name], args.source, args.out)


if __name__ == "__main__":
    main()
