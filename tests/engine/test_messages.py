"""What crosses the process boundary (engine/messages.py): every field a request sets reaches
the engine core as it was set, structured-output constraints included, and a refusal comes back as the same
error, so the server still names the request field at fault."""
from __future__ import annotations

import dataclasses

import pytest

from zhuzi.engine.messages import (
    AddProbe,
    AddRequest,
    GiveUpHandoff,
    Handoff,
    Outputs,
    Refused,
    Unpinned,
    decode_command,
    decode_message,
    encode,
)
from zhuzi.engine.sequence import PinSpec, Probe, Tenant
from zhuzi.outputs import EngineStats, KVTierStats, PromptProgress, RequestOutput, TenantLoad
from zhuzi.sampling_params import InvalidRequest, SamplingParams, StructuredOutputError, StructuredOutputsParams

ORDERED_SCHEMA = {"type": "object", "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "string"},
                                                   "mid": {"type": "array", "items": {"type": "number"}}},
                  "required": ["zeta", "alpha"], "additionalProperties": False}
CONSTRAINTS = {
    "json schema": StructuredOutputsParams(json=ORDERED_SCHEMA, disable_additional_properties=True,
                                           whitespace_pattern=r"[ ]?"),
    "json schema as text": StructuredOutputsParams(json='{"type": "array", "maxItems": 3}',
                                                   disable_any_whitespace=True),
    "schema true": StructuredOutputsParams(json=True),
    "schema with an integer beyond 64 bits": StructuredOutputsParams(json={"type": "integer", "maximum": 10**30}),
    "regex": StructuredOutputsParams(regex=r"\d{3}-\d{4}"),
    "choice": StructuredOutputsParams(choice=["yes", "no", "ünïcode ✓"]),
    "grammar": StructuredOutputsParams(grammar='start: "a" | "b"'),
    "json_object": StructuredOutputsParams(json_object=True),
}


def every_field_set(constraint: StructuredOutputsParams) -> SamplingParams:
    return SamplingParams(
        n=3, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=-(2**63), presence_penalty=0.5,
        frequency_penalty=-0.5, repetition_penalty=1.2, logit_bias={0: -100.0, 49151: 2.5}, stop=["\n\n", "END"],
        stop_token_ids=[2, 7], include_stop_str_in_output=True, ignore_eos=True, min_tokens=2, max_tokens=None,
        logprobs=5, prompt_logprobs=1, skip_special_tokens=False, structured_outputs=constraint,
        bad_words=["Paris", " ünïcode"], allowed_token_ids=[0, 5, 49151], thinking_token_budget=7, priority=-(2**63))


def across(params: SamplingParams) -> SamplingParams:
    tenant = Tenant("key-3fa9c01b2e4d", 2.5)
    command = decode_command(encode(AddRequest.of("r-1", [1, 2, 49151], params, tenant)))
    assert isinstance(command, AddRequest)
    assert command.request_id == "r-1" and command.prompt_token_ids == [1, 2, 49151] and command.tenant == tenant
    return command.params


def test_the_sample_request_sets_every_field():
    """A field added to SamplingParams later must be added here too, or this fails: else nothing would
    show that it crosses the boundary."""
    params = every_field_set(CONSTRAINTS["regex"])
    unset = [f.name for f in dataclasses.fields(SamplingParams)
             if f.init and getattr(params, f.name) == getattr(SamplingParams(), f.name)]
    assert unset == []


@pytest.mark.parametrize("name", CONSTRAINTS)
def test_every_request_field_reaches_the_engine_core_as_set(name: str):
    params = every_field_set(CONSTRAINTS[name])
    received = across(params)
    assert received == params
    assert received.stop_strings == ["\n\n", "END"]  # derived again on the far side
    assert type(received.structured_outputs) is StructuredOutputsParams
    assert received.structured_outputs.key == params.structured_outputs.key  # the compiler's cache key: the same


def test_a_schema_keeps_its_property_order_and_the_sender_keeps_its_own():
    """Properties come out in the schema's order, so the order must survive; the text form the wire uses is
    the engine core's business, not the request's."""
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=ORDERED_SCHEMA))
    received = across(params)
    assert list(received.structured_outputs.json["properties"]) == ["zeta", "alpha", "mid"]
    assert params.structured_outputs.json is ORDERED_SCHEMA


def test_a_constraint_the_engine_refuses_comes_back_as_the_same_error():
    """The server renames a StructuredOutputError's field to the request's own (response_format..., tools.N...)."""
    refused = Refused.of("r-2", StructuredOutputError("json", "uniqueItems is not supported"))
    error = decode_message(encode(Outputs(0, [], [refused], core_stats(), [], []))).refused[0].error()
    assert isinstance(error, StructuredOutputError)
    assert (error.field, error.reason, error.param) == ("json", "uniqueItems is not supported",
                                                        "structured_outputs.json")


def test_other_refusals_keep_their_param_and_code():
    refused = Refused.of("r-3", InvalidRequest(None, "too long", "context_length_exceeded"))
    error = decode_message(encode(Outputs(0, [], [refused], core_stats(), [], []))).refused[0].error()
    assert type(error) is InvalidRequest and (error.param, error.code, str(error)) == (None, "context_length_exceeded",
                                                                                        "too long")
    plain = Refused.of("r-4", ValueError("prompt is not text"))
    assert type(plain.error()) is ValueError


def test_prefill_progress_and_each_tenants_load_come_back_as_sent():
    out = RequestOutput("r-5", None, [], [], False, prompt_progress=PromptProgress(256, 1000, 128))
    stats = dataclasses.replace(core_stats(), tenants=[TenantLoad("key-3fa9c01b2e4d", 3, 1), TenantLoad("", 1, 0)])
    message = decode_message(encode(Outputs(0, [out], [], stats, [], [])))
    assert message.outputs[0].prompt_progress == PromptProgress(256, 1000, 128)
    assert message.stats.tenants == stats.tenants


def core_stats() -> EngineStats:
    return EngineStats(*(0 for f in dataclasses.fields(EngineStats)
                         if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING))


def test_hand_offs_pins_and_kv_stats_cross_as_they_were_sent():
    """A request's part in a hand-off, a pin's probe, and the KV tiers' counts reach the other side whole."""
    command = decode_command(encode(AddRequest.of(
        "r-3#prefill", [1, 2], SamplingParams(max_tokens=1), handoff=Handoff("r-3", "ipc:///tmp/kv-1"))))
    assert command.handoff == Handoff("r-3", "ipc:///tmp/kv-1")
    probe = decode_command(encode(AddProbe("p-1", [1] * 16, Probe(pin=PinSpec("rules", 60.0)))))
    assert probe.probe.pin == PinSpec("rules", 60.0)
    assert decode_command(encode(GiveUpHandoff("r-3"))) == GiveUpHandoff("r-3")
    stats = dataclasses.replace(core_stats(), kv_tiers={"disk": KVTierStats(pages=3, hit_tokens=48)}, num_pins=1)
    unpinned = decode_message(encode(Unpinned(1, "u-1", True, stats)))
    assert unpinned.removed and unpinned.stats == stats and unpinned.stats.kv_tiers["disk"].hit_tokens == 48
