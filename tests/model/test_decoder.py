"""Our forward pass against transformers' on the same weights, and paged KV against no cache."""
import math

import pytest
import tiny
import torch
import transformers

from zhuzi import LLM, SamplingParams
from zhuzi.model.attention import AttentionMetadata, PrefillChunk
from zhuzi.model.decoder import Decoder, LayerTap
from zhuzi.model.kv_pool import KVPool
from zhuzi.model.loader import load_checkpoint
from zhuzi.model.recurrent import StateRun

EMPTY = torch.empty(0)


def full_logits(model: Decoder, ids: list[int], tap: LayerTap | None = None) -> torch.Tensor:
    """Logits of every position from one prefill with no cached prefix."""
    n = len(ids)
    kv = KVPool.zeros(model.kv_shape, n, model.dtype)
    states = [[torch.zeros(1, *shape) for shape in shapes] for shapes in model.state_shapes()]
    meta = AttentionMetadata(torch.arange(n), 0, EMPTY, EMPTY, [PrefillChunk(0, n, n, torch.arange(n))],
                             [StateRun(0, n, 0)])
    with torch.inference_mode():
        return model.logits(model.forward(torch.tensor(ids), torch.arange(n), meta, kv, tap, states))


def greedy_without_cache(model: Decoder, ids: list[int], steps: int) -> list[int]:
    ids = list(ids)
    for _ in range(steps):
        ids.append(int(full_logits(model, ids)[-1].argmax()))
    return ids[-steps:]


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 256}
# tiny.write_gguf's rope base and epsilon, so that a GGUF form is the same model
GGUF_ROPE = {"rope_theta": 50000.0, "rms_norm_eps": 1e-5}
# Llama 3.1's RoPE: the waves longer than 64 positions slowed, those past 256 eightfold (PROMPTS[1] reaches 60)
LLAMA31 = {"rope_scaling": LLAMA3} | GGUF_ROPE
# Qwen2.5's long-context YaRN (4x) over an original context of 32, so that its ramp spans the tiny heads' dims
QWEN25_YARN = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}} | GGUF_ROPE
# Phi-4-mini's shape of Phi-3: LongRoPE (here within its original context: the short factors and the attention
# factor of a 32x stretch) over half of each head, tied embeddings; tiny.write_gguf's rope base, so that the
# GGUF form is the same model.
PHI3 = {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.5, 4.0],
                         "long_factor": [1.0, 2.0, 6.0, 9.5]},
        "original_max_position_embeddings": 128, "partial_rotary_factor": 0.5, "tie_word_embeddings": True,
        "rope_theta": 50000.0}
# Gemma 3 with what its GGUF form cannot say: soft-capped logits, an attention scale of its own, linear RoPE
# scaling on the global layer only; one local and one global layer.
GEMMA3_HF = dict(final_logit_softcapping=3.0, query_pre_attn_scalar=24, num_hidden_layers=2,
                 layer_types=["sliding_attention", "full_attention"],
                 rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
EXTRA = {"llama": LLAMA31, "qwen2": QWEN25_YARN, "phi3": PHI3, "gemma3": GEMMA3_HF, "gemma4-plain": tiny.GEMMA4_PLAIN,
         "gemma4-moe": tiny.GEMMA4_MOE}


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "phi3", "gemma3", "qwen3_5", "qwen3_5_moe",
                                        "qwen3_next", "gpt_oss", "lfm2", "lfm2_moe", "granitemoehybrid", "gemma4",
                                        "gemma4-plain", "gemma4-moe"])
