"""The fused decode step (one native call a step) against the per-layer path and a float32 forward, on
tiny Llama / Qwen2 (QKV bias) / Qwen3 (q/k norms) / Gemma 3 (local and global layers, windows shorter than the
prompts) / Gemma 4 (head sizes and KV shapes per layer, shared K/V, per-layer inputs) checkpoints in every weight
format, Phi-3's (LongRoPE, RoPE over part of each head), and as GGUF files of every block type, under every CPU
variant this machine runs, in the precision dtype auto picks there (bf16 with AVX512-BF16, else float32 activations
over bf16 weights and KV cache)."""
import dataclasses
from pathlib import Path

import gguf
import pytest
import safetensors.torch
import tiny
import torch

from zhuzi.config import Precision
from zhuzi.model import native
from zhuzi.model.attention import AttentionMetadata, PrefillChunk
from zhuzi.model.decoder import Decoder
from zhuzi.model.fused import FusedDecode
from zhuzi.model.kv_format import Q8_0, dequantize_q8_0
from zhuzi.model.kv_pool import KVPool
from zhuzi.model.loader import load_checkpoint
from zhuzi.model.model_config import ModelConfig

# The GGUF files written here are packed into the module's own cache, not the user's.
pytestmark = pytest.mark.usefixtures("own_cache", "variant")

SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)  # head_dim 32
# Gemma 3 of two layers as the others: a local one whose window cuts IDS, then a global one; a query scale and
# soft-capped logits of its own
GEMMA3 = dict(head_dim=32, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=8,
              query_pre_attn_scalar=24, final_logit_softcapping=30.0)
# Gemma 4 of the small shapes (tiny.GEMMA4: per-layer inputs, a window shorter than IDS, shared K/V) in four layers,
# local and global in turn, the last two on the first two's K/V; its global layers' V is K's projection, with KV
# heads of their own (the large shapes'); head sizes and a per-layer input width the kernel serves
GEMMA4 = dict(head_dim=32, global_head_dim=64, hidden_size_per_layer_input=32, attention_k_eq_v=True,
              num_global_key_value_heads=1, num_hidden_layers=4,
              layer_types=["sliding_attention", "full_attention"] * 2)
OWN = {"gemma3": GEMMA3, "gemma4": GEMMA4}


