"""gpt-oss (families/gpt_oss.py) against transformers: a tiny random GptOssForCausalLM (4 experts, top-2, a window
of 8 on every other layer, YaRN, sinks, biases, clamps that act) from its Hugging Face directory and from the
GGUF file llama.cpp's converter would write; its MXFP4 experts in both layouts; through the engine."""
import copy
import json
import shutil

import gguf
import numpy as np
import pytest
import tiny
import torch
from safetensors.torch import load_file, save_file
from test_decoder import full_logits

from zhuzi import LLM, SamplingParams
from zhuzi.model.blocks import BlockWeight
from zhuzi.model.decoder import Decoder
from zhuzi.model.fused import FusedDecode
from zhuzi.model.loader import load_checkpoint
from zhuzi.model.model_config import Mixer

pytestmark = pytest.mark.usefixtures("own_cache")

# Past the window of 8, and prompts of one page or less
PROMPTS = [list(range(3, 43)), list(range(3, 35)) + [900, 8, 77, 5], [5, 17, 300, 42, 9, 801, 77], [999] * 25]
MXFP4 = gguf.GGMLQuantizationType.MXFP4


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(transformers' model, its directory, its GGUF file)."""
    directory = tmp_path_factory.mktemp("gpt_oss")
    hf = tiny.build("gpt_oss", directory)
    return hf, directory, tiny.write_gguf(directory / "tiny.gguf", hf, "gpt_oss")


def hf_greedy(hf, ids: list[int], steps: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    return out[0, len(ids):].tolist()


def test_the_config_is_read_alike_from_the_directory_and_the_gguf(gpt_oss):
    _, directory, path = gpt_oss
    configs = [load_checkpoint(source, torch.float32).config for source in (directory, path)]
    for c in configs:
        assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.sliding_window) == (4, 2, 32, 8)
        assert c.layer_types == ["sliding_attention", "full_attention"]
        assert c.attention_sinks and c.attention_out_bias and c.expert_bias and c.expert_gating == "top_k_softmax"
        assert (c.rope_theta, c.rope_scaling["rope_type"], c.rope_scaling["factor"]) == (50000.0, "yarn", 32.0)
        assert (c.swiglu_alpha, c.swiglu_limit) == (1.702, 7.0)
    assert FusedDecode.refusal(configs[0]) == "experts"  # the fused step computes windows, not experts


def test_logits_match_transformers_from_the_directory_and_the_gguf(gpt_oss):
    hf, directory, path = gpt_oss
    for source in (directory, path):
        ckpt = load_checkpoint(source, torch.float32)
        ours = Decoder(ckpt.config, ckpt.tensors)
        assert [layer.spec.mixer for layer in ours.layers] == [Mixer.SLIDING_ATTENTION, Mixer.ATTENTION]
        assert ours.fused is None
        for ids in PROMPTS:
            with torch.no_grad():
                expected = hf(torch.tensor([ids])).logits[0]
            assert (full_logits(ours, ids) - expected).abs().max() < 1e-3


@pytest.mark.parametrize("source", ["directory", "gguf"])
def test_greedy_equals_transformers_batched_chunked_preempted_and_prefix_cached(gpt_oss, source):
    """A prompt alone, then every prompt in one batch in a pool too small for them all (preemptions), chunked
    16 tokens a step, the first two reading the first one's pages from the prefix cache: transformers' tokens."""
    hf, directory, path = gpt_oss
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [hf_greedy(hf, ids, 12) for ids in PROMPTS]
    # a token's KV: 2 layers x K and V x 2 heads x 16 floats = 512 bytes; 6 pages of 16 tokens
    llm = LLM(str(directory if source == "directory" else path), dtype="float32", page_size=16,
              max_num_batched_tokens=16, kv_cache_memory=str(6 * 16 * 512), enable_prefix_caching=True)
    alone = llm.generate([PROMPTS[0]], params)[0]
    hits = llm.engine.pages.prefix_hits
    together = llm.generate(PROMPTS, params)
    assert llm.engine.pages.prefix_hits > hits
    assert llm.engine.scheduler.num_preemptions > 0
    assert alone.outputs[0].token_ids == expected[0]
    assert [out.outputs[0].token_ids for out in together] == expected


def gguf_to_hf_mxfp4(blocks: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF MXFP4 blocks [..., K / 32 * 17] (an exponent, then element j in byte j's low nibble and j + 16 in its
    high one) -> transformers' (blocks [..., K / 32, 16]: elements 2b and 2b + 1 in byte b; scales [..., K / 32])."""
    b = blocks.reshape(*blocks.shape[:-1], -1, 17)
    codes = np.concatenate([b[..., 1:] & 0x0F, b[..., 1:] >> 4], -1)  # [..., K / 32, 32] in order
    return torch.from_numpy(codes[..., 0::2] | (codes[..., 1::2] << 4)), torch.from_numpy(b[..., 0].copy())


def test_mxfp4_experts_in_the_directory_and_the_gguf_hold_the_same_values(gpt_oss, tmp_path):
    """The experts quantized to MXFP4 once, then stored as transformers does (quant_method mxfp4: *_blocks and
    *_scales, gate and up rows interleaved) and as llama.cpp's converter does (ffn_*_exps MXFP4 blocks): both load
    to the same values, and give the logits of transformers' model holding those values."""
    hf, directory, _ = gpt_oss
    hf = copy.deepcopy(hf)  # its experts are set to the quantized values below
    converted = tiny.converter_tensors(hf)
    experts = {name: gguf.quants.quantize(t.numpy(), MXFP4) for name, t in converted.items()
               if ".mlp.experts." in name and name.endswith(".weight")}
    quantized = tmp_path / "mxfp4"
    shutil.copytree(directory, quantized, ignore=shutil.ignore_patterns("*.gguf"))
    stored = load_file(quantized / "model.safetensors")
    reference = {}
    for i in range(hf.config.num_hidden_layers):
        mlp = f"model.layers.{i}.mlp.experts"
        gate, up, down = (gguf_to_hf_mxfp4(experts[f"{mlp}.{p}_proj.weight"]) for p in ("gate", "up", "down"))
        del stored[f"{mlp}.gate_up_proj"], stored[f"{mlp}.down_proj"]
        stored[f"{mlp}.gate_up_proj_blocks"] = torch.stack([gate[0], up[0]], 2).flatten(1, 2)  # rows interleaved
        stored[f"{mlp}.gate_up_proj_scales"] = torch.stack([gate[1], up[1]], 2).flatten(1, 2)
        stored[f"{mlp}.down_proj_blocks"], stored[f"{mlp}.down_proj_scales"] = down
        values = {p: torch.from_numpy(gguf.quants.dequantize(experts[f"{mlp}.{p}_proj.weight"], MXFP4))
                  for p in ("gate", "up", "down")}
        reference[f"{mlp}.gate_up_proj"] = torch.stack([values["gate"], values["up"]], 2).flatten(1, 2).transpose(1, 2)
        reference[f"{mlp}.down_proj"] = values["down"].transpose(1, 2)
    save_file(stored, quantized / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (quantized / "config.json").write_text(json.dumps(config))
    raw = {name: (blocks, MXFP4) for name, blocks in experts.items()}
    path = tiny.write_gguf(tmp_path / "mxfp4.gguf", hf, "gpt_oss", raw=raw)

    from_directory = load_checkpoint(quantized, torch.float32)
    from_gguf = load_checkpoint(path, torch.float32)
    for name, weight in from_gguf.tensors.items():
        if ".mlp.experts." in name and name.endswith(".weight"):
            assert isinstance(weight, BlockWeight) and weight.qtype == MXFP4  # the file's blocks, as stored
            assert torch.equal(weight.dequantize(), from_directory.tensors[name])

    with torch.no_grad():
        for name, values in reference.items():
            hf.get_parameter(name).copy_(values)
        expected = [hf(torch.tensor([ids])).logits[0] for ids in PROMPTS[:2]]
    for ckpt in (from_directory, from_gguf):
        ours = Decoder(ckpt.config, ckpt.tensors)
        for ids, want in zip(PROMPTS, expected):
            assert (full_logits(ours, ids) - want).abs().max() < 1e-3
