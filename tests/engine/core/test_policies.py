"""The scheduling policies on fake sequences (no model): who is served first, who gets how much of a step,
and whom a full pool or batch preempts."""
import random
from collections import Counter

import pytest
from fake_sequences import run_step, scheduler, seq

from zhuzi.engine.core.policies import FairShare, make_policy
from zhuzi.engine.sequence import Status


def served(batch) -> dict[int, int]:
    return {item.seq.seq_id: item.num_new_tokens for item in batch}


def per_tenant(batch) -> Counter:
    tokens = Counter()
    for item in batch:
        tokens[item.seq.tenant.id] += item.num_new_tokens
    return tokens


def add(s, *seqs):
    for x in seqs:
        s.add(x)
    return seqs


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="fcfs, priority, fair"):
        make_policy("lottery")


# ------------------------------------------------------------------ priority

def test_priority_serves_the_most_urgent_first_and_ties_in_arrival_order():
    s = scheduler(max_num_seqs=1, budget=64, policy="priority")
    seqs = add(s, seq(4, priority=1), seq(4, priority=0), seq(4, priority=1), seq(4, priority=0))
    admitted = []
    for _ in seqs:
        (item,) = run_step(s)
        admitted.append(item.seq)
        s.finish(item.seq, "stop")
    assert admitted == [seqs[1], seqs[3], seqs[0], seqs[2]]


def test_a_waiting_urgent_request_takes_the_batch_slot_of_the_lowest_priority():
    s = scheduler(max_num_seqs=2, budget=64, policy="priority")
    low, lowest = add(s, seq(4, priority=1), seq(4, priority=2))
    run_step(s)
    (urgent,) = add(s, seq(4, priority=0))
    assert urgent.seq_id in served(run_step(s))
    assert lowest.status is Status.WAITING and lowest.num_preemptions == 1 and lowest.page_table == []
    assert low.status is Status.RUNNING and low.num_preemptions == 0


def test_a_waiting_urgent_request_frees_kv_pages_lowest_priority_first():
    s = scheduler(num_pages=6, page_size=4, budget=64, policy="priority")  # 24 slots
    mid, low, lowest = add(s, seq(8, priority=1), seq(8, priority=2), seq(8, priority=3))
    run_step(s)
    assert s.pages.num_free_pages == 0
    (urgent,) = add(s, seq(12, priority=0))  # 3 pages: both the lowest's and the next one's
    batch = served(run_step(s))
    assert batch[urgent.seq_id] == 12
    assert [x.status for x in (mid, low, lowest)] == [Status.RUNNING, Status.WAITING, Status.WAITING]
    assert (mid.num_preemptions, low.num_preemptions, lowest.num_preemptions) == (0, 1, 1)


def test_equal_priority_never_preempts_its_way_in():
    s = scheduler(max_num_seqs=1, budget=64, policy="priority")
    first, second = add(s, seq(4, priority=1), seq(4, priority=1))
    for _ in range(3):
        assert list(served(run_step(s))) == [first.seq_id]
    assert second.status is Status.WAITING and first.num_preemptions == 0


def test_a_running_sequence_short_of_pages_preempts_the_lowest_priority_not_the_newest():
    s = scheduler(num_pages=6, page_size=4, budget=64, policy="priority")
    low, urgent = add(s, seq(7, priority=5), seq(7, priority=0))
    other = seq(7, priority=1)
    s.add(other)
    run_step(s)  # 2 pages each: the pool is full
    for _ in range(2):  # each reaches 9 tokens and needs a third page
        run_step(s)
    assert low.status is Status.WAITING and low.num_preemptions == 1
    assert urgent.status is other.status is Status.RUNNING


# ------------------------------------------------------------------ fair shares

def test_a_tenant_alone_gets_the_whole_step():
    s = scheduler(num_pages=256, budget=64, policy="fair")
    add(s, *[seq(40, tenant="a") for _ in range(4)])
    assert sum(per_tenant(run_step(s)).values()) == 64


def test_each_tenant_may_take_the_slowest_tenants_pace_plus_what_it_is_behind():
    policy = FairShare()
    policy.weights.update(a=1.0, b=1.0)
    policy.counters.update(a=0.0, b=0.0)
    assert policy.shares({"a": 500}, 64) is None  # alone
    assert policy.shares({"a": 500, "b": 0}, 64) is None  # b has nothing to do: a is alone
    assert policy.shares({"a": 500, "b": 300}, 64) == {"a": 300, "b": 300}
    assert policy.shares({"a": 500, "b": 1}, 64) == {"a": 1, "b": 1}  # a chat's one token a step holds a to one
    policy.counters.update(b=40.0)  # b's prompt went in: a makes that up, and b keeps its pace meanwhile
    assert policy.shares({"a": 500, "b": 1}, 64) == {"a": 41, "b": 1}
    policy.weights.update(a=3.0)  # 3 tokens of a count as one
    policy.counters.update(b=0.0)
    assert policy.shares({"a": 500, "b": 1}, 64) == {"a": 3, "b": 1}


