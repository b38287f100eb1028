"""SamplingParams: vLLM's names, and a ValueError naming the field for every out-of-range value."""
import pytest

from zhuzi import SamplingParams
from zhuzi.sampling_params import MIN_TEMPERATURE


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5),
    ("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("repetition_penalty", 0.0), ("min_tokens", -1),
    ("max_tokens", 0), ("logprobs", 21), ("prompt_logprobs", -1), ("logit_bias", {5: 101.0}), ("stop", [""]),
])
def test_out_of_range_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(ValueError, match="^min_tokens must not exceed max_tokens"):
        SamplingParams(min_tokens=10, max_tokens=5)


def test_normalised_forms():
    p = SamplingParams(stop="END", top_k=-1, logit_bias={"7": 2})
    assert (p.stop_strings, p.top_k, p.logit_bias) == (["END"], 0, {7: 2.0})
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=0.5).greedy


def test_tiny_temperatures_are_raised_to_the_floor_as_in_vllm():
    """Dividing logits by 1e-40 overflows to NaN; offline and HTTP users get the same floor."""
    p = SamplingParams(temperature=1e-6)
    assert p.temperature == MIN_TEMPERATURE == 0.01 and not p.greedy
