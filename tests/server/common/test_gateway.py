"""The gateway's rules on their own, with a hand-driven clock (the HTTP side is in test_server_gateway.py)."""
from __future__ import annotations

import re

import pytest
from clock import Clock

from zhuzi.server.common.gateway import ANONYMOUS, Gateway, GatewayError, key_id, retry_after_header


def refused(call, *args) -> GatewayError:
    with pytest.raises(GatewayError) as info:
        call(*args)
    return info.value


def test_without_keys_everyone_is_the_anonymous_caller() -> None:
    assert Gateway().authenticate(None) == ANONYMOUS


def test_keys_need_a_matching_bearer_header() -> None:
    gate = Gateway(api_keys=["k1", "k2"])
    assert gate.authenticate("Bearer k2") == "k2"
    assert gate.authenticate("bearer k1") == "k1"
    for header in [None, "", "Bearer", "Bearer k3", "Basic k1", "k1", "Bearer k1x"]:
        error = refused(gate.authenticate, header)
        assert (error.status, error.code) == (401, "invalid_api_key")


def test_anthropics_x_api_key_header_carries_a_key_too() -> None:
    gate = Gateway(api_keys=["k1", "k2"])
    assert gate.authenticate(None, "k2") == "k2"
    assert gate.authenticate("Basic k9", "k1") == "k1"  # no bearer: the other header decides
    for authorization, x_api_key in [(None, "k3"), (None, ""), ("Bearer k3", "k1")]:
        error = refused(gate.authenticate, authorization, x_api_key)
        assert (error.status, error.code) == (401, "invalid_api_key")


def test_requests_per_minute_refill_over_time() -> None:
    clock = Clock()
    gate = Gateway(rpm=3, clock=clock)
    for _ in range(3):
        gate.check_rate("a")
    error = refused(gate.check_rate, "a")
    assert (error.status, error.type) == (429, "requests")
    assert error.retry_after == pytest.approx(20.0)  # one request back every 60/3 s
    assert retry_after_header(error.retry_after) == "20"
    gate.check_rate("b")  # limits are per key
    clock.now += 20.0
    gate.check_rate("a")
    refused(gate.check_rate, "a")


def test_tokens_per_minute_charge_prompt_and_completion() -> None:
    clock = Clock()
    gate = Gateway(tpm=600, clock=clock)
    gate.check_rate("a")
    gate.charge_tokens("a", 500)  # the prompt, at admission
    gate.check_rate("a")  # 100 left: still allowed to start
    gate.charge_tokens("a", 400)  # completions, at the end: the bucket is now 300 in debt
    error = refused(gate.check_rate, "a")
    assert (error.status, error.type, error.code) == (429, "tokens", "rate_limit_exceeded")
    assert error.retry_after == pytest.approx(301 * 60 / 600)
    clock.now += int(retry_after_header(error.retry_after))  # a client that obeys the header gets in
    gate.check_rate("a")


def test_bounded_queue_refuses_at_once_and_frees_on_release() -> None:
    gate = Gateway(max_waiting=2)
    gate.batches["m"] = 2  # 4 places: 2 running, 2 waiting
    first = gate.admit(3, "m")
    error = refused(gate.admit, 2, "m")
    assert (error.status, error.code) == (429, "queue_full")
    second = gate.admit(1, "m")
    first.release()
    first.release()  # a second release (stream end + cleanup) frees nothing more
    assert gate.in_flight["m"] == 1
    gate.admit(3, "m")
    refused(gate.admit, 1, "m")
    second.release()
    assert gate.in_flight["m"] == 3
    error = refused(gate.admit, 5, "m")  # more than the whole queue: waiting would not help
    assert (error.status, error.code) == (400, "too_many_sequences")


def test_each_model_runs_its_own_batch_and_all_share_one_waiting_room() -> None:
    gate = Gateway(max_waiting=1)
    gate.batches.update(a=2, b=1)
    a = [gate.admit(1, "a") for _ in range(3)]  # a's batch, then the one place to wait
    assert refused(gate.admit, 1, "a").code == "queue_full"
    b = gate.admit(1, "b")  # b's engine is idle: a's queue does not hold it back
    assert refused(gate.admit, 1, "b").code == "queue_full"  # but a took the waiting room
    a[0].release()
    gate.admit(1, "b")  # waits in the room a left
    assert gate.waiting() == 1 and refused(gate.admit, 1, "a").code == "queue_full"
    b.release()
    assert gate.waiting() == 0 and refused(gate.admit, 3, "b").code == "too_many_sequences"


def test_each_key_is_a_tenant_known_by_a_stable_masked_id() -> None:
    gate = Gateway(api_keys=["sk-alice-0123456789", "sk-bob-9876543210"], weights={"sk-bob-9876543210": 2.5})
    alice, bob = gate.tenant("sk-alice-0123456789"), gate.tenant("sk-bob-9876543210")
    assert re.fullmatch(r"key-[0-9a-f]{12}", alice.id) and alice.id != bob.id
    assert alice.id == key_id("sk-alice-0123456789") == Gateway(api_keys=["sk-alice-0123456789"]).tenant(
        "sk-alice-0123456789").id  # the same across restarts: usage and metrics stay attached to it
    assert "alice" not in alice.id and (alice.weight, bob.weight) == (1.0, 2.5)
    assert Gateway().tenant(ANONYMOUS).id == ""  # without keys: one tenant
