"""Mixture-of-Experts (Mixtral, Qwen2-MoE, Qwen3-MoE: 4 experts, top-2) against transformers, from a Hugging Face
directory and from the GGUF file llama.cpp's converter would write; a step reads only the experts it runs."""
import gguf
import pytest
import tiny
import torch
import transformers
from test_decoder import full_logits

from zhuzi import LLM, SamplingParams
from zhuzi.model.decoder import Decoder
from zhuzi.model.linear import BlockLinear, Linear
from zhuzi.model.loader import CheckpointError, gguf_weights, load_checkpoint, load_model_config
from zhuzi.model.moe import ClampedSwiGLU, MoE

# The GGUF files written here are packed into the module's own cache, not the user's.
pytestmark = pytest.mark.usefixtures("own_cache")

ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe"]
# As tiny.write_gguf writes them, so that the file and the directory are the same model.
SHAPE = dict(rope_theta=50000.0, rms_norm_eps=1e-5)
PROMPTS = [list(range(3, 43)), list(range(3, 35)) + [900, 8, 77, 5], [5, 17, 300, 42, 9, 801, 77], [999] * 25]
EXPERT_BYTES = 3 * 64 * 32 * 4  # float32 gate, up and down of one expert (hidden 64, width 32)


@pytest.fixture(scope="module", params=ARCHS)
def tiny_moe(request, tmp_path_factory):
    """(transformers' model, its directory, its GGUF file)."""
    arch = request.param
    directory = tmp_path_factory.mktemp(arch)
    hf = tiny.build(arch, directory, **SHAPE)
    return hf, directory, tiny.write_gguf(directory / "tiny.gguf", hf, arch)


def hf_greedy(hf, ids: list[int], steps: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    return out[0, len(ids):].tolist()


def test_logits_match_transformers_from_the_directory_and_the_gguf(tiny_moe):
    hf, directory, path = tiny_moe
    for source in (directory, path):
        ckpt = load_checkpoint(source, torch.float32)
        c = ckpt.config
        assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (4, 2, 32)
        assert c.moe_layers is None
        ours = Decoder(c, ckpt.tensors)
        assert ours.fused is None  # the fused step runs dense MLPs only
        for ids in PROMPTS:
            with torch.no_grad():
                expected = hf(torch.tensor([ids])).logits[0]
            assert (full_logits(ours, ids) - expected).abs().max() < 1e-3


def test_the_config_counts_every_expert_and_a_tokens_active_ones(tiny_moe):
    """num_parameters: every value of the file's matrices and norms (biases and q/k norms apart, as for the dense
    families); active_parameters: less the two experts of each layer a token does not run."""
    hf, _, path = tiny_moe
    c = load_model_config(path)
    values = sum(n for name, (_, _, n) in gguf_weights(path).items()
                 if not name.endswith(".bias") and ".q_norm." not in name and ".k_norm." not in name)
    assert c.num_parameters == values
    assert c.active_parameters == values - c.num_layers * 2 * 3 * 64 * 32


def test_a_file_without_an_experts_matrix_is_refused_by_name(tiny_moe, tmp_path):
    hf, _, _ = tiny_moe
    arch = hf.config.model_type
    path = tiny.write_gguf(tmp_path / "cut.gguf", hf, arch, drop=("blk.1.ffn_up_exps.weight",))
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.1\.mlp\.experts\.up_proj\.weight"):
        load_checkpoint(path)


def test_dense_layers_beside_sparse_ones(tmp_path):
    """Qwen's mlp_only_layers (and decoder_sparse_step) make some layers dense, as transformers builds them."""
    hf = tiny.build("qwen3_moe", tmp_path, layers=3, mlp_only_layers=[1])
    ckpt = load_checkpoint(tmp_path, torch.float32)
    assert ckpt.config.moe_layers == [0, 2]
    ours = Decoder(ckpt.config, ckpt.tensors)
    assert [layer.moe is not None for layer in ours.layers] == [True, False, True]
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPTS[0]])).logits[0]
    assert (full_logits(ours, PROMPTS[0]) - expected).abs().max() < 1e-3


