"""The offline API on the embedded SmolLM2 GGUF, against transformers on the same file."""
import gguf
import pytest
import torch

from zhuzi import LLM, SamplingParams
from zhuzi.model import cpu_blocks, native

pytestmark = pytest.mark.long  # a minute or more: handed out first (tests/conftest.py)

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a little",
           "The three primary colors are"]


# bf16 rounds every activation. On the same weights, teacher-forced on bf16's own greedy output, transformers in
# float32 finds each token bf16 picked within BF16_REGRET nats of its own best there, and the logprob zhuzi reports
# within BF16_LOGPROB nats of its own: about twice the worst seen over these prompts (regret 0.07, logprob 0.19,
# between the fused decode step and the per-layer path an AVX2-only CPU takes).
BF16_REGRET, BF16_LOGPROB = 0.15, 0.4
# The kernels quantize a GGUF's activation rows to int8 (as llama.cpp's dot products do): in float32 over the
# blocks the worst seen were regret 0.22 and logprob 0.30 (AVX-512, Zen 4).
Q8_REGRET, Q8_LOGPROB = 0.45, 0.6


@pytest.fixture(scope="module")
def llm32():
    return LLM(dtype="float32")


@pytest.fixture(scope="module")
def llm16():
    # bf16 over the file's values dense: the default computes on its Q4_1 blocks, whose greedy answers fork
    # from the dense ones at near-ties (llama.cpp's on the same file are those of the blocks: "L'Étoile, ...")
    return LLM(dtype="bfloat16", quantization="none")


def test_greedy_matches_transformers_on_the_gguf(llm32, hf_smollm2):
    outs = llm32.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, min_tokens=32))
    for prompt, out in zip(PROMPTS, outs):
        ids = llm32.tokenizer.encode(prompt)
        with torch.no_grad():
            ref = hf_smollm2.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, len(ids):].tolist(), prompt


def assert_greedy_within(llm: LLM, hf_smollm2, max_regret: float, max_logprob: float) -> None:
    """Every token llm's greedy path picks is, by transformers in float32 on the same weights (teacher-forced on
    llm's own output), within max_regret of the best token there, and the logprob zhuzi reports for it within
    max_logprob of transformers'."""
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0))
    for prompt, out in zip(PROMPTS, outs):
        ids, gen = llm.tokenizer.encode(prompt), out.outputs[0].token_ids
        with torch.no_grad():
            reference = hf_smollm2(torch.tensor([ids + gen])).logits[0, len(ids) - 1:-1].float().log_softmax(-1)
        chosen = reference[torch.arange(len(gen)), torch.tensor(gen)]
        regret = reference.max(-1).values - chosen
        ours = torch.tensor([lp[t].logprob for t, lp in zip(gen, out.outputs[0].logprobs)])
        assert float(regret.max()) <= max_regret and float((ours - chosen).abs().max()) <= max_logprob, prompt


def test_bf16_greedy_stays_within_a_stated_bound_of_transformers(llm16, hf_smollm2):
    """bf16's greedy path may fork from float32's at a near-tie, never far from transformers' best."""
    assert_greedy_within(llm16, hf_smollm2, BF16_REGRET, BF16_LOGPROB)


def test_float32_runs_the_file_dense_unless_its_blocks_are_asked_for(llm32, hf_smollm2):
    """float32 is the reference: a GGUF's exact values dense by default (transformers' own tokens, above).
    --quantization gguf keeps the file's blocks in float32 too: a fifth of the bytes a step, and greedy
    tokens within a stated bound of transformers'."""
    blocks = LLM(dtype="float32", quantization="gguf", kv_cache_memory="64MiB")
    assert (llm32.engine.weight_format, blocks.engine.weight_format) == ("none", "gguf")
    if not cpu_blocks.linear_serves(gguf.GGMLQuantizationType.Q4_1):
        pytest.skip("no kernel computes Q4_1 blocks here (no C++ compiler): they run dense")
    assert blocks.engine.weight_bytes_per_decode_step < llm32.engine.weight_bytes_per_decode_step / 4
    # The engine says whether a prompt's rows go through AMX tiles, and never where the CPU has none.
    paths = blocks.engine.kernel_paths
    v, amx = paths["variant"], "amx_int8" in native.cpu_features() and paths["variant"] == "avx512"
    assert paths["prefill_matmul"] in ((v, v + "+amx") if amx else (v,))
    assert_greedy_within(blocks, hf_smollm2, Q8_REGRET, Q8_LOGPROB)


