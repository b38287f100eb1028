"""A hybrid model's state slots on fake sequences (no model): a running sequence holds a live and a boundary
slot, its boundary state joins the prefix cache at the prompt's end (before its last token, for a prompt that ships)
and when it ends, a prompt resumes only where a state is kept, cached states are evicted least recently used
first, after a speculative verify the slots of the states after the tokens that stand take the live and boundary
roles, and every slot comes back."""
from fake_sequences import seq

from zhuzi.engine.core.kv.page_manager import PageManager
from zhuzi.engine.core.kv.state_slots import StateSlots


def pool(slots: int = 6) -> PageManager:
    return PageManager(num_pages=32, page_size=4, states=StateSlots(slots))


def step(pages: PageManager, s, n: int) -> None:
    """A step computing n more of s's tokens."""
    assert pages.allocate_slots(s, n)
    pages.computed(s, n)
    pages.register_computed(s)


def assert_all_free(pages: PageManager) -> None:
    assert pages.states.num_free == pages.states.num_slots and not pages.states.holders


def test_a_sequence_holds_a_live_and_a_boundary_slot_which_come_back():
    pages = pool()
    s = seq(list(range(10)))
    step(pages, s, 6)
    assert (s.state_slot, s.boundary_slot, s.boundary_tokens) == (0, 1, 4) and pages.states.num_free == 4
    pages.free_sequence(s)
    assert (s.state_slot, s.boundary_slot) == (None, None)
    assert_all_free(pages)


def test_the_prompts_last_boundary_state_is_cached_at_its_end_and_a_prompt_resumes_there():
    pages = pool()
    first = seq(list(range(10)))
    step(pages, first, 6)
    step(pages, first, 4)  # the prompt is done: its state after 8 tokens is published, a fresh boundary slot taken
    assert len(pages.states.cached) == 1 and first.boundary_tokens == 0 and first.boundary_slot == 2
    second = seq(list(range(10)) + [50, 51, 52])
    assert pages.reuse_cached_prefix(second) == 8
    assert second.restore_slot == 1 and pages.states.holders[1] == 1  # held until the step that copies it
    step(pages, second, 5)
    assert second.restore_slot is None and 1 not in pages.states.holders
    for s in (first, second):
        pages.free_sequence(s)
    assert_all_free(pages)


def test_a_cached_prefix_without_a_state_at_its_end_is_cut_to_the_last_one_kept():
    pages = pool()
    first = seq(list(range(6)))
    step(pages, first, 6)  # its prompt's state after 4 tokens is cached
    for token in range(100, 107):  # decoding to 13 tokens: boundaries at 8 and 12
        first.token_ids.append(token)
        step(pages, first, 1)
    pages.free_sequence(first)  # its state after 12 tokens joins the cache too
    assert len(pages.states.cached) == 2
    resumed = seq(first.token_ids[:10] + [1, 2, 3])  # shares 10 tokens: 2 whole pages, a state after 4 only
    assert pages.reuse_cached_prefix(resumed) == 4 and len(resumed.page_table) == 1
    assert pages.prefix_hits == 4
    again = seq(first.token_ids[:13] + [9])
    assert pages.reuse_cached_prefix(again) == 12
    for s in (resumed, again):
        pages.free_sequence(s)
    assert_all_free(pages)


def test_a_prompt_that_ships_keeps_its_state_before_its_last_token_where_the_same_prompt_resumes():
    pages = pool()
    shipped = seq(list(range(8)))  # two whole pages, in two chunks: the first crosses the boundary at 4
    shipped.ships_prompt = True
    step(pages, shipped, 5)
    step(pages, shipped, 3)  # the prompt is done: its state after 4 tokens, not 8, is cached
    assert shipped.boundary_tokens == 0 and len(pages.states.cached) == 1
    again = seq(list(range(8)))
    assert pages.reuse_cached_prefix(again) == 4
    for s in (shipped, again):
        pages.free_sequence(s)
    assert_all_free(pages)


def test_cached_states_are_evicted_least_recently_used_first_and_held_ones_never():
    slots = StateSlots(3)
    a, b, c = (slots.take() for _ in range(3))
    assert slots.take() is None
    slots.publish(a, b"a")
    slots.publish(b, b"b")
    assert slots.hold(b"a") == a  # held: not evictable
    assert slots.take() == b and b"b" not in slots.cached  # the least recently used cached state goes
    assert slots.take() is None and slots.cached == {b"a": a}
    slots.release(a)
    slots.release(b)
    slots.release(c)
    slots.publish(slots.take(), b"a")  # the same state again: nothing new cached, its slot the first to reuse
    assert slots.cached == {b"a": a} and next(iter(slots.free)) != a


def test_without_a_free_pair_of_slots_a_sequence_waits():
    pages = pool(slots=3)
    running, waiting = seq(8), seq(8)
    step(pages, running, 4)
    assert not pages.allocate_slots(waiting, 4) and waiting.state_slot is None
    pages.free_sequence(running)
    assert pages.allocate_slots(waiting, 4)
    pages.free_sequence(waiting)
    assert_all_free(pages)


def test_after_a_verify_the_slots_holding_the_states_after_the_tokens_that_stand_take_their_roles():
    """A verify of 3 drafts leaves its state after draft j in draft slot j - 1, after its last token in the live
    slot, at a page boundary among them in the last draft slot (the model runner's state runs). Pages of 4 tokens,
    6 computed: the verify's tokens are at positions 6..9, its boundary after 8 tokens (its second)."""
    def verify(stand: int) -> tuple:
        pages = PageManager(num_pages=32, page_size=4, states=StateSlots(12), draft_slots=4)
        s = seq(list(range(7)))
        step(pages, s, 6)
        live, boundary, drafts = s.state_slot, s.boundary_slot, list(s.draft_slots)
        s.token_ids += [7, 8, 9]  # as the drafts that stand join
        assert pages.allocate_slots(s, 4)
        pages.computed(s, stand, drafts=3)
        roles = (s.state_slot, s.boundary_slot, s.boundary_tokens)
        pages.free_sequence(s)
        assert_all_free(pages)
        return roles, live, boundary, drafts

    roles, live, boundary, drafts = verify(4)  # every draft stands
    assert roles == (live, drafts[-1], 8)
    roles, live, boundary, drafts = verify(2)  # the boundary's token stands, the drafts after it not
    assert roles == (drafts[1], drafts[-1], 8)
    roles, live, boundary, drafts = verify(1)  # the boundary's token is rejected: the old boundary stays
    assert roles == (drafts[0], boundary, 4)