def test_greedy_equals_transformers_alone_batched_chunked_and_prefix_cached(tiny_moe):
    """The GGUF file through the engine (the directory's: the next test). Grouping rows by expert changes no
    greedy result: a prompt alone, then every prompt in one batch, chunked 32 tokens a step, the first two
    reading the first one's pages from the prefix cache, give transformers' tokens."""
    hf, _, path = tiny_moe
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [hf_greedy(hf, ids, 12) for ids in PROMPTS]
    llm = LLM(str(path), dtype="float32", page_size=16, max_num_batched_tokens=32, kv_cache_memory="4MiB",
              enable_prefix_caching=True)
    alone = llm.generate([PROMPTS[0]], params)[0]
    hits = llm.engine.pages.prefix_hits
    together = llm.generate(PROMPTS, params)
    assert llm.engine.pages.prefix_hits > hits
    assert alone.outputs[0].token_ids == expected[0]
    assert [out.outputs[0].token_ids for out in together] == expected


def router_choices(hf, sequences: list[list[int]]) -> list[set[int]]:
    """Per sparse layer, the experts transformers' routers pick for the last token of any of the sequences."""
    chosen: list[set[int]] = []
    for ids in sequences:
        with torch.no_grad():
            logits = hf(torch.tensor([ids]), output_router_logits=True).router_logits
        for i, layer in enumerate(logits):
            if i == len(chosen):
                chosen.append(set())
            chosen[i] |= set(layer[-1].topk(2).indices.tolist())
    return chosen


def test_a_decode_step_reads_only_the_experts_its_rows_chose(tiny_moe):
    """The directory through the engine, its greedy tokens transformers'. A decode step of one sequence reads
    every weight but the unread embedding rows and the two experts of each sparse layer it did
    not choose. Several: the experts any of them chose, each once (one matmul over the rows that chose it)."""
    hf, directory, _ = tiny_moe
    llm = LLM(str(directory), dtype="float32", kv_cache_memory="4MiB")
    decoder, c = llm.engine.runner.model, llm.model_config
    sparse = [i for i in range(c.num_layers) if c.is_moe_layer(i)]
    every_weight = sum(t.nbytes for t in load_checkpoint(directory, torch.float32).tensors.values())
    unread_rows = (c.vocab_size - 1) * c.hidden_size * 4
    one_sequence = every_weight - unread_rows - len(sparse) * 2 * EXPERT_BYTES
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    assert not c.tie_word_embeddings
    llm.generate([PROMPTS[2]], params)  # its last step decodes one row
    assert decoder.step_weight_bytes == one_sequence == llm.weight_bytes_per_decode_step

    outs = llm.generate(PROMPTS, params)
    assert [out.outputs[0].token_ids for out in outs] == [hf_greedy(hf, ids, 3) for ids in PROMPTS]
    chosen = router_choices(hf, [ids + o.outputs[0].token_ids[:2] for ids, o in zip(PROMPTS, outs)])
    assert any(len(experts) > 2 for experts in chosen)  # the rows did not all choose the same two
    assert decoder.step_weight_bytes == one_sequence + sum(len(e) - 2 for e in chosen) * EXPERT_BYTES