def tiny_pair(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = tiny.build(request.param.split("-")[0], directory, **EXTRA.get(request.param, {}))
    ckpt = load_checkpoint(directory, torch.float32)
    return hf, Decoder(ckpt.config, ckpt.tensors), directory


PROMPTS = [[5, 17, 300, 42, 9, 801, 77], list(range(3, 90, 2)), [999] * 3 + [4, 400, 40]]
# Room for these prompts many times over: the default budget's page table, hundreds of thousands of tiny pages,
# takes longer to build than the tokens take to run.
KV = "4MiB"


def assert_logits_match(hf, ours: Decoder) -> None:
    """Every prompt's logits within today's tolerance of transformers' on the same weights."""
    for ids in PROMPTS:
        with torch.no_grad():
            expected = hf(torch.tensor([ids])).logits[0]
        assert (full_logits(ours, ids) - expected).abs().max() < 1e-3


def assert_logits_and_greedy_match(hf, ours: Decoder) -> None:
    """A prompt's logits within today's tolerance of transformers', and 16 greedy tokens equal to its."""
    ids = PROMPTS[1]
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
        tokens = hf.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert (full_logits(ours, ids) - expected).abs().max() < 1e-3
    assert greedy_without_cache(ours, ids, 16) == tokens[0, len(ids):].tolist()


def test_logits_match_transformers(tiny_pair):
    hf, ours, _ = tiny_pair
    assert_logits_match(hf, ours)


def test_the_tap_reads_each_layers_residual_stream(tiny_pair):
    """What the logit lens reads: after layer i, the hidden state transformers reports as hidden_states[i + 1];
    the last layer's, read through the lens (final norm, LM head), is the model's own output."""
    hf, ours, _ = tiny_pair
    ids = PROMPTS[1]
    rows = torch.tensor([3, len(ids) - 1])
    tap = LayerTap(rows)
    logits = full_logits(ours, ids, tap)
    with torch.no_grad():
        hidden = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    assert len(tap.residuals) == ours.config.num_layers
    for i, residual in enumerate(tap.residuals[:-1]):
        assert (residual - hidden[i + 1][0, rows]).abs().max() < 1e-4
    with torch.inference_mode():
        assert (ours.logits(ours.final_norm(tap.residuals[-1])) - logits[rows]).abs().max() < 1e-5


def test_the_state_pool_sizes_a_sequence_as_the_layers_hold_its_states(tiny_pair):
    """ModelConfig.state_bytes (the KV budget's arithmetic) is the bytes of the states the layers use."""
    _, ours, _ = tiny_pair
    assert ours.config.state_bytes == 4 * sum(math.prod(shape) for shapes in ours.state_shapes() for shape in shapes)


def test_greedy_generation_matches_transformers(tiny_pair):
    """Through the engine: the prompts batched, prefilled in chunks of 32 tokens, then a second round whose
    prompts share a cached prefix with the first's; every sequence's greedy tokens are transformers'."""
    hf, _, directory = tiny_pair
    llm = LLM(str(directory), dtype="float32", page_size=16, max_num_batched_tokens=32, kv_cache_memory=KV)
    params = SamplingParams(temperature=0, max_tokens=32, min_tokens=32)
    again = [PROMPTS[1][:40] + [7, 8], PROMPTS[1] + [500]]
    outs = llm.generate(PROMPTS, params)
    outs += llm.generate(again, params)
    assert all(out.num_cached_tokens >= 32 for out in outs[len(PROMPTS):])
    for ids, out in zip(PROMPTS + again, outs):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
        assert out.outputs[0].token_ids == expected[0, len(ids):].tolist()


def test_paged_kv_equals_recomputing_without_cache(tiny_pair):
    """Block size 16; a 44-token prompt plus 40 decode steps crosses five block boundaries."""
    _, ours, directory = tiny_pair
    llm = LLM(str(directory), dtype="float32", page_size=16, kv_cache_memory=KV)
    ids = PROMPTS[1]
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == greedy_without_cache(ours, ids, 40)


# ---------------------------------------------------------------- sliding-window attention

WINDOW = 12  # tokens a sliding layer sees: far fewer than the prompts and generations below


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """A Mistral whose every layer slides, with the GGUF's rope base and epsilon so its GGUF form (llama, with
    the window key) is the same model."""
    directory = tmp_path_factory.mktemp("mistral")
    hf = tiny.build("mistral", directory, sliding_window=WINDOW, rope_theta=50000.0, rms_norm_eps=1e-5)
    return hf, directory


def test_sliding_window_logits_match_transformers_from_hf_and_gguf(mistral, tmp_path):
    hf, directory = mistral
    gguf_path = tiny.write_gguf(tmp_path / "mistral.gguf", hf, "llama", sliding_window=WINDOW)
    models = [Decoder(ckpt.config, ckpt.tensors) for ckpt in (load_checkpoint(directory, torch.float32),
                                                              load_checkpoint(gguf_path, torch.float32))]
    for ids in PROMPTS[1:]:
        with torch.no_grad():
            expected = hf(torch.tensor([ids])).logits[0]
        for model in models:
            assert (full_logits(model, ids) - expected).abs().max() < 1e-3


def test_mixed_sliding_and_full_layers_match_transformers(tmp_path):
    """Qwen2 with use_sliding_window: layer 0 reads everything, layer 1 its last 8 tokens."""
    hf = tiny.build("qwen2", tmp_path, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    ckpt = load_checkpoint(tmp_path, torch.float32)
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPTS[1]])).logits[0]
    assert (full_logits(Decoder(ckpt.config, ckpt.tensors), PROMPTS[1]) - expected).abs().max() < 1e-3


# The pairs whose GGUF form (tiny.write_gguf) is the same model, and what llama.cpp's converter makes of each
SAME_AS_GGUF = {"phi3": "attn_qkv, gate and up fused in ffn_up, LongRoPE's factors as tensors",
                "llama": "Llama 3.1's long-context RoPE as rope_freqs, a divisor per frequency, no scaling keys",
                "qwen2": "YaRN as rope.scaling keys"}