def test_shares_converge_whatever_the_number_of_requests():
    s = scheduler(num_pages=2048, max_num_seqs=64, budget=48, policy="fair")
    add(s, *[seq(30, tenant="many") for _ in range(12)])
    add(s, seq(30, tenant="one"), seq(30, tenant="one"))
    totals = Counter()
    for _ in range(200):
        totals += per_tenant(run_step(s))
        assert abs(totals["many"] - totals["one"]) <= 48  # never more than one step's budget apart
    assert totals["one"] > 400


def test_weights_set_the_ratio_of_the_shares():
    s = scheduler(num_pages=2048, max_num_seqs=64, budget=48, policy="fair")
    add(s, *[seq(600, tenant="a", weight=3.0) for _ in range(6)])
    add(s, *[seq(600, tenant="b") for _ in range(6)])
    totals = Counter()
    for _ in range(40):
        totals += per_tenant(run_step(s))
        assert abs(totals["a"] / 3 - totals["b"]) <= 48
    assert totals["a"] + totals["b"] == 40 * 48 and totals["b"] > 400


def test_one_decoding_chat_holds_a_busy_tenant_to_one_token_a_step_in_turn():
    s = scheduler(num_pages=256, budget=64, policy="fair")
    busy = add(s, *[seq(4, tenant="batch") for _ in range(4)])
    run_step(s)  # alone: every prompt at once
    chat = seq(40, tenant="chat")
    s.add(chat)
    assert per_tenant(run_step(s)) == {"batch": 4, "chat": 40}  # the chat's prompt goes in at once
    for _ in range(40):  # the batch tenant catches up, then runs ahead until it leads by one step's budget
        run_step(s)
    turns = []
    for _ in range(8):
        batch = served(run_step(s))
        assert batch.pop(chat.seq_id) == 1 and list(batch.values()) == [1]
        turns += list(batch)
    assert Counter(turns) == {x.seq_id: 2 for x in busy}  # round robin: no request of the tenant stalls


def test_the_least_served_tenants_prompt_is_not_held_to_the_long_prefill_cap():
    """A chat's next turn comes back level with a busy tenant (idleness banks no credit) and its prompt goes in
    whole, as it would alone, beside the busy tenant's decoding streams, whose own new prompt waits that step;
    then the chat is ahead and the busy tenant's prompt goes in whole, the chat's next one waiting that step."""
    s = scheduler(num_pages=512, max_num_seqs=16, budget=256, long_prefill=16, policy="fair")
    busy = add(s, *[seq(4, tenant="batch") for _ in range(4)])
    run_step(s)  # alone: every prompt at once
    chat, late = seq(100, tenant="chat"), seq(100, tenant="batch")
    add(s, chat, late)
    first = served(run_step(s))
    assert first[chat.seq_id] == 100 and late.seq_id not in first and all(first[x.seq_id] == 1 for x in busy)
    longer = seq(200, tenant="chat")
    s.add(longer)
    second = served(run_step(s))
    assert second[late.seq_id] == 100 and second[chat.seq_id] == 1 and longer.seq_id not in second


def test_a_chats_next_turn_does_not_queue_behind_the_other_tenants_prompts():
    """For two steps after the chat's answer ends the busy tenant's new prompts wait while its streams decode
    on, so the chat's next turn, arriving then, finds a step of decodes ahead of it, not one full of prompts;
    then the busy tenant has the whole engine again. Its new prompts wait again in the step that carries the
    chat's prompt (here mostly in the prefix cache, so short)."""
    s = scheduler(num_pages=1024, max_num_seqs=16, budget=256, long_prefill=16, policy="fair")
    busy = add(s, *[seq(4, tenant="batch") for _ in range(4)])
    run_step(s)  # alone: every prompt at once
    turn = seq(list(range(40)), tenant="chat")
    s.add(turn)
    for _ in range(3):
        run_step(s)
    s.finish(turn, "stop")
    queued = add(s, seq(64, tenant="batch"), seq(64, tenant="batch"))
    for _ in range(2):
        assert served(run_step(s)) == {x.seq_id: 1 for x in busy}  # the chat is expected back
    assert per_tenant(run_step(s))["batch"] == 4 + 32  # it is not: two capped chunks of the new prompts
    nxt = seq(list(range(40)) + [7, 7, 7] + list(range(900, 920)), tenant="chat")
    s.add(nxt)
    step = served(run_step(s))
    assert step[nxt.seq_id] == 23 and all(step[x.seq_id] == 1 for x in busy)
    assert all(x.seq_id not in step for x in queued)


