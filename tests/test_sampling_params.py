"""SamplingParams: vLLM's names, and a ValueError naming the field for every out-of-range value."""
import pytest

from zhuzi import SamplingParams
from zhuzi.sampling_params import MIN_TEMPERATURE


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5),
    ("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("repetition_penalty", 0.0), ("min_tokens", -1),
    ("max_tokens", 0), ("logprobs", 21), ("prompt_logprobs", -1), ("logit_bias", {5: 101.0}), ("stop", [""]),
    # Values that once passed and then overflowed a tensor or a loop inside the engine's step.
    ("top_k", 2**64), ("seed", 2**64), ("seed", -(2**63) - 1), ("n", 129), ("n", 10**9), ("max_tokens", 2**63),
    ("min_tokens", 2**63), ("temperature", float("inf")), ("temperature", float("nan")),
    ("repetition_penalty", float("inf")), ("logit_bias", {5: float("nan")}),
    # Not numbers of the field's kind.
    ("top_k", 1.5), ("n", True), ("max_tokens", "5"), ("logprobs", 2.0), ("temperature", False),
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


def test_the_edges_of_each_range_are_accepted():
    SamplingParams(n=128, seed=2**63 - 1, top_k=2**31 - 1, max_tokens=2**31 - 1, logprobs=20, temperature=0)
    SamplingParams(seed=-(2**63), top_k=-1, top_p=5e-324, min_p=1.0, repetition_penalty=100.0)
