"""Scheduler policy on fake sequences (no model): who runs each step, with how many tokens."""
from fake_sequences import run_step, scheduler, seq

from zhuzi.engine.core.kv.page_manager import PageManager
from zhuzi.engine.core.scheduler import Scheduler
from zhuzi.engine.sequence import Status, StepOutcome


def tokens(batch) -> dict[int, int]:
    return {item.seq.seq_id: item.num_new_tokens for item in batch}


def test_a_step_never_exceeds_the_token_budget_and_decodes_come_first():
    s = scheduler(budget=32)
    first, second = seq(20), seq(20)
    s.add(first)
    s.add(second)
    batch = run_step(s)
    assert tokens(batch) == {first.seq_id: 20, second.seq_id: 12}  # the second prompt is chunked
    batch = run_step(s)
    # the first now decodes (one token, listed first); the second finishes its prompt beside it
    assert [(i.seq.seq_id, i.num_new_tokens) for i in batch] == [(first.seq_id, 1), (second.seq_id, 8)]
    assert all(sum(i.num_new_tokens for i in run_step(s)) <= 32 for _ in range(5))


def test_a_long_prompt_is_prefilled_in_chunks_of_the_budget():
    s = scheduler(num_pages=128, budget=64)
    long = seq(200)
    s.add(long)
    chunks = [tokens(run_step(s))[long.seq_id] for _ in range(4)]
    assert chunks == [64, 64, 64, 8]
    assert long.num_output_tokens == 1 and long.prompt_done


def test_the_long_prefill_cap_applies_only_while_others_decode():
    s = scheduler(num_pages=128, budget=64, long_prefill=16)
    alone = seq(100)
    s.add(alone)
    assert tokens(run_step(s))[alone.seq_id] == 64  # nobody decodes: no cap
    run_step(s)  # finishes the prompt; it now decodes
    late = seq(100)
    s.add(late)
    batch = tokens(run_step(s))
    assert batch == {alone.seq_id: 1, late.seq_id: 16}  # capped beside a running stream


def test_max_num_seqs_bounds_the_running_set():
    s = scheduler(max_num_seqs=2, budget=64)
    seqs = [seq(4) for _ in range(3)]
    for x in seqs:
        s.add(x)
    batch = run_step(s)
    assert len(batch) == 2 and len(s.running) == 2 and s.waiting[0] is seqs[2]


def test_when_the_pool_runs_short_the_newest_is_preempted_first_and_waits_first_in_line():
    s = scheduler(num_pages=6, page_size=4, budget=64)  # 24 slots
    old, mid, new = seq(7), seq(7), seq(7)
    for x in (old, mid, new):
        s.add(x)
    run_step(s)  # 2 pages each: the pool is full
    assert s.pages.num_free_pages == 0
    for _ in range(2):  # each sequence reaches 9 tokens and needs a third page
        run_step(s)
    assert new.status is Status.WAITING and new.num_preemptions == 1
    assert old.status is mid.status is Status.RUNNING
    assert s.waiting[0] is new and new.page_table == [] and new.num_computed_tokens == 0
    assert s.num_preemptions == 1


def test_finishing_returns_every_page():
    s = scheduler(num_pages=16, page_size=4)
    seqs = [seq(9) for _ in range(3)]
    for x in seqs:
        s.add(x)
    run_step(s)
    run_step(s)
    for x in seqs:
        s.finish(x, "stop")
    assert s.pages.num_free_pages == 16 and not s.running and not s.waiting


def test_a_steps_bookkeeping_counts_standing_drafts_and_finishes_who_ended():
    """update_from_output: computed tokens count the drafts that stood (not the rejected ones), the full pages
    reach the prefix cache, and a sequence that ended gives its pages back."""
    s = Scheduler(PageManager(64, 4), 8, 64, spec_step_tokens=8)
    drafted, ending = seq(7), seq(7)
    for x in (drafted, ending):
        s.add(x)
    run_step(s)  # both prompts computed; each emitted a token: 8 tokens, 7 computed
    drafted.spec_token_ids = [1, 2, 3]
    batch = s.schedule()
    assert [(item.num_new_tokens, item.spec_token_ids) for item in batch] == [(4, [1, 2, 3]), (1, [])]
    drafted.token_ids += [1, 2, 9]  # two drafts stood, then a token of the target's own
    ending.token_ids.append(2)
    s.update_from_output(batch, StepOutcome(emitted={drafted.seq_id: 2, ending.seq_id: 0},
                                            finished=[(ending, "stop", None)]))
    assert drafted.num_computed_tokens == 7 + 1 + 2 and drafted.num_tokens == 11
    assert len(drafted.page_hashes) == 2  # pages [0, 4) and [4, 8) are full and computed: published
    assert ending.finished and ending.finish_reason == "stop" and ending.page_table == []
    assert s.running == [drafted] and s.pages.num_free_pages == 64 - 3
