"""Block manager policy on fake sequences (no model): reference counts, prefix hits, LRU eviction, no leaks."""
import random

from fake_sequences import seq

from zhuzi.engine.block_manager import BlockManager


def computed(blocks: BlockManager, s, n: int | None = None) -> None:
    """Allocate and 'compute' the first n tokens of s (all of them by default)."""
    n = s.num_tokens if n is None else n
    assert blocks.allocate_slots(s, n - s.num_computed_tokens)
    s.num_computed_tokens = n
    blocks.register_computed(s)


def test_a_shared_prefix_is_found_and_its_blocks_counted_once_per_user():
    blocks = BlockManager(num_blocks=16, block_size=4)
    first = seq(list(range(13)))
    computed(blocks, first)  # 3 full blocks published, a fourth partly filled
    second = seq(list(range(12)) + [99, 98])
    hit = blocks.reuse_cached_prefix(second)
    assert hit == 12 and second.block_table == first.block_table[:3]
    assert [blocks.blocks[b].ref_count for b in second.block_table] == [2, 2, 2]
    assert (blocks.prefix_queries, blocks.prefix_hits) == (14, 12)
    blocks.free_sequence(first)
    assert [blocks.blocks[b].ref_count for b in second.block_table] == [1, 1, 1]
    blocks.free_sequence(second)
    assert blocks.num_free_blocks == 16


def test_the_last_prompt_token_is_always_recomputed():
    blocks = BlockManager(num_blocks=8, block_size=4)
    computed(blocks, seq(list(range(8))))
    again = seq(list(range(8)))  # the same 8 tokens: only the first block may be reused
    assert blocks.reuse_cached_prefix(again) == 4


def test_without_prefix_caching_nothing_is_found():
    blocks = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    computed(blocks, seq(list(range(9))))
    assert blocks.reuse_cached_prefix(seq(list(range(9)))) == 0 and not blocks.cached


def test_freed_cached_blocks_stay_findable_until_evicted_least_recently_freed_first():
    blocks = BlockManager(num_blocks=4, block_size=4)
    a, b = seq(list(range(100, 105))), seq(list(range(200, 205)))
    computed(blocks, a)  # a full cached block + a partial tail block each
    computed(blocks, b)
    blocks.free_sequence(a)  # tails go first: LRU order a.tail, a.head, b.tail, b.head
    blocks.free_sequence(b)
    assert blocks.num_free_blocks == 4 and len(blocks.cached) == 2  # freed, still cached
    assert blocks.allocate_slots(seq(list(range(300, 309))), 9)  # three blocks: a's two, then b's tail

    def hit(prompt: list[int]) -> int:
        probe = seq(prompt)
        found = blocks.reuse_cached_prefix(probe)
        blocks.free_sequence(probe)
        return found

    assert hit(list(range(100, 105))) == 0  # evicted to make room
    assert hit(list(range(200, 205))) == 4  # freed last: still there
    assert len(blocks.cached) == 1


def test_allocation_that_does_not_fit_changes_nothing():
    blocks = BlockManager(num_blocks=2, block_size=4)
    s = seq(list(range(20)))
    assert not blocks.allocate_slots(s, 20)
    assert s.block_table == [] and blocks.num_free_blocks == 2


def test_no_block_leaks_under_random_admissions_and_frees():
    rng = random.Random(0)
    blocks = BlockManager(num_blocks=32, block_size=4)
    shared = list(range(10))
    live = []
    for _ in range(300):
        if live and rng.random() < 0.4:
            blocks.free_sequence(live.pop(rng.randrange(len(live))))
            continue
        s = seq(shared[:rng.randint(1, 10)] + [rng.randint(500, 600) for _ in range(rng.randint(1, 12))])
        s.num_computed_tokens = blocks.reuse_cached_prefix(s)
        if blocks.allocate_slots(s, s.num_tokens - s.num_computed_tokens):
            s.num_computed_tokens = s.num_tokens
            blocks.register_computed(s)
            live.append(s)
        else:
            blocks.free_sequence(s)
        in_use = {b for x in live for b in x.block_table}
        assert blocks.num_free_blocks == 32 - len(in_use)
    for s in live:
        blocks.free_sequence(s)
    assert blocks.num_free_blocks == 32 and all(b.ref_count == 0 for b in blocks.blocks)