@pytest.fixture
def gguf_pair(tiny_pair):
    if tiny_pair[0].config.model_type not in SAME_AS_GGUF:
        pytest.skip("no GGUF form of the same model")
    return tiny_pair


def test_gguf_as_llama_cpp_writes_it_gives_transformers_logits_and_tokens(gguf_pair, tmp_path):
    """The same model as llama.cpp's converter writes it (SAME_AS_GGUF) computes what transformers computes,
    tokens included."""
    hf, _, _ = gguf_pair
    arch = hf.config.model_type
    ckpt = load_checkpoint(tiny.write_gguf(tmp_path / f"{arch}.gguf", hf, arch), torch.float32)
    assert_logits_and_greedy_match(hf, Decoder(ckpt.config, ckpt.tensors))


def test_gemma3_gguf_as_llama_cpp_writes_it_gives_transformers_logits(tmp_path):
    """llama.cpp's converter stores Gemma's norms as (1 + w) and fixes the layer pattern and the local RoPE
    base: the file's model is the directory's."""
    hf = tiny.build("gemma3", tmp_path)
    path = tiny.write_gguf(tmp_path / "tiny.gguf", hf, "gemma3")
    ckpt = load_checkpoint(path, torch.float32)
    ours = Decoder(ckpt.config, ckpt.tensors)
    assert_logits_match(hf, ours)


def deltanet_gguf(arch: str, directory):
    """A tiny Qwen3.5 (or Qwen3-Next) and the GGUF llama.cpp's converter writes of it, with a
    multi-token-prediction block after its layers as the released checkpoints' files have."""
    hf = tiny.build(arch, directory, rope_theta=50000.0, rms_norm_eps=1e-5)
    return hf, tiny.write_gguf(directory / "tiny.gguf", hf, arch, mtp=True)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_a_deltanet_gguf_as_llama_cpp_writes_it_gives_transformers_logits(arch, tmp_path):
    """llama.cpp's converter stores (1 + w) norms as such, A_log as -exp(A_log), Qwen3.5's DeltaNet value heads
    tiled by key head (its four value heads over two key heads are reordered), Qwen3-Next's in_proj_qkvz split
    into attn_qkv and attn_gate and its in_proj_ba as it is (ssm_ba), value heads grouped; the MTP block it
    appends is not one of the model's layers: the file's model is the directory's."""
    hf, path = deltanet_gguf(arch, tmp_path)
    ckpt = load_checkpoint(path, torch.float32)
    assert ckpt.config.linear is not None and ckpt.config.linear.tiled == (arch != "qwen3_next")
    assert ckpt.config.num_layers == hf.config.num_hidden_layers
    ours = Decoder(ckpt.config, ckpt.tensors)
    assert_logits_match(hf, ours)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_a_deltanet_gguf_greedy_through_the_engine_is_transformers(arch, tmp_path):
    """The file prefilled in 32-token chunks beside other prompts, then decoded: transformers' tokens."""
    hf, path = deltanet_gguf(arch, tmp_path)
    llm = LLM(str(path), dtype="float32", page_size=16, max_num_batched_tokens=32)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, min_tokens=16))
    for ids, out in zip(PROMPTS, outs):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert out.outputs[0].token_ids == expected[0, len(ids):].tolist()


def test_a_qwen3_5_checkpoint_with_a_vision_tower_loads_its_text_model(tmp_path, caplog):
    """Qwen3.5's released checkpoints are Qwen3_5ForConditionalGeneration: the text model under
    model.language_model, a vision tower beside it. Its text part is the model, with one log line."""
    text = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, **{k: v for k, v in tiny.HYBRID.items() if k.startswith("linear")})
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    torch.manual_seed(0)
    hf = transformers.Qwen3_5ForConditionalGeneration(
        transformers.Qwen3_5Config(text_config=text, vision_config=vision)).eval()
    tiny.randomize(hf)
    hf.save_pretrained(tmp_path)
    with caplog.at_level("INFO"):
        ckpt = load_checkpoint(tmp_path, torch.float32)
    assert "Qwen3_5ForConditionalGeneration carries a vision tower too: loading its text model only" in caplog.text
    assert ckpt.config.architecture == "qwen3_5" and not any("visual" in name for name in ckpt.tensors)


@pytest.mark.parametrize("shape, apart", [({}, False), (tiny.GEMMA4_PLAIN, False), (tiny.GEMMA4_MOE, False),
                                          (tiny.GEMMA4_MOE, True)], ids=["e2b", "plain", "moe", "moe-apart"])
