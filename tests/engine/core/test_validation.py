"""The engine owns request validation: one rule per check, the same offline and over HTTP."""
import pytest
import tiny

from zhuzi import LLM, SamplingParams
from zhuzi.sampling_params import InvalidRequest


@pytest.fixture(scope="module")
def small_vocab_llm(tmp_path_factory):
    """A model whose vocabulary (1,000) is smaller than its tokenizer's (SmolLM2's 49,152), as a Qwen
    model's is larger: token ids are checked against the model, which is what can index them."""
    directory = tmp_path_factory.mktemp("qwen3")
    tiny.build("qwen3", directory)
    return LLM(str(directory), dtype="float32", kv_cache_memory="16MiB")


@pytest.mark.parametrize("param,prompt,params", [
    ("prompt", [5, 1000], {}),
    ("prompt", [], {}),
    ("logit_bias", [5], {"logit_bias": {1000: 1.0}}),
    ("stop_token_ids", [5], {"stop_token_ids": [4999]}),
])
def test_token_ids_the_model_cannot_read_are_refused_naming_the_field(small_vocab_llm, param, prompt, params):
    with pytest.raises(InvalidRequest) as info:
        small_vocab_llm.generate([prompt], SamplingParams(max_tokens=2, **params))
    assert info.value.param == param and param in str(info.value)
    assert not small_vocab_llm.engine.has_unfinished()


def test_the_largest_id_the_model_has_is_accepted(small_vocab_llm):
    out = small_vocab_llm.generate([[5, 999]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 2


def test_an_overlong_request_names_both_numbers_and_the_openai_code(small_vocab_llm):
    with pytest.raises(InvalidRequest) as info:
        small_vocab_llm.generate([[5] * 4000], SamplingParams(max_tokens=200))
    assert info.value.code == "context_length_exceeded" and "4096" in str(info.value)


def test_top_k_beyond_the_vocabulary_is_refused(small_vocab_llm):
    with pytest.raises(InvalidRequest) as info:
        small_vocab_llm.generate([[5]], SamplingParams(max_tokens=2, top_k=1001))
    assert info.value.param == "top_k" and "1000" in str(info.value)
    out = small_vocab_llm.generate([[5]], SamplingParams(max_tokens=2, top_k=1000, seed=1))[0]
    assert len(out.outputs[0].token_ids) == 2
