"""zhuzi/bench/standins.py: a stand-in's header names its shape's config and a vocabulary of its size, every
tensor has the type and shape of the shape's Q4_K_M mix and is made of the source's blocks of that type, and
zhuzi (and llama.cpp, where built) runs it; the mix is the published Qwen2.5-Coder-1.5B Q4_K_M file's."""
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from tests.gguf_blocks import random_blocks
from zhuzi import LLM, SamplingParams
from zhuzi.bench.llamacpp import LlamaCppError, find_tool
from zhuzi.bench.standins import (
    SHAPES,
    SPECIAL_IDS,
    Linear,
    Shape,
    block_samples,
    config_keys,
    fitted_vocab,
    llama3_rope_freqs,
    synthesize,
    tensors,
)

SMALL = {
    # fewer tokens than the source's vocabulary (cut), and more (padded)
    "dense": Shape("small dense", "qwen2", 1500, 256, 3, 512, 4, 2, 64, 4096, 1e6, 1e-6, qkv_bias=True),
    "hybrid": Shape("small hybrid", "qwen35", 3000, 256, 4, 512, 4, 2, 64, 4096, 1e7, 1e-6, qk_norm=True,
                    linear=Linear(2, 4, 64)),
}
SOURCE_VOCAB = 2000  # SmolLM2's first tokens: a vocabulary the header reader reads in no time


@pytest.fixture(scope="module")
def source(smollm2_path: Path, tmp_path_factory) -> Path:
    """A Q4_K_M-like source: SmolLM2's tokenizer (cut short) and norms, and Q4_K and Q6_K blocks."""
    reader, out = GGUFReader(smollm2_path), tmp_path_factory.mktemp("source") / "source.gguf"
    fields = {name: field for name, field in reader.fields.items() if name.startswith("tokenizer.")}
    ids = {key: fields.pop(f"tokenizer.ggml.{key}_token_id").contents() for key in SPECIAL_IDS
           if f"tokenizer.ggml.{key}_token_id" in fields}
    tokens, types, merges, ids = fitted_vocab(*(fields.pop(f"tokenizer.ggml.{key}").contents()
                                                for key in ("tokens", "token_type", "merges")), ids, SOURCE_VOCAB)
    writer = GGUFWriter(out, "llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for key, token in ids.items():
        writer.add_uint32(f"tokenizer.ggml.{key}_token_id", token)
    for name, field in fields.items():
        writer.add_key_value(name, field.contents(), field.types[0])
    norm = next(t for t in reader.tensors if t.name == "blk.0.attn_norm.weight")
    writer.add_tensor("blk.0.attn_norm.weight", np.asarray(norm.data))
    for kind in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K):
        writer.add_tensor(f"{kind.name}.weight", random_blocks(kind, 64, 512), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize("name", SMALL)
def test_a_stand_in_has_its_shapes_config_and_mix_of_real_blocks_and_runs(name, source: Path, tmp_path: Path):
    shape = SMALL[name]
    out = synthesize(shape, source, tmp_path / f"{name}.gguf")
    made, original = GGUFReader(out), GGUFReader(source)

    assert made.fields["general.architecture"].contents() == shape.arch
    assert made.fields["general.file_type"].contents() == 15  # Q4_K_M
    for key, value in config_keys(shape).items():
        assert made.fields[key].contents() == pytest.approx(value), key
    assert [(t.name, t.tensor_type.name, tuple(int(d) for d in t.shape)) for t in made.tensors] == \
           [(t.name, t.kind, t.dims) for t in tensors(shape)]
    assert out.stat().st_size >= made.data_offset + sum(int(t.n_bytes) for t in made.tensors)

    # the vocabulary has the shape's size; its special tokens are the source's, renumbered
    tokens = made.fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == len(made.fields["tokenizer.ggml.token_type"].contents()) == shape.vocab
    source_tokens = original.fields["tokenizer.ggml.tokens"].contents()
    for key in ("bos", "eos", "unknown"):
        field = f"tokenizer.ggml.{key}_token_id"
        assert tokens[made.fields[field].contents()] == source_tokens[original.fields[field].contents()]
    kept = set(tokens)
    merges = made.fields["tokenizer.ggml.merges"].contents()
    assert merges and all(m.replace(" ", "") in kept and set(m.split(" ")) <= kept for m in merges)

    # every tensor is its type's real blocks, repeated (a DeltaNet's decay A negative, as stored)
    samples = {kind: sample.tobytes() for kind, sample in block_samples(original).items()}
    for t in made.tensors:
        data, sample = np.asarray(t.data).view(np.uint8).tobytes(), samples[t.tensor_type.name]
        if t.name.endswith("ssm_a"):
            assert (np.asarray(t.data) < 0).all()
        else:
            assert data[:len(sample)] == sample[:len(data)], t.name

    llm = LLM(str(out), kv_cache_memory="64MiB")
    done = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                        use_tqdm=False)[0]
    assert len(done.outputs[0].token_ids) == 4
    try:
        bench = find_tool("llama-bench")
    except LlamaCppError:
        return
    subprocess.run([str(bench), "-m", str(out), "-t", "1", "-p", "8", "-n", "2", "-r", "1"], check=True,
                   capture_output=True)


def test_the_llama_3_1_stand_ins_rope_freqs_turn_as_transformers_llama3_rope():
    """The frequencies that Llama-3.1-8B's divisors leave are those of transformers' llama3 RoPE for its config."""
    s = SHAPES["llama-3.1-8b"]
    factor, low, high, original = s.llama3_rope
    rope = {"rope_type": "llama3", "rope_theta": s.rope_base, "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": original}
    config = transformers.LlamaConfig(hidden_size=s.hidden, num_attention_heads=s.heads,
                                      max_position_embeddings=s.context, rope_parameters=rope)
    expected, _ = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    base = 1.0 / s.rope_base ** (torch.arange(0, s.head_dim, 2, dtype=torch.float32) / s.head_dim)
    ours = base / torch.from_numpy(llama3_rope_freqs(s.head_dim, s.rope_base, *s.llama3_rope))
    assert ((ours - expected).abs() / expected).max() < 1e-6
    assert expected[-1] == pytest.approx(base[-1] / factor)  # the slowest waves turn eightfold slower


@pytest.mark.models
def test_the_mix_is_the_published_q4_k_m_files():
    from tests.real_models import QWEN_1_5B, fetch

    published = GGUFReader(fetch(QWEN_1_5B))
    shape = Shape("Qwen2.5-Coder-1.5B", "qwen2", 151936, 1536, 28, 8960, 12, 2, 128, 32768, 1e6, 1e-6,
                  qkv_bias=True)
    assert sorted((t.name, t.tensor_type.name, tuple(int(d) for d in t.shape)) for t in published.tensors) == \
           sorted((t.name, t.kind, t.dims) for t in tensors(shape))