def test_no_tenant_starves():
    s = scheduler(num_pages=1024, max_num_seqs=16, budget=32, policy="fair")
    add(s, *[seq(200, tenant="a") for _ in range(10)], seq(20, tenant="b"), seq(90, tenant="c"))
    served_in = [set(per_tenant(run_step(s))) for _ in range(80)]
    for step in range(len(served_in) - 2):  # every tenant moves in any three steps in a row
        assert set.union(*served_in[step:step + 3]) == {"a", "b", "c"}, step


def test_a_light_tenant_preempts_the_heaviest_for_a_slot_and_is_not_preempted_back():
    s = scheduler(num_pages=256, max_num_seqs=4, budget=64, policy="fair")
    heavy = add(s, *[seq(4, tenant="heavy") for _ in range(4)])
    run_step(s)
    light = add(s, seq(4, tenant="light"), seq(4, tenant="light"))
    for _ in range(3):
        run_step(s)
    # light may hold no more than heavy: two swaps leave 2 and 2, a third would leave 3 and 1
    assert [x.status for x in light] == [Status.RUNNING, Status.RUNNING]
    assert sorted(x.num_preemptions for x in heavy) == [0, 0, 1, 1]
    for _ in range(5):
        run_step(s)
    assert sum(x.status is Status.RUNNING for x in heavy) == 2 and all(x.num_preemptions <= 1 for x in heavy)


def test_a_tenant_that_cannot_be_served_does_not_hold_the_others_back():
    s = scheduler(max_num_seqs=1, budget=8, policy="fair")
    (running,) = add(s, seq(4, tenant="running"))
    run_step(s)
    (queued,) = add(s, seq(4, tenant="queued"))  # no slot: it would hold as much as the only running one
    for _ in range(30):  # the queued tenant's counter stays put; the running one still moves every step
        assert served(run_step(s)) == {running.seq_id: 1}
    assert queued.status is Status.WAITING


def test_a_light_tenant_preempts_the_heaviest_for_kv_pages():
    s = scheduler(num_pages=8, page_size=4, budget=64, policy="fair")
    heavy = add(s, *[seq(7, tenant="heavy") for _ in range(4)])  # 2 pages each: the whole pool
    run_step(s)
    (light,) = add(s, seq(4, tenant="light"))
    run_step(s)
    assert light.status is Status.RUNNING
    assert sum(x.status is Status.WAITING for x in heavy) == 1


def test_a_tenant_back_from_idle_banks_no_credit():
    s = scheduler(num_pages=1024, budget=32, policy="fair")
    add(s, *[seq(400, tenant="a") for _ in range(2)])
    for _ in range(20):
        run_step(s)
    add(s, seq(400, tenant="b"))
    run_step(s)
    counters = s.policy.counters
    assert counters["b"] >= counters["a"] - 32  # it starts where the busy tenant is, not at 0


def test_priority_orders_requests_within_a_tenant_under_fair():
    s = scheduler(max_num_seqs=1, budget=64, policy="fair")
    late, urgent = add(s, seq(4, tenant="a", priority=1), seq(4, tenant="a", priority=0))
    (item,) = run_step(s)
    assert item.seq is urgent and late.status is Status.WAITING


@pytest.mark.parametrize("name", ["fcfs", "priority", "fair"])
def test_every_step_with_work_schedules_someone_within_the_budget_and_every_page_returns(name):
    """Random arrivals and ends on small pools and batches: no policy ever leaves the engine idle with work,
    which the server would see as a stall."""
    for trial in range(25):
        rng = random.Random(trial)
        s = scheduler(num_pages=rng.randint(8, 40), max_num_seqs=rng.randint(1, 6), budget=rng.randint(4, 40),
                      long_prefill=rng.choice([0, 4, 8]), policy=name)
        capacity, live = s.pages.num_pages * s.pages.page_size, []
        for _ in range(150):
            if rng.random() < 0.3:
                live.append(seq(rng.randint(1, 20), tenant=rng.choice("abc"), weight=rng.choice([1.0, 2.0]),
                                priority=rng.randint(0, 2) if name != "fcfs" else 0))
                s.add(live[-1])
            for x in list(live):  # as max_tokens would, a sequence ends before it outgrows the pool
                if x.num_tokens >= capacity or (x.num_output_tokens >= rng.randint(1, 12) and rng.random() < 0.5):
                    s.finish(x, "stop")
                    live.remove(x)
            batch = run_step(s)
            assert batch or not (s.running or s.waiting), (trial, len(s.running), len(s.waiting))
            assert sum(item.num_new_tokens for item in batch) <= s.max_num_batched_tokens
        for x in live:
            s.finish(x, "stop")
        assert s.pages.num_free_pages == s.pages.num_pages
