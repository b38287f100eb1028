"""Block manager policy on fake sequences (no model): reference counts, prefix hits, LRU eviction, no leaks;
with a KV connector, blocks evicted from the pool go to its host tier and come back with what they held."""
import random

import pytest
import torch
from fake_sequences import seq

from zhuzi.engine.core.kv.block_manager import FREED, BlockManager, block_hash, hash_chain
from zhuzi.engine.core.kv.connector import KVConnector, KVLayout

LAYOUT = KVLayout("model", "float32", "float32", None, num_layers=1, num_kv_heads=1, head_dim=2, block_size=4)


def connector(num_blocks: int, host_blocks: int) -> KVConnector:
    """A connector over a pool of num_blocks blocks (no model), with a host tier of host_blocks."""
    pool = torch.zeros(1, 2, num_blocks * 4, 1, 2)
    return KVConnector(LAYOUT, pool, host_bytes=host_blocks * LAYOUT.block_bytes)


def computed(blocks: BlockManager, s, n: int | None = None) -> None:
    """Allocate and 'compute' the first n tokens of s (all of them by default), as a step does."""
    n = s.num_tokens if n is None else n
    assert blocks.allocate_slots(s, n - s.num_computed_tokens)
    blocks.computed(s, n - s.num_computed_tokens)
    blocks.register_computed(s)
    blocks.slide(s)


def test_a_shared_prefix_is_found_and_its_blocks_counted_once_per_user():
    blocks = BlockManager(num_blocks=16, block_size=4)
    first = seq(list(range(13)))
    computed(blocks, first)  # 3 full blocks published, a fourth partly filled
    second = seq(list(range(12)) + [99, 98])
    hit = blocks.reuse_cached_prefix(second)
    assert hit == second.num_computed_tokens == 12 and second.block_table == first.block_table[:3]
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


def test_a_rewound_sequence_keeps_its_blocks_and_computes_its_tail_again_in_them():
    blocks = BlockManager(num_blocks=8, block_size=4)
    s = seq(list(range(10)))
    computed(blocks, s)
    blocks.keep_computed(s, 12)  # never more than it has
    assert s.num_computed_tokens == 10
    blocks.keep_computed(s, 6)
    assert s.num_computed_tokens == 6 and len(s.block_table) == 3
    assert blocks.allocate_slots(s, 4) and len(s.block_table) == 3


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


@pytest.mark.parametrize("host_blocks", [0, 8])
def test_no_block_leaks_under_random_admissions_and_frees(host_blocks):
    rng = random.Random(0)
    blocks = BlockManager(num_blocks=32, block_size=4, connector=connector(32, host_blocks) if host_blocks else None)
    shared = list(range(10))
    live = []
    for _ in range(300):
        if live and rng.random() < 0.4:
            blocks.free_sequence(live.pop(rng.randrange(len(live))))
            continue
        s = seq(shared[:rng.randint(1, 10)] + [rng.randint(500, 600) for _ in range(rng.randint(1, 12))])
        blocks.reuse_cached_prefix(s)
        if blocks.allocate_slots(s, s.num_tokens - s.num_computed_tokens):
            blocks.computed(s, s.num_tokens - s.num_computed_tokens)
            blocks.register_computed(s)
            live.append(s)
        else:
            blocks.free_sequence(s)
        in_use = {b for x in live for b in x.block_table}
        assert blocks.num_free_blocks == 32 - len(in_use)
    for s in live:
        blocks.free_sequence(s)
    assert blocks.num_free_blocks == 32 and all(b.ref_count == 0 for b in blocks.blocks)


