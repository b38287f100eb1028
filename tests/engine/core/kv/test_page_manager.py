"""Page manager policy on fake sequences (no model): reference counts, prefix hits, LRU eviction, no leaks;
with a KV connector, pages evicted from the pool go to its host tier and come back with what they held."""
import random

import pytest
import torch
from fake_sequences import seq

from zhuzi.engine.core.kv.connector import KVConnector, KVLayout
from zhuzi.engine.core.kv.page_manager import FREED, PageManager, hash_chain, page_hash
from zhuzi.model.kv_pool import KVGroup, KVPool, KVShape

LAYOUT = KVLayout("model", "float32", "float32", None, groups=((1, 1, 2),), page_size=4)
SHAPE = KVShape((KVGroup((0,), kv_heads=1, head_dim=2),), entries=((0, 0),))


def connector(num_pages: int, host_pages: int) -> KVConnector:
    """A connector over a pool of num_pages pages (no model), with a host tier of host_pages."""
    pool = KVPool.zeros(SHAPE, num_pages * 4, torch.float32)
    return KVConnector(LAYOUT, pool, host_bytes=host_pages * LAYOUT.page_bytes)


def computed(pages: PageManager, s, n: int | None = None) -> None:
    """Allocate and 'compute' the first n tokens of s (all of them by default), as a step does."""
    n = s.num_tokens if n is None else n
    assert pages.allocate_slots(s, n - s.num_computed_tokens)
    pages.computed(s, n - s.num_computed_tokens)
    pages.register_computed(s)
    pages.slide(s)


def test_a_shared_prefix_is_found_and_its_pages_counted_once_per_user():
    pages = PageManager(num_pages=16, page_size=4)
    first = seq(list(range(13)))
    computed(pages, first)  # 3 full pages published, a fourth partly filled
    second = seq(list(range(12)) + [99, 98])
    hit = pages.reuse_cached_prefix(second)
    assert hit == second.num_computed_tokens == 12 and second.page_table == first.page_table[:3]
    assert [pages.ref_counts[b] for b in second.page_table] == [2, 2, 2]
    assert (pages.prefix_queries, pages.prefix_hits) == (14, 12)
    pages.free_sequence(first)
    assert [pages.ref_counts[b] for b in second.page_table] == [1, 1, 1]
    pages.free_sequence(second)
    assert pages.num_free_pages == 16


def test_the_last_prompt_token_is_always_recomputed():
    pages = PageManager(num_pages=8, page_size=4)
    computed(pages, seq(list(range(8))))
    again = seq(list(range(8)))  # the same 8 tokens: only the first page may be reused
    assert pages.reuse_cached_prefix(again) == 4


def test_without_prefix_caching_nothing_is_found():
    pages = PageManager(num_pages=8, page_size=4, enable_prefix_caching=False)
    computed(pages, seq(list(range(9))))
    assert pages.reuse_cached_prefix(seq(list(range(9)))) == 0 and not pages.cached


def test_a_rewound_sequence_keeps_its_pages_and_computes_its_tail_again_in_them():
    pages = PageManager(num_pages=8, page_size=4)
    s = seq(list(range(10)))
    computed(pages, s)
    pages.keep_computed(s, 12)  # never more than it has
    assert s.num_computed_tokens == 10
    pages.keep_computed(s, 6)
    assert s.num_computed_tokens == 6 and len(s.page_table) == 3
    assert pages.allocate_slots(s, 4) and len(s.page_table) == 3


def test_freed_cached_pages_stay_findable_until_evicted_least_recently_freed_first():
    pages = PageManager(num_pages=4, page_size=4)
    a, b = seq(list(range(100, 105))), seq(list(range(200, 205)))
    computed(pages, a)  # a full cached page + a partial tail page each
    computed(pages, b)
    pages.free_sequence(a)  # tails go first: LRU order a.tail, a.head, b.tail, b.head
    pages.free_sequence(b)
    assert pages.num_free_pages == 4 and len(pages.cached) == 2  # freed, still cached
    assert pages.allocate_slots(seq(list(range(300, 309))), 9)  # three pages: a's two, then b's tail

    def hit(prompt: list[int]) -> int:
        probe = seq(prompt)
        found = pages.reuse_cached_prefix(probe)
        pages.free_sequence(probe)
        return found

    assert hit(list(range(100, 105))) == 0  # evicted to make room
    assert hit(list(range(200, 205))) == 4  # freed last: still there
    assert len(pages.cached) == 1


def test_allocation_that_does_not_fit_changes_nothing():
    pages = PageManager(num_pages=2, page_size=4)
    s = seq(list(range(20)))
    assert not pages.allocate_slots(s, 20)
    assert s.page_table == [] and pages.num_free_pages == 2