def soften_attention(directory: Path, factor: float) -> None:
    """Gemma 4 scores attention unscaled, q and k RMS-normed: a random checkpoint's norm weights (near 1) give scores
    of several units, each softmax near one-hot, and bf16's rounding of a score moves it far in either path. Norm
    weights times factor keep the scores small."""
    path = directory / "model.safetensors"
    tensors = safetensors.torch.load_file(path)
    safetensors.torch.save_file({name: t * factor if name.endswith(("q_norm.weight", "k_norm.weight")) else t
                                 for name, t in tensors.items()}, path, metadata={"format": "pt"})


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "gemma3", "gemma4"])
def checkpoint(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    tiny.build(request.param, directory, **SHAPE | OWN.get(request.param, {}))
    if request.param == "gemma4":
        soften_attention(directory, 0.4)
    return directory


Q = gguf.GGMLQuantizationType
# Every block type a kernel serves, as a Q4_K_M file mixes them: q/k/v side by side in one layer.
BLOCK_TYPES = {"q_proj": Q.Q4_0, "k_proj": Q.Q5_1, "v_proj": Q.Q8_0, "o_proj": Q.Q4_K, "gate_proj": Q.Q5_K,
               "up_proj": Q.Q4_1, "down_proj": Q.Q6_K, "embed_tokens": Q.Q5_0, "lm_head": Q.Q6_K}
# The second layer's attention as a Q3_K_M or Q2_K file stores it.
SECOND_LAYER = {"q_proj": Q.Q2_K, "k_proj": Q.Q2_K, "v_proj": Q.Q3_K, "o_proj": Q.Q3_K}
# The qwen2 file mixes in the lookup-table types, as the IQ4_NL / IQ4_XS files of MoE models and gpt-oss's MXFP4 do.
LUT_TYPES = {"q_proj": Q.IQ4_NL, "k_proj": Q.MXFP4, "up_proj": Q.MXFP4, "down_proj": Q.IQ4_XS}


def block_type(name: str, arch: str) -> gguf.GGMLQuantizationType:
    kind = name.split(".")[-2]
    if ".layers.1." in name and kind in SECOND_LAYER:
        return SECOND_LAYER[kind]
    return LUT_TYPES.get(kind, BLOCK_TYPES[kind]) if arch == "qwen2" else BLOCK_TYPES[kind]


# Llama 3.1's RoPE, its original context shorter than IDS (the GGUF's rope_freqs), tiny.write_gguf's rope base
LLAMA31 = dict(rope_theta=50000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
OWN_GGUF = {"gemma3": dict(head_dim=64, sliding_window=8), "llama": LLAMA31}


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma3"])
def gguf_file(request, tmp_path_factory):
    """A tiny model as a GGUF file of blocks (llama: Llama 3.1, Q/K rows in llama.cpp's order, rotated
    interleaved, RoPE frequency factors)."""
    directory = tmp_path_factory.mktemp(f"{request.param}-gguf")
    own = OWN_GGUF.get(request.param, {})
    model = tiny.build(request.param, directory, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=1024, **own)  # K-quant rows of 256; whole 16-row groups
    types = {name: block_type(name, request.param) for name in model.state_dict()
             if name.endswith(".weight") and name.split(".")[-2] in BLOCK_TYPES}
    return tiny.write_gguf(directory / "tiny.gguf", model, request.param, types=types)


def decoder(directory, dtype="auto", quantization=None, fused=True) -> Decoder:
    precision = Precision.of(dtype, native.current())
    ckpt = load_checkpoint(directory, precision.weights)
    return Decoder(ckpt.config, ckpt.tensors, quantization=quantization, fused_decode=fused, dtype=precision.compute)


def prefill(model: Decoder, ids: list[int], pool: int = 256, kv: KVPool | None = None,
            first_slot: int = 0, kv_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, KVPool]:
    """(logits of every position, the KV pool: kv, or a new one of kv_dtype) of one prompt at slots first_slot +
    position."""
    n = len(ids)
    if kv is None:
        dtype = kv_dtype or model.kv_dtype
        kv = KVPool.zeros(model.kv_shape, pool, dtype)
    slots = torch.arange(n) + first_slot
    meta = AttentionMetadata(slots, 0, torch.empty(0), torch.empty(0), [PrefillChunk(0, n, n, slots)])
    with torch.inference_mode():
        return model.logits(model.forward(torch.tensor(ids), torch.arange(n), meta, kv)), kv


def decode_meta(slots: list[list[int]]) -> AttentionMetadata:
    """Decode rows whose histories (new token's slot last) are these slot lists."""
    width = max(map(len, slots))
    table = torch.tensor([s + [0] * (width - len(s)) for s in slots])
    return AttentionMetadata(torch.tensor([s[-1] for s in slots]), len(slots), table,
                             torch.tensor([len(s) for s in slots]), [])


IDS = [5, 17, 300, 42, 9, 801, 77, 3, 250, 18] * 4


def fused_and_per_layer(model: Decoder, ids: list[int], kv_dtype: torch.dtype | None = None):
    """The last token's logits as a fused decode step and through the per-layer path, from the same pool; and
    the pool (its one tensor) after each."""
    _, kv = prefill(model, ids[:-1], kv_dtype=kv_dtype)
    meta = decode_meta([list(range(len(ids)))])
    args = torch.tensor(ids[-1:]), torch.tensor([len(ids) - 1])
    with torch.inference_mode():
        fused_kv, per_layer_kv = kv.clone(), kv.clone()
        fused = model.decode_step(*args, meta, fused_kv)
        per_layer = model.logits(model.forward(*args, meta, per_layer_kv))
    return fused, per_layer, fused_kv.tensors[0], per_layer_kv.tensors[0]


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_fused_step_agrees_with_the_per_layer_path(checkpoint, quantization):
    """In bf16 both round, at different points (fused.py): 1-2 % of the largest logit apart here."""
    model = decoder(checkpoint, quantization=quantization)
    assert model.fused is not None  # every variant serves it
    fused, per_layer, fused_kv, per_layer_kv = fused_and_per_layer(model, IDS)
    assert fused.shape == (1, model.config.vocab_size) and fused.dtype == torch.float32
    assert (fused - per_layer).abs().max() <= 0.03 * per_layer.abs().max()
    new = len(IDS) - 1  # the new token's K and V went into its slot, as the per-layer path writes them
    written = fused_kv[:, :, new].float()
    assert (written - per_layer_kv[:, :, new].float()).abs().max() <= 0.03 * written.abs().max()
    assert torch.equal(fused_kv[:, :, :new], per_layer_kv[:, :, :new])  # and nowhere else


def test_fused_step_over_a_q8_0_pool_agrees_with_the_per_layer_path(checkpoint):
    """Both read the prompt's q8_0 K/V; the new token's K/V are quantized from the fused step's float32 (the
    per-layer path's bf16 on AVX512-BF16), so they may land a step apart."""
    model = decoder(checkpoint)
    fused, per_layer, fused_kv, per_layer_kv = fused_and_per_layer(model, IDS, Q8_0)
    assert (fused - per_layer).abs().max() <= 0.03 * per_layer.abs().max()
    new = len(IDS) - 1
    written = dequantize_q8_0(fused_kv[:, :, new])
    assert (written - dequantize_q8_0(per_layer_kv[:, :, new])).abs().max() <= 0.03 * written.abs().max()
    assert torch.equal(fused_kv[:, :, :new], per_layer_kv[:, :, :new])


def test_fused_step_is_as_close_to_float32_as_the_per_layer_path(checkpoint):
    """Its float32 residual stream rounds less than the per-layer path's bf16 one (and as little as the
    float32 one's)."""
    model = decoder(checkpoint)
    fused, per_layer, _, _ = fused_and_per_layer(model, IDS)
    reference, _ = prefill(decoder(checkpoint, "float32"), IDS)
    fused_error, per_layer_error = ((x[0] - reference[-1]).abs().max() for x in (fused, per_layer))
    assert fused_error <= 1.25 * per_layer_error


def test_fused_step_on_gguf_blocks_agrees_with_the_per_layer_path(gguf_file):
    """Both meet the blocks with q8 activations; only the bf16 rounding of the per-layer path differs."""
    model = decoder(gguf_file, quantization="gguf")
    assert model.fused is not None
    fused, per_layer, fused_kv, per_layer_kv = fused_and_per_layer(model, IDS)
    assert (fused - per_layer).abs().max() <= 0.03 * per_layer.abs().max()
    new = len(IDS) - 1
    written = fused_kv[:, :, new].float()
    assert (written - per_layer_kv[:, :, new].float()).abs().max() <= 0.03 * written.abs().max()


def rows_never_influence_each_other(model: Decoder, kv_dtype: torch.dtype | None) -> None:
    """A row's logits are the same bits alone or beside others of other lengths, on any thread count: alone on two
    threads, a layer of fewer KV heads than threads (Gemma 4's global ones) splits its query heads between them."""
    _, kv = prefill(model, IDS[:11], kv_dtype=kv_dtype)  # three sequences, each with its own slots
    prefill(model, IDS[:39], kv=kv, first_slot=64)
    prefill(model, IDS[:24], kv=kv, first_slot=128)
    rows = [list(range(12)), list(range(64, 104)), list(range(128, 153))]
    ids, positions = torch.tensor([7, 8, 9]), torch.tensor([11, 39, 24])
    with torch.inference_mode():
        together = model.decode_step(ids, positions, decode_meta(rows), kv.clone())
        threads = torch.get_num_threads()
        try:
            for i, row in enumerate(rows):
                for n in (1, 2):
                    torch.set_num_threads(n)
                    alone = model.decode_step(ids[i:i + 1], positions[i:i + 1], decode_meta([row]), kv.clone())
                    assert torch.equal(alone[0], together[i])
        finally:
            torch.set_num_threads(threads)


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_rows_never_influence_each_other(checkpoint, quantization):
    rows_never_influence_each_other(decoder(checkpoint, quantization=quantization), None)


@pytest.mark.parametrize("kv_dtype", [None, Q8_0])
def test_rows_of_gguf_blocks_never_influence_each_other(gguf_file, kv_dtype):
    """Over a q8_0 pool too."""
    rows_never_influence_each_other(decoder(gguf_file, quantization="gguf"), kv_dtype)


def test_fused_step_is_used_only_where_it_serves(checkpoint):
    assert decoder(checkpoint, "float32").fused is None  # float32 is the reference: the per-layer path
    assert decoder(checkpoint, fused=False).fused is None  # EngineConfig.fused_decode=False
    model = decoder(checkpoint)
    _, kv = prefill(model, IDS)
    nine = [list(range(i + 1)) for i in range(9)]
    with torch.inference_mode():
        assert model.decode_step(torch.arange(9), torch.arange(9), decode_meta(nine), kv) is None  # 9 rows
        chunk = AttentionMetadata(torch.arange(2), 0, torch.empty(0), torch.empty(0),
                                  [PrefillChunk(0, 2, 2, torch.arange(2))])
        assert model.decode_step(torch.arange(2), torch.arange(2), chunk, kv) is None  # a prompt chunk


def test_fused_step_rejects_slots_outside_the_pool(checkpoint):
    model = decoder(checkpoint)
    _, kv = prefill(model, IDS, pool=64)
    with torch.inference_mode(), pytest.raises(IndexError):
        model.decode_step(torch.tensor([3]), torch.tensor([40]), decode_meta([list(range(40)) + [64]]), kv)



@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    """Tiny Phi-3s: one with LongRoPE (IDS reach past its original context of 32: both factor sets), one whose
    RoPE turns half of each head."""
    directory = tmp_path_factory.mktemp("phi3")
    longrope = {"rope_type": "longrope", "short_factor": [1.0 + i / 4 for i in range(16)],
                "long_factor": [1.0 + i for i in range(16)]}
    tiny.build("phi3", directory / "longrope", **SHAPE, rope_scaling=longrope, original_max_position_embeddings=32)
    tiny.build("phi3", directory / "partial", **SHAPE, partial_rotary_factor=0.5)
    return directory


@pytest.mark.parametrize("rope", ["longrope", "partial"])
def test_fused_step_serves_phi3(phi3, rope):
    """Phi-3's fused checkpoint tensors, LongRoPE tables and RoPE over part of each head run fused as the per-layer
    path runs them."""
    model = decoder(phi3 / rope)
    assert model.fused is not None
    fused, per_layer, _, _ = fused_and_per_layer(model, IDS)
    assert (fused - per_layer).abs().max() <= 0.03 * per_layer.abs().max()


LACKS = {"experts": dict(num_experts=4, num_experts_per_tok=2),
         "an MLP activation other than SiLU or GELU(tanh)": dict(hidden_act="relu"),
         "attention without RoPE": dict(use_rope=False), "scaled residuals or logits": dict(logit_scale=2.0),
         "a recurrent mixer": dict(architecture="lfm2", layer_types=["conv", "full_attention"], short_conv_kernel=3),
         "a gated attention output": dict(architecture="qwen3_5", layer_types=["full_attention"] * 2),
         "heads of a size other than 32, 64, 96, 128, 256": dict(layer_types=["sliding_attention", "full_attention"],
                                                                  global_head_dim=512)}


@pytest.mark.parametrize("feature", LACKS)
def test_the_step_refuses_a_model_by_the_feature_it_lacks_not_by_its_family(feature):
    llama = ModelConfig("llama", 100, 64, 128, 2, 4, 2, 32)
    assert FusedDecode.refusal(llama) is None
    assert FusedDecode.refusal(dataclasses.replace(llama, architecture="gemma3")) is None
    assert FusedDecode.refusal(dataclasses.replace(llama, architecture="gemma4")) is None
    assert FusedDecode.refusal(dataclasses.replace(llama, **LACKS[feature])) == feature


SERVES = {"sliding-window attention": dict(sliding_window=8), "sandwich norms": dict(sandwich_norms=True),
          "RoPE over part of each head": dict(rotary_dim=8), "attention sinks": dict(attention_sinks=True),
          "an output-projection bias": dict(attention_out_bias=True),
          "layers of several KV shapes": dict(layer_types=["sliding_attention", "full_attention"], global_head_dim=32),
          "layers without K/V of their own": dict(layer_types=["full_attention"] * 2, num_kv_shared_layers=1),
          "V normed": dict(value_norm=True), "V shared with K": dict(layer_types=["full_attention"] * 2,
                                                                      global_values_are_keys=True),
          "per-layer embeddings": dict(per_layer_input_size=8), "scaled layer outputs": dict(layer_scalar=True),
          "offset norms": dict(norm_weight_offset=1.0), "a GELU MLP": dict(hidden_act="gelu_pytorch_tanh"),
          "a query scale of its own": dict(query_pre_attn_scalar=8), "scaled embeddings": dict(embedding_scale=8.0),
          "soft-capped logits": dict(final_logit_softcapping=30.0),
          "RoPE bases per layer": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                                       rope_local_theta=1e4, rope_theta=1e6)}


@pytest.mark.parametrize("feature", SERVES)
def test_the_step_takes_what_gemma_and_gpt_oss_layers_have(feature):
    llama = ModelConfig("llama", 100, 64, 128, 2, 4, 2, 32)
    assert FusedDecode.refusal(dataclasses.replace(llama, **SERVES[feature])) is None
