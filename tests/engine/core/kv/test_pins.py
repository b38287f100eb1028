"""Pinned prefixes with a real model (tiny, float32): a pin keeps its pages in the pool under pressure
that evicts everything else (a hybrid model's pin its state too), within its bound, until it is deleted or
expires."""
import pytest
import tiny
from clock import Clock
from kv_load import GREEDY, PAGE_BYTES, POOL, ids, llm, push_out

from zhuzi import LLM
from zhuzi.engine.core.kv.page_manager import PageManager
from zhuzi.engine.core.kv.pins import PinTable
from zhuzi.engine.sequence import PinSpec
from zhuzi.model.loader import load_model_config
from zhuzi.sampling_params import InvalidRequest

PROMPT = ids(0) + ids(5, 5)  # 4 full pages of a system prompt, then a question


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> LLM:
    directory = tmp_path_factory.mktemp("llama")
    tiny.build("llama", directory)
    return llm(str(directory), kv_pinned_memory=4 * PAGE_BYTES)


def cached(engine: LLM) -> int:
    return engine.generate([PROMPT], GREEDY)[0].num_cached_tokens


def test_a_pinned_prefix_survives_pressure_that_evicts_it_unpinned_and_is_released_by_delete(engine):
    assert (cached(engine), cached(engine)) == (0, 64)
    push_out(engine)  # two prompts that take the pool of 12 pages whole: unpinned, the prefix is gone
    assert cached(engine) == 0
    pin = engine.pin("system", PROMPT[:64])
    assert (pin.name, pin.num_tokens, pin.num_pages, pin.bytes, pin.expires_at) == ("system", 64, 4, 4 * PAGE_BYTES,
                                                                                     None)
    assert pin.cached_tokens == 48  # the prompt just ran: its pages were in the pool (all but the last token's)
    stats = engine.engine.stats()
    assert (stats.num_pins, stats.pinned_pages, stats.pinned_bytes) == (1, 4, 4 * PAGE_BYTES)
    push_out(engine)
    push_out(engine)
    assert cached(engine) == 64
    assert [p.name for p in engine.pins()] == ["system"]
    assert engine.unpin("system") and not engine.unpin("system") and engine.pins() == []
    push_out(engine)
    assert cached(engine) == 0 and engine.engine.stats().pinned_pages == 0
    assert engine.engine.pages.num_free_pages == engine.engine.pages.num_pages  # every page came back


def test_pins_stay_within_their_bound_and_a_name_is_replaced_not_doubled(engine):
    engine.pin("a", PROMPT[:48])
    engine.pin("b", PROMPT[:64])  # shares a's 3 pages: 4 distinct pages in all
    assert engine.engine.stats().pinned_pages == 4
    with pytest.raises(InvalidRequest) as info:
        engine.pin("c", ids(9, 32))
    assert info.value.code == "pinned_memory_exceeded" and "kv_pinned_memory" in str(info.value)
    engine.pin("b", PROMPT[:32])  # replaces b: its 4th page is let go
    assert engine.engine.stats().pinned_pages == 3 and sorted(p.name for p in engine.pins()) == ["a", "b"]
    with pytest.raises(InvalidRequest, match="whole KV pages of 16 tokens"):
        engine.pin("short", PROMPT[:15])
    engine.unpin("a")
    engine.unpin("b")


def test_a_pin_expires_after_its_ttl(engine, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(engine.engine.kv.pins, "clock", clock)
    pin = engine.pin("brief", PROMPT[:32], ttl=60)
    assert (pin.created_at, pin.expires_at) == (clock.now, clock.now + 60)
    clock.now += 59
    engine.generate([ids(3, 20)], GREEDY)  # steps in its last second keep it
    assert engine.engine.stats().pinned_pages == 2 and [p.name for p in engine.pins()] == ["brief"]
    clock.now += 1
    engine.generate([ids(3, 20)], GREEDY)  # the next step lets it go
    assert engine.engine.stats().pinned_pages == 0 and engine.pins() == []


def test_a_request_that_only_the_unpinned_pool_could_not_hold_is_refused(engine):
    engine.pin("system", PROMPT[:64])
    with pytest.raises(InvalidRequest, match="64 of them pinned"):
        engine.generate([ids(3, 150)], GREEDY)  # 158 tokens: 10 pages of the 8 unpinned
    engine.unpin("system")
    assert engine.generate([ids(3, 150)], GREEDY)[0].outputs[0].token_ids


def test_pins_never_take_more_than_half_the_pool_whatever_the_flag_allows():
    pins = PinTable(PageManager(num_pages=12, page_size=16), None, PAGE_BYTES, limit_bytes=2**30)
    assert pins.limit_pages == 6 and pins.limit_bytes == 6 * PAGE_BYTES
    with pytest.raises(InvalidRequest, match="pinned prefixes would hold"):
        pins.check(PinSpec("big"), ids(4, 7 * 16), "token_ids")
    pins.check(PinSpec("fits"), ids(4, 6 * 16), "token_ids")


def test_an_engine_without_a_prefix_cache_refuses_pins():
    pins = PinTable(PageManager(num_pages=12, page_size=16, enable_prefix_caching=False), None, PAGE_BYTES,
                    limit_bytes=2**30)
    with pytest.raises(InvalidRequest, match="without"):
        pins.check(PinSpec("system"), ids(4, 32), "token_ids")


def test_a_hybrid_models_pin_keeps_the_state_after_its_last_page(tmp_path):
    tiny.build("qwen3_5", tmp_path)
    state_bytes = load_model_config(tmp_path).state_bytes
    # 4 state slots and 12 pages: the K/V of its one attention layer take PAGE_BYTES a page, as the llama's do
    hybrid = llm(str(tmp_path), kv_cache_memory=4 * state_bytes + POOL)
    assert (cached(hybrid), cached(hybrid)) == (0, 64)
    push_out(hybrid)  # unpinned, the prefix's pages and state are gone
    assert cached(hybrid) == 0
    pin = hybrid.pin("system", PROMPT[:64])
    assert pin.bytes == 4 * PAGE_BYTES + state_bytes
    push_out(hybrid)
    push_out(hybrid)
    again = hybrid.generate([PROMPT], GREEDY)[0]
    computed = llm(str(tmp_path), enable_prefix_caching=False).generate([PROMPT], GREEDY)[0]
    assert again.num_cached_tokens == 64 and again.outputs[0].token_ids == computed.outputs[0].token_ids
    hybrid.unpin("system")
    states = hybrid.engine.pages.states
    assert states.num_free == states.num_slots and hybrid.engine.stats().pinned_bytes == 0