@pytest.mark.parametrize("host_pages", [0, 8])
def test_no_page_leaks_under_random_admissions_and_frees(host_pages):
    rng = random.Random(0)
    pages = PageManager(num_pages=32, page_size=4, connector=connector(32, host_pages) if host_pages else None)
    shared = list(range(10))
    live = []
    for _ in range(300):
        if live and rng.random() < 0.4:
            pages.free_sequence(live.pop(rng.randrange(len(live))))
            continue
        s = seq(shared[:rng.randint(1, 10)] + [rng.randint(500, 600) for _ in range(rng.randint(1, 12))])
        pages.reuse_cached_prefix(s)
        if pages.allocate_slots(s, s.num_tokens - s.num_computed_tokens):
            pages.computed(s, s.num_tokens - s.num_computed_tokens)
            pages.register_computed(s)
            live.append(s)
        else:
            pages.free_sequence(s)
        in_use = {b for x in live for b in x.page_table}
        assert pages.num_free_pages == 32 - len(in_use)
    for s in live:
        pages.free_sequence(s)
    assert pages.num_free_pages == 32 and not any(pages.ref_counts)


def test_evicted_pages_go_to_the_host_tier_which_keeps_the_latest_and_gives_them_back_filled():
    tier = connector(4, host_pages=2)
    pages = PageManager(num_pages=4, page_size=4, connector=tier)
    prompts = [list(range(100 * k, 100 * k + 5)) for k in range(1, 6)]  # a full page and one more token each
    for k, prompt in enumerate(prompts, 1):
        s = seq(prompt)
        computed(pages, s)
        tier.write(s.page_table[0], torch.full(LAYOUT.page_shape, float(k)))  # what its first page "holds"
        pages.free_sequence(s)
    # The pool (4 pages) keeps the last two prompts' pages; it evicted the first three, oldest first, into a
    # host tier of two pages, which kept the two it got last.
    assert [page_hash(None, p[:4]) in tier.host for p in prompts[:3]] == [False, True, True]
    assert tier.host.snapshot().evicted == 1
    again = seq(prompts[1] + [7])
    assert pages.reuse_cached_prefix(again) == 4
    assert torch.equal(tier.read(again.page_table[0]), torch.full(LAYOUT.page_shape, 2.0))
    assert tier.host.snapshot().hit_tokens == 4 and pages.prefix_hits == 0
    pages.free_sequence(again)
    assert pages.num_free_pages == 4


def decoded(pages: PageManager, s, steps: int) -> None:
    """`steps` decode steps of s, one token each, as the scheduler runs them."""
    for _ in range(steps):
        s.token_ids.append(7)
        computed(pages, s)


def test_a_sliding_window_sequence_holds_only_the_pages_its_window_reaches():
    """Window 6, pages of 4: the next token at position p reads p - 5 .. p, so at most three pages are held."""
    pages = PageManager(num_pages=16, page_size=4, window=6)
    s = seq(list(range(10)))
    computed(pages, s, 10)  # the next token, at 10, reads 5 .. 10: page 0 is out of every window
    assert s.page_table[0] == FREED and FREED not in s.page_table[1:]
    for _ in range(30):
        decoded(pages, s, 1)
        held = [b for b in s.page_table if b != FREED]
        assert len(held) <= 3 and s.page_table.index(held[0]) == (s.num_computed_tokens - 5) // 4
        assert pages.num_free_pages == 16 - len(held)
    pages.free_sequence(s)
    assert pages.num_free_pages == 16 and not any(pages.ref_counts)


def test_a_sliding_window_prompt_reuses_a_prefix_whose_window_pages_are_in_the_pool():
    """A chat's second turn: the first turn's early pages were given back and since evicted, yet its prefix is
    reused up to its last full page, since only the pages the next token's window reaches need their K/V."""
    pages = PageManager(num_pages=8, page_size=4, window=6)
    first = seq(list(range(10)))
    computed(pages, first)
    decoded(pages, first, 14)  # 24 tokens in 6 pages: pages 0 .. 3 given back along the way
    turn, hashes = list(first.token_ids), list(hash_chain(first.token_ids, 4))
    pages.free_sequence(first)
    for k in range(3):  # other prompts take the 6 oldest free pages: the 2 never used, then pages 0 .. 3
        other = seq(list(range(500 + 10 * k, 508 + 10 * k)))
        computed(pages, other)
        pages.free_sequence(other)
    assert [h in pages.cached for h in hashes] == [False] * 4 + [True] * 2
    again = seq(turn + [900, 901, 902])
    assert pages.reuse_cached_prefix(again) == 24  # the next token, at 24, reads 19 ..: pages 4 and 5
    assert again.page_table[:4] == [FREED] * 4 and FREED not in again.page_table[4:]
    pages.free_sequence(again)
    assert pages.num_free_pages == 8


def test_a_sliding_window_prefix_is_not_reused_where_a_page_its_window_reads_was_evicted():
    pages = PageManager(num_pages=6, page_size=4, window=6)
    first = seq(list(range(21)))
    computed(pages, first)  # 5 full pages and one token; the next token, at 21, reads 16 ..: 0 .. 3 given back
    hashes = list(hash_chain(first.token_ids, 4))
    pages.free_sequence(first)
    other = seq(list(range(500, 516)))
    computed(pages, other)  # takes the four oldest free pages: pages 0 .. 3 of the first prompt
    assert [h in pages.cached for h in hashes] == [False] * 4 + [True]
    # 20 tokens would need page 3 (positions 15 ..), 16 pages 2 and 3, fewer pages 0 .. 2: all evicted
    again = seq(list(range(21)) + [5])
    assert pages.reuse_cached_prefix(again) == 0 and not again.page_table
    pages.free_sequence(other)
    assert pages.num_free_pages == 6
