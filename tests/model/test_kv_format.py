"""The KV pool's formats: q8_0 heads hold their values within half a quantization step, and a tiny model with a
q8_0 KV cache (--kv-cache-dtype q8_0) follows its float KV cache's tokens, gives the same greedy tokens alone or
batched, returns every page, and brings pages back from the host tier as computing gives them."""
import pytest
import tiny
import torch

from zhuzi import LLM, SamplingParams
from zhuzi.model.kv_format import dequantize_q8_0, head_width, quantize_q8_0

pytestmark = pytest.mark.long  # tiny engines: handed out first (tests/conftest.py)

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = [[5 + 7 * i + j for j in range(20 + 9 * i)] for i in range(4)]


def test_q8_0_heads_hold_their_values_within_half_a_step_of_their_block():
    x = torch.randn(5, 3, 64) * torch.tensor([0.01, 1.0, 300.0])[:, None]
    x[0, 0, :32] = 0  # an all-zero block stays zeros
    p = quantize_q8_0(x)
    assert p.dtype == torch.uint8 and p.shape == (5, 3, head_width(64, torch.uint8)) == (5, 3, 68)
    step = x.unflatten(-1, (2, 32)).abs().amax(-1, keepdim=True) / 127
    # half a step, and the fp16 rounding of the scale (2^-11 of it) times 127 steps
    bound = step * (0.5 + 127 * 2 ** -11) + 1e-30
    assert ((dequantize_q8_0(p) - x).unflatten(-1, (2, 32)).abs() <= bound).all()
    assert torch.equal(dequantize_q8_0(p)[0, 0, :32], torch.zeros(32))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("qwen2")
    tiny.build("qwen2", directory, num_attention_heads=2, num_key_value_heads=1)  # head_dim 32: one q8_0 block
    return str(directory)


def tokens(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_q8_0_kv_follows_float_kv(model):
    exact = LLM(model, dtype="float32", kv_cache_memory="8MiB")
    q8 = LLM(model, dtype="float32", kv_cache_memory="8MiB", kv_cache_dtype="q8_0")
    assert q8.engine.runner.kv_cache.dtype == torch.uint8
    # teacher-forced on the same prompt, every next-token logprob within 0.05 nats (worst seen 0.015)
    scored = SamplingParams(max_tokens=1, prompt_logprobs=0)
    for prompt in PROMPTS:
        a, b = (llm.generate([prompt], scored, use_tqdm=False)[0].prompt_logprobs[1:] for llm in (exact, q8))
        diffs = [abs(x[t].logprob - y[t].logprob) for t, x, y in zip(prompt[1:], a, b)]
        assert max(diffs) <= 0.05
    # greedy tokens the same until a near-tie (the first 8 of each here)
    assert [t[:8] for t in tokens(q8, PROMPTS)] == [t[:8] for t in tokens(exact, PROMPTS)]


def test_batching_never_changes_a_greedy_result_and_every_block_comes_back(model):
    # float32 (the per-layer path); the fused step's rows over q8_0 pools: tests/model/test_fused.py
    llm = LLM(model, dtype="float32", kv_cache_memory="8MiB", kv_cache_dtype="q8_0")
    batched = tokens(llm, PROMPTS)
    assert batched == [tokens(llm, [p])[0] for p in PROMPTS]
    pages = llm.engine.pages
    assert not llm.engine.has_unfinished() and pages.num_free_pages == pages.num_pages


def test_a_head_dim_q8_0_cannot_hold_is_a_one_line_error(tmp_path):
    tiny.build("qwen2", tmp_path)  # head_dim 16
    with pytest.raises(ValueError, match="^kv_cache_dtype q8_0 needs a head_dim that is a multiple of 32, not 16$"):
        LLM(str(tmp_path), kv_cache_dtype="q8_0", kv_cache_memory="8MiB")