def test_quantized_experts_stay_the_files_blocks(tmp_path):
    """A GGUF file's Q8_0 experts run as one block layer per expert, each its rows of the stacked blocks
    repacked at load (the same values, the file's bytes), and count their blocks' bytes; the logits stay close
    to the same blocks' exact values in float32."""
    arch = "qwen2_moe"
    hf = tiny.build(arch, tmp_path, **SHAPE)
    names = [n for n in tiny.converter_tensors(hf) if ".mlp.experts." in n]
    path = tiny.write_gguf(tmp_path / "q8.gguf", hf, arch, types=dict.fromkeys(names, gguf.GGMLQuantizationType.Q8_0))
    blocks = load_checkpoint(path, torch.bfloat16)
    model = Decoder(blocks.config, blocks.tensors, quantization="gguf")
    stacked = blocks.tensors["model.layers.0.mlp.experts.gate_proj.weight"]
    expert = model.layers[0].moe.experts[3]
    assert isinstance(expert.gate_up, BlockLinear) and isinstance(expert.down, BlockLinear)
    gate = expert.gate_up.parts[0]
    assert gate.packed and torch.equal(gate.dequantize(), stacked[3 * 32:4 * 32].dequantize())
    assert expert.nbytes == 3 * 64 * 32 // 32 * 34  # Q8_0: 34 bytes a block of 32
    reference = load_checkpoint(path, torch.float32)
    exact = Decoder(reference.config, reference.tensors)
    for ids in PROMPTS:
        ours, expected = full_logits(model, ids).float(), full_logits(exact, ids)
        assert (ours - expected).abs().max() < 0.05 * expected.abs().max()
        assert (ours.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9


def test_a_sigmoid_router_scores_each_expert_on_its_own():
    """A GGUF file's expert_gating_func 2: each expert's score is sigmoid(logit), not a share of a softmax; the top-k
    scores are the weights, renormalized where the file says."""
    torch.manual_seed(0)
    x, router = torch.randn(5, 8), torch.randn(4, 8)
    scores = torch.sigmoid(x @ router.T)
    for normalize in (False, True):
        moe = MoE(Linear(router), [], top_k=2, normalize=normalize, gating="sigmoid")
        weights, ids = moe.route(x)
        top = scores.topk(2, -1)
        assert torch.equal(ids, top.indices)
        expected = top.values / top.values.sum(-1, keepdim=True) if normalize else top.values
        assert torch.allclose(weights, expected)
        assert not torch.allclose(weights.sum(-1), torch.ones(5)) or normalize


def test_gpt_oss_routing_and_clamped_swiglu_equal_transformers():
    """A softmax over the top-k router logits (biased), and the clamped SwiGLU over interleaved gate and up, as
    transformers' GptOssTopKRouter and GptOssExperts compute them."""
    config = transformers.GptOssConfig(hidden_size=64, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                       num_hidden_layers=1, num_attention_heads=4, head_dim=16)
    router = transformers.models.gpt_oss.modeling_gpt_oss.GptOssTopKRouter(config)
    experts = transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.normal_(generator=g), router.bias.normal_(generator=g)
    x = torch.randn(20, 64, generator=g)
    gate_up = 6 * torch.randn(20, 64, generator=g)  # past the limit (7) both ways
    ours = MoE(Linear(router.weight.detach(), router.bias.detach()), [], 2, False, "top_k_softmax")
    weights, ids = ours.route(x)
    _, expected_weights, expected_ids = router(x)
    assert torch.equal(ids, expected_ids) and torch.allclose(weights, expected_weights, atol=1e-6)
    glu = ClampedSwiGLU(config.swiglu_alpha, config.swiglu_limit)
    assert torch.allclose(glu(gate_up[:, ::2], gate_up[:, 1::2]), experts._apply_gate(gate_up), atol=1e-6)


def test_gemma4_routing_equals_transformers():
    """Gemma 4's router: a softmax over the logits of its input RMS-normed without a weight, times its scale and
    hidden ** -1/2; the top-k renormalized, then each times its expert's factor, as transformers'
    Gemma4TextRouter computes them."""
    config = transformers.Gemma4TextConfig(hidden_size=64, num_experts=8, top_k_experts=3, enable_moe_block=True,
                                           moe_intermediate_size=16, num_hidden_layers=1)
    router = transformers.models.gemma4.modeling_gemma4.Gemma4TextRouter(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in (router.proj.weight, router.scale, router.per_expert_scale):
            p.normal_(generator=g)
    x = 3 * torch.randn(20, 64, generator=g)
    ours = MoE(Linear(router.proj.weight.detach()), [], 3, True, router_scale=router.scale.detach(),
               expert_scale=router.per_expert_scale.detach(), eps=config.rms_norm_eps)
    weights, ids = ours.route(x)
    _, expected_weights, expected_ids = router(x)
    assert torch.equal(ids, expected_ids) and torch.allclose(weights, expected_weights, atol=1e-6)