def test_gemma4_gguf_as_llama_cpp_writes_it_gives_transformers_logits_and_tokens(shape, apart, tmp_path):
    """llama.cpp's converter writes both head sizes, KV heads and MLP widths per layer, proportional RoPE as
    frequency factors, each expert's gate and up as one matrix (other writers: as two, apart) and the router's
    scales beside its matrices: the file's model is the directory's, per-layer embeddings, shared K/V and experts
    included."""
    hf = tiny.build("gemma4", tmp_path, **shape)
    ckpt = load_checkpoint(tiny.write_gguf(tmp_path / "tiny.gguf", hf, "gemma4", gate_up_apart=apart), torch.float32)
    ours = Decoder(ckpt.config, ckpt.tensors)
    assert_logits_and_greedy_match(hf, ours)


@pytest.mark.parametrize("arch", ["lfm2", "lfm2_moe"])
def test_lfm2_gguf_as_llama_cpp_writes_it_gives_transformers_logits(arch, tmp_path):
    """llama.cpp's converter names the final norm token_embd_norm, squeezes the convolution, writes the KV heads
    per layer (0 where a layer is a convolution), the MLP's width as LFM2 makes it and LFM2-MoE's expert bias as
    exp_probs_b: the file's model is the directory's."""
    hf = tiny.build(arch, tmp_path, rope_theta=50000.0)
    ckpt = load_checkpoint(tiny.write_gguf(tmp_path / "tiny.gguf", hf, arch), torch.float32)
    assert ckpt.config.layer_types == hf.config.layer_types and ckpt.config.num_kv_heads == 2
    ours = Decoder(ckpt.config, ckpt.tensors)
    assert_logits_match(hf, ours)


def test_granite_gguf_as_llama_cpp_writes_it_gives_transformers_logits(tmp_path):
    """llama.cpp's converter splits Granite's gate and up, stores A_log as -exp(A_log), A, D and the gated norm
    reshaped, a KV head count per layer, the multipliers as scales: the file's model is the directory's."""
    hf = tiny.build("granitemoehybrid", tmp_path, rms_norm_eps=1e-5)
    ckpt = load_checkpoint(tiny.write_gguf(tmp_path / "tiny.gguf", hf, "granitemoehybrid"), torch.float32)
    assert ckpt.config.layer_types == ["mamba2", "full_attention", "mamba2", "mamba2"] and not ckpt.config.use_rope
    ours = Decoder(ckpt.config, ckpt.tensors)
    assert_logits_match(hf, ours)


def test_lfm2_gguf_greedy_through_the_engine_is_transformers(tmp_path):
    """The file prefilled in 32-token chunks beside other prompts, then decoded: transformers' tokens."""
    hf = tiny.build("lfm2", tmp_path, rope_theta=50000.0)
    llm = LLM(str(tiny.write_gguf(tmp_path / "tiny.gguf", hf, "lfm2")), dtype="float32", page_size=16,
              max_num_batched_tokens=32)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, min_tokens=16))
    for ids, out in zip(PROMPTS, outs):
        with torch.no_grad():  # both of the file's end tokens (eos and eot) held back
            expected = hf.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                   eos_token_id=[2, 7])
        assert out.outputs[0].token_ids == expected[0, len(ids):].tolist()


def test_granite_gguf_greedy_through_the_engine_is_transformers(tmp_path):
    """The file (its tokenizer too) prefilled in 32-token chunks beside other prompts, then decoded:
    transformers' tokens."""
    hf = tiny.build("granitemoehybrid", tmp_path, rms_norm_eps=1e-5)
    llm = LLM(str(tiny.write_gguf(tmp_path / "tiny.gguf", hf, "granitemoehybrid")), dtype="float32", page_size=16,
              max_num_batched_tokens=32)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, min_tokens=16))
    for ids, out in zip(PROMPTS, outs):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert out.outputs[0].token_ids == expected[0, len(ids):].tolist()


@pytest.mark.parametrize("experts", [4, 0])
def test_granite_counts_every_parameter_per_layer_kind(experts, tmp_path):
    """ModelConfig.num_parameters (zhuzi plan's) of Mamba2 and attention layers, experts and the ungated shared MLP
    or the shared MLP alone: transformers' count."""
    hf = tiny.build("granitemoehybrid", tmp_path, num_local_experts=experts)
    assert load_checkpoint(tmp_path, torch.float32).config.num_parameters == sum(p.numel() for p in hf.parameters())


def test_granite_without_experts_and_with_rope_matches_transformers(tmp_path):
    """Granite 4's other shape: the shared MLP alone, and RoPE where position_embedding_type says so."""
    hf = tiny.build("granitemoehybrid", tmp_path, num_local_experts=0, shared_intermediate_size=40,
                    position_embedding_type="rope")
    ckpt = load_checkpoint(tmp_path, torch.float32)
    ours = Decoder(ckpt.config, ckpt.tensors)
    assert ckpt.config.use_rope and all(layer.moe is None for layer in ours.layers)
    assert_logits_match(hf, ours)