def test_chat_answers_paris(llm16):
    out = llm16.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=30))[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # ended on <|im_end|>, not on the length limit


def test_generate_accepts_token_ids_and_one_params_per_prompt(llm32):
    ids = llm32.tokenizer.encode(PROMPTS[0])
    a, b = llm32.generate([ids, PROMPTS[0]], [SamplingParams(temperature=0, max_tokens=3),
                                              SamplingParams(temperature=0, max_tokens=5)])
    assert a.prompt_token_ids == b.prompt_token_ids == ids
    assert b.outputs[0].token_ids[:3] == a.outputs[0].token_ids
    assert (a.outputs[0].finish_reason, len(b.outputs[0].token_ids)) == ("length", 5)


def test_int8_weights_stay_close_to_bf16_and_sensible(llm16):
    """Int8 weights (per-output-channel scales, quantized at load; without native bf16 the activations meet them
    as q8 blocks too): the next-token distribution stays within a stated tolerance of bf16 and the answer is
    the same up to its first near-tie (on AVX2 the two continuations part at the sixth token, two nats below
    the best)."""
    prompt = "The capital of France is"
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5)
    bf16, int8 = llm16, LLM(quantization="int8")
    assert int8.weight_bytes_per_decode_step < 0.6 * bf16.weight_bytes_per_decode_step
    a, b = bf16.generate(prompt, params)[0].outputs[0], int8.generate(prompt, params)[0].outputs[0]
    same = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
    assert b.text.startswith(" Paris") and same >= 4  # " Paris." and its paragraph break, at least
    for step_a, step_b, token in zip(a.logprobs[:same], b.logprobs, a.token_ids):
        assert abs(step_a[token].logprob - step_b[token].logprob) < 0.25  # stated tolerance (nats)
        assert len(set(step_a) & set(step_b)) >= 3  # mostly the same top-5 candidates


# -- embeddings, on a tiny Qwen3 checkpoint against transformers ---------------------------------

EMBED_PROMPTS = ["The capital of France is Paris, a city on the Seine with many bridges and old streets.",
                 "def fibonacci(n):", "Once upon a time"]


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    import tiny
    path = tmp_path_factory.mktemp("embed") / "qwen3"
    return path, tiny.build("qwen3", path, vocab_size=49152)  # the real tokenizer's, so text embeds


def reference_states(model, tokenizer, prompt: str) -> torch.Tensor:
    """transformers' final hidden states (after the last norm) of prompt's tokens: [tokens, hidden]."""
    with torch.no_grad():
        return model.model(torch.tensor([tokenizer.encode(prompt)])).last_hidden_state[0]


def test_embed_is_the_final_hidden_state_mean_pooled_and_normalized(tiny_qwen3):
    path, model = tiny_qwen3
    # 8 tokens a step: the first prompt's state is summed over several chunks
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=8, kv_cache_memory="16MiB")
    for prompt, got in zip(EMBED_PROMPTS, llm.embed(EMBED_PROMPTS)):
        want = torch.nn.functional.normalize(reference_states(model, llm.tokenizer, prompt).mean(0), dim=0)
        assert got.shape == (64,) and abs(float(got.norm()) - 1) < 1e-5
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert llm.engine.pages.num_free_pages == llm.engine.pages.num_pages


def test_batching_and_the_prefix_cache_change_no_embedding(tiny_qwen3):
    llm = LLM(str(tiny_qwen3[0]), dtype="float32", kv_cache_memory="16MiB", deterministic=True)
    batch = llm.embed(EMBED_PROMPTS)
    for prompt, got in zip(EMBED_PROMPTS, batch):  # alone, and again once its pages sit in the prefix cache
        assert torch.equal(llm.embed(prompt)[0], got)
        assert torch.equal(llm.embed(llm.tokenizer.encode(prompt))[0], got)


def test_a_sentence_transformers_config_asking_for_the_last_token_is_followed(tiny_qwen3, tmp_path):
    path, model = tiny_qwen3
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text('{"pooling_mode_lasttoken": true}')
    try:
        llm = LLM(str(path), dtype="float32", kv_cache_memory="16MiB")
        assert LLM(str(path), dtype="float32", kv_cache_memory="16MiB", pooling="mean").embed(EMBED_PROMPTS[1])[0] \
            .sub(llm.embed(EMBED_PROMPTS[1])[0]).abs().max() > 1e-3
    finally:
        (path / "1_Pooling" / "config.json").unlink()
    (got,) = llm.embed(EMBED_PROMPTS[1])
    want = torch.nn.functional.normalize(reference_states(model, llm.tokenizer, EMBED_PROMPTS[1])[-1], dim=0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
