"""Routing between data-parallel replicas, from the page hashes a real engine reports."""
from zhuzi import SamplingParams
from zhuzi.config import EngineConfig
from zhuzi.engine.core.engine_core import EngineCore
from zhuzi.engine.core.kv.page_manager import page_hash
from zhuzi.engine.front.router import LOAD_COST_TOKENS, PrefixRouter


def test_the_router_sees_exactly_the_prefix_an_engine_cached():
    engine = EngineCore(EngineConfig(kv_cache_memory="16MiB", page_size=16), kv_events=True)
    prompt = list(range(100, 180))  # 80 tokens: 4 full pages before the last token
    engine.add_request("a", prompt, SamplingParams(max_tokens=1))
    while engine.has_unfinished():
        engine.step()
    router = PrefixRouter(16)
    router.update(1, *engine.pages.events.take())
    assert router.cached_tokens(prompt, {0, 1}) == {0: 0, 1: 64}  # a prompt's last token is always computed
    assert router.cached_tokens(prompt[:40] + [7] * 40, {0, 1}) == {0: 0, 1: 32}  # diverges in page 3
    longer = prompt + [5, 6, 7]
    assert router.cached_tokens(longer, {0, 1}) == {0: 0, 1: 80}
    engine.add_request("b", longer, SamplingParams(max_tokens=1))
    while engine.has_unfinished():
        out = engine.step()
    assert out[0].num_cached_tokens == 80  # the engine agrees


def test_a_cached_prefix_wins_unless_the_replica_holding_it_is_busier():
    router = PrefixRouter(16)
    system = list(range(16))  # a page every chat starts with
    short = system + list(range(1000, 1160))  # 176 tokens of history
    long = system + list(range(2000, 2000 + LOAD_COST_TOKENS + 64))
    router.update(0, stored=hashes(short), removed=[])
    router.update(1, stored=hashes(long), removed=[])
    assert router.pick(short + [1, 2, 3], {0: 0, 1: 0}) == 0  # the conversation's history is there
    assert router.pick(long + [1, 2, 3], {0: 0, 1: 0}) == 1
    assert router.pick(short + [1, 2, 3], {0: 1, 1: 0}) == 1  # a short history is not worth a busier replica
    assert router.pick(long + [1, 2, 3], {0: 0, 1: 1}) == 1  # a long one is
    fresh_chat = system + [9] * 40
    assert router.pick(fresh_chat, {0: 0, 1: 0}) == 0  # a tie: the first
    assert router.pick(fresh_chat, {0: 1, 1: 0}) == 1  # one shared page draws nobody to a busy replica
    router.update(0, stored=[], removed=hashes(short)[1:])  # evicted but the first page
    assert router.cached_tokens(short + [1], {0, 1}) == {0: 16, 1: 16}
    router.forget(1)
    assert router.cached_tokens(long + [1], {0, 1}) == {0: 16, 1: 0}


def hashes(tokens: list[int]) -> list[bytes]:
    """The engine's chain of page hashes over tokens' full pages."""
    out: list[bytes] = []
    for start in range(0, len(tokens) - 15, 16):
        out.append(page_hash(out[-1] if out else None, tokens[start:start + 16]))
    return out
