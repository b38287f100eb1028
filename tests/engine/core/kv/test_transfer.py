"""Prefill/decode hand-offs between two real engines (tiny model, float32) in one process, the shipments passed
by hand as the engine cores' sockets would pass them: the decode engine streams the tokens one engine alone
gives, whether every page came, some did, or none (foreign ones are refused); a hybrid model's state comes with
its pages."""
import dataclasses

import msgspec
import pytest
import tiny
import zmq
from clock import Clock
from kv_load import GREEDY, ids

from zhuzi.config import EngineConfig
from zhuzi.engine.core.engine_core import EngineCore
from zhuzi.engine.core.kv import transfer
from zhuzi.engine.core.kv.transfer import Shipment
from zhuzi.engine.messages import Handoff, ShipmentHeader
from zhuzi.model.loader import load_model_config

PROMPT = ids(7, 120)  # 7 full pages before its last token


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> EngineConfig:
    directory = tmp_path_factory.mktemp("llama")
    tiny.build("llama", directory)
    return EngineConfig(model=str(directory), dtype="float32", kv_cache_memory=64 * 16 * 512)


@pytest.fixture(scope="module")
def alone(config) -> list[int]:
    engine = EngineCore(config)
    engine.add_request("r", PROMPT, GREEDY)
    return run(engine)["r"]


def run(engine: EngineCore) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    return tokens


@pytest.fixture(scope="module")
def shipments(config) -> list[Shipment]:
    """A prefill engine's shipments for PROMPT, 3 pages each."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(transfer, "PAGES_PER_SHIPMENT", 3)
        engine = EngineCore(config, kv_transfers=True)
        engine.add_request("r#prefill", PROMPT, GREEDY, handoff=Handoff("r", "ipc://decode"))
        run(engine)
    assert engine.stats().kv_transfers_sent == 1 and engine.stats().kv_transfer_pages_sent == 7
    return engine.kv.handoffs.take_outbox()


def deliver(engine: EngineCore, shipment: Shipment) -> None:
    frames = [zmq.Frame(bytes(f)) for f in shipment.frames()]
    header = msgspec.msgpack.decode(frames[0].bytes, type=ShipmentHeader)
    engine.kv.handoffs.receive(header, frames[1:])


def decode_engine(config: EngineConfig) -> EngineCore:
    engine = EngineCore(config, kv_transfers=True)
    engine.add_request("r", PROMPT, GREEDY, handoff=Handoff("r"))
    assert engine.has_unfinished() and not engine.has_work() and engine.step() == []  # it waits for the pages
    return engine


def test_a_hand_off_gives_the_tokens_one_engine_gives_and_computes_only_the_last_page(config, alone, shipments):
    assert [len(s.header.hashes) for s in shipments] == [3, 3, 1] and [s.header.last for s in shipments] == [
        False, False, True]
    engine = decode_engine(config)
    for shipment in shipments[:-1]:
        deliver(engine, shipment)
        assert not engine.has_work()
    deliver(engine, shipments[-1])
    assert run(engine)["r"] == alone
    stats = engine.stats()
    assert (stats.kv_transfers_received, stats.kv_transfer_pages_received, stats.kv_transfers_failed) == (1, 7, 0)
    assert stats.prefix_cache_hits == 7 * 16  # the shipped pages, found in its prefix cache


def test_a_hand_off_given_up_midway_computes_the_rest_with_the_same_tokens(config, alone, shipments):
    engine = decode_engine(config)
    deliver(engine, shipments[0])  # then the prefill replica died
    engine.kv.handoffs.give_up("r")
    assert run(engine)["r"] == alone
    stats = engine.stats()
    assert stats.kv_transfers_failed == 1 and stats.prefix_cache_hits == 3 * 16


def test_a_hand_off_whose_pages_never_come_is_given_up_after_wait_s(config, alone, monkeypatch):
    clock = Clock()
    engine = EngineCore(config, kv_transfers=True)
    monkeypatch.setattr(engine.kv.handoffs, "clock", clock)
    engine.add_request("r", PROMPT, GREEDY, handoff=Handoff("r"))
    clock.now += transfer.WAIT_S - 1
    assert engine.step() == [] and not engine.has_work()  # a second before the deadline: it still waits
    clock.now += 1
    given_up = engine.step()  # the step at the deadline lets the request go, and computes its prompt
    assert [t for out in given_up for t in out.outputs[0].token_ids] + run(engine)["r"] == alone
    stats = engine.stats()
    assert (stats.kv_transfers_failed, stats.prefix_cache_hits) == (1, 0)


def test_pages_of_another_model_are_refused_and_the_prompt_computed(config, alone, shipments, caplog):
    foreign = dataclasses.replace(shipments[0], header=msgspec.structs.replace(shipments[0].header, layout=b"x" * 16))
    engine = decode_engine(config)
    deliver(engine, foreign)
    assert "another model" in caplog.text
    assert run(engine)["r"] == alone and engine.stats().prefix_cache_hits == 0


def test_a_request_aborted_while_it_waits_ends_and_frees_everything(config):
    engine = decode_engine(config)
    out = engine.abort("r")
    assert out.finished and out.outputs[0].finish_reason == "abort" and not engine.has_unfinished()
    engine.step()
    assert engine.kv.handoffs.awaited == {} and engine.pages.num_free_pages == engine.pages.num_pages


def test_a_hybrid_models_state_comes_with_its_pages_and_the_decode_engine_computes_only_the_last_page(tmp_path):
    tiny.build("qwen3_5", tmp_path)
    budget = 6 * load_model_config(tmp_path).state_bytes + 64 * 16 * 512  # 6 state slots, 64 pages
    config = EngineConfig(model=str(tmp_path), dtype="float32", kv_cache_memory=budget)
    prompt = PROMPT[:64]  # whole pages: the decode engine resumes after 3, so the prefill job keeps the state there
    alone = EngineCore(config)
    alone.add_request("r", prompt, GREEDY)
    prefill = EngineCore(config, kv_transfers=True)
    prefill.add_request("r#prefill", prompt, GREEDY, handoff=Handoff("r", "ipc://decode"))
    run(prefill)
    (shipment,) = prefill.kv.handoffs.take_outbox()
    assert shipment.header.state == shipment.header.hashes[-1] and len(shipment.pages) == 4
    engine = EngineCore(config, kv_transfers=True)
    engine.add_request("r", prompt, GREEDY, handoff=Handoff("r"))
    deliver(engine, shipment)
    assert run(engine)["r"] == run(alone)["r"]
    assert engine.stats().prefix_cache_hits == 3 * 16  # the shipped pages, resumed from the shipped state