def test_evicted_blocks_go_to_the_host_tier_which_keeps_the_latest_and_gives_them_back_filled():
    tier = connector(4, host_blocks=2)
    blocks = BlockManager(num_blocks=4, block_size=4, connector=tier)
    prompts = [list(range(100 * k, 100 * k + 5)) for k in range(1, 6)]  # a full block and one more token each
    for k, prompt in enumerate(prompts, 1):
        s = seq(prompt)
        computed(blocks, s)
        tier.write(s.block_table[0], torch.full(LAYOUT.block_shape, float(k)))  # what its first block "holds"
        blocks.free_sequence(s)
    # The pool (4 blocks) keeps the last two prompts' blocks; it evicted the first three, oldest first, into a
    # host tier of two blocks, which kept the two it got last.
    assert [block_hash(None, p[:4]) in tier.host for p in prompts[:3]] == [False, True, True]
    assert tier.host.snapshot().evicted == 1
    again = seq(prompts[1] + [7])
    assert blocks.reuse_cached_prefix(again) == 4
    assert torch.equal(tier.read(again.block_table[0]), torch.full(LAYOUT.block_shape, 2.0))
    assert tier.host.snapshot().hit_tokens == 4 and blocks.prefix_hits == 0
    blocks.free_sequence(again)
    assert blocks.num_free_blocks == 4


def decoded(blocks: BlockManager, s, steps: int) -> None:
    """`steps` decode steps of s, one token each, as the scheduler runs them."""
    for _ in range(steps):
        s.token_ids.append(7)
        computed(blocks, s)


def test_a_sliding_window_sequence_holds_only_the_blocks_its_window_reaches():
    """Window 6, blocks of 4: the next token at position p reads p - 5 .. p, so at most three blocks are held."""
    blocks = BlockManager(num_blocks=16, block_size=4, window=6)
    s = seq(list(range(10)))
    computed(blocks, s, 10)  # the next token, at 10, reads 5 .. 10: block 0 is out of every window
    assert s.block_table[0] == FREED and FREED not in s.block_table[1:]
    for _ in range(30):
        decoded(blocks, s, 1)
        held = [b for b in s.block_table if b != FREED]
        assert len(held) <= 3 and s.block_table.index(held[0]) == (s.num_computed_tokens - 5) // 4
        assert blocks.num_free_blocks == 16 - len(held)
    blocks.free_sequence(s)
    assert blocks.num_free_blocks == 16 and all(b.ref_count == 0 for b in blocks.blocks)


def test_a_sliding_window_prompt_reuses_a_prefix_whose_window_blocks_are_in_the_pool():
    """A chat's second turn: the first turn's early blocks were given back and since evicted, yet its prefix is
    reused up to its last full block, since only the blocks the next token's window reaches need their K/V."""
    blocks = BlockManager(num_blocks=8, block_size=4, window=6)
    first = seq(list(range(10)))
    computed(blocks, first)
    decoded(blocks, first, 14)  # 24 tokens in 6 blocks: blocks 0 .. 3 given back along the way
    turn, hashes = list(first.token_ids), list(hash_chain(first.token_ids, 4))
    blocks.free_sequence(first)
    for k in range(3):  # other prompts take the 6 oldest free blocks: the 2 never used, then blocks 0 .. 3
        other = seq(list(range(500 + 10 * k, 508 + 10 * k)))
        computed(blocks, other)
        blocks.free_sequence(other)
    assert [h in blocks.cached for h in hashes] == [False] * 4 + [True] * 2
    again = seq(turn + [900, 901, 902])
    assert blocks.reuse_cached_prefix(again) == 24  # the next token, at 24, reads 19 ..: blocks 4 and 5
    assert again.block_table[:4] == [FREED] * 4 and FREED not in again.block_table[4:]
    blocks.free_sequence(again)
    assert blocks.num_free_blocks == 8


def test_a_sliding_window_prefix_is_not_reused_where_a_block_its_window_reads_was_evicted():
    blocks = BlockManager(num_blocks=6, block_size=4, window=6)
    first = seq(list(range(21)))
    computed(blocks, first)  # 5 full blocks and one token; the next token, at 21, reads 16 ..: 0 .. 3 given back
    hashes = list(hash_chain(first.token_ids, 4))
    blocks.free_sequence(first)
    other = seq(list(range(500, 516)))
    computed(blocks, other)  # takes the four oldest free blocks: blocks 0 .. 3 of the first prompt
    assert [h in blocks.cached for h in hashes] == [False] * 4 + [True]
    # 20 tokens would need block 3 (positions 15 ..), 16 blocks 2 and 3, fewer blocks 0 .. 2: all evicted
    again = seq(list(range(21)) + [5])
    assert blocks.reuse_cached_prefix(again) == 0 and not again.block_table
    blocks.free_sequence(other)
    assert blocks.num_free_blocks == 6
