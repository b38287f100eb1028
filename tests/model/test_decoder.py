"""Our forward pass against transformers' on the same weights, and paged KV against no cache."""
import pytest
import tiny
import torch

from zhuzi import LLM, SamplingParams
from zhuzi.model.attention import AttentionMetadata, PrefillChunk
from zhuzi.model.decoder import Decoder, LayerTap
from zhuzi.model.loader import load_checkpoint

EMPTY = torch.empty(0)


def full_logits(model: Decoder, ids: list[int], tap: LayerTap | None = None) -> torch.Tensor:
    """Logits of every position from one prefill with no cached prefix."""
    c, n = model.config, len(ids)
    kv = torch.zeros(c.num_layers, 2, n, c.num_kv_heads, c.head_dim, dtype=model.dtype)
    meta = AttentionMetadata(torch.arange(n), 0, EMPTY, EMPTY, [PrefillChunk(0, n, n, torch.arange(n))])
    with torch.inference_mode():
        return model.logits(model.forward(torch.tensor(ids), torch.arange(n), meta, kv, tap))


def greedy_without_cache(model: Decoder, ids: list[int], steps: int) -> list[int]:
    ids = list(ids)
    for _ in range(steps):
        ids.append(int(full_logits(model, ids)[-1].argmax()))
    return ids[-steps:]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny_pair(request, tmp_path_factory):
    arch = request.param
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 256}
    extra = {"rope_scaling": llama3} if arch == "llama" else {}
    directory = tmp_path_factory.mktemp(arch)
    hf = tiny.build(arch, directory, **extra)
    ckpt = load_checkpoint(directory, torch.float32)
    return hf, Decoder(ckpt.config, ckpt.tensors), directory


PROMPTS = [[5, 17, 300, 42, 9, 801, 77], list(range(3, 90, 2)), [999] * 3 + [4, 400, 40]]


def test_logits_match_transformers(tiny_pair):
    hf, ours, _ = tiny_pair
    for ids in PROMPTS:
        with torch.no_grad():
            expected = hf(torch.tensor([ids])).logits[0]
        assert (full_logits(ours, ids) - expected).abs().max() < 1e-3


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


def test_greedy_generation_matches_transformers(tiny_pair):
    hf, _, directory = tiny_pair
    llm = LLM(str(directory), dtype="float32", block_size=16)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, min_tokens=32))
    for ids, out in zip(PROMPTS, outs):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
        assert out.outputs[0].token_ids == expected[0, len(ids):].tolist()


def test_paged_kv_equals_recomputing_without_cache(tiny_pair):
    """Block size 16; a 44-token prompt plus 40 decode steps crosses five block boundaries."""
    _, ours, directory = tiny_pair
    llm = LLM(str(directory), dtype="float32", block_size=16)
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

