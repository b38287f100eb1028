"""Tests of the sampling step: logits -> processed logits -> tokens (+ logprobs)."""
from __future__ import annotations

import time

import pytest
import torch

from zhuzi.sample.sampler import Sampler, SamplingRow, make_generator, process_logits, token_logprobs
from zhuzi.sampling_params import SamplingParams

VOCAB = 49152  # SmolLM2's vocabulary
sampler = Sampler()


@pytest.fixture(autouse=True)
def fixed_global_rng():
    """Random logits and unseeded draws repeat from run to run, whatever tests ran before."""
    torch.manual_seed(0)


def row(output: list[int] | None = None, prompt: list[int] | None = None, stop_ids: list[int] | None = None,
        **params) -> SamplingRow:
    p = SamplingParams(max_tokens=None, **params)
    return SamplingRow(p, list(output or []), list(prompt or []), make_generator(p.seed),
                       list(stop_ids or []))


def steps(**params):
    """One sequence's rows, step after step: a new row each step (a row draws once), one generator."""
    first = row(**params)
    yield first
    while True:
        yield SamplingRow(first.params, [], [], first.generator, [])


def draws(logits: torch.Tensor, n: int, seed: int = 0, **params) -> torch.Tensor:
    """n tokens drawn from the one-row logits, as batches of identical rows (256 on a real vocabulary)."""
    torch.manual_seed(seed)
    batch = max(256, (1 << 20) // logits.shape[-1])
    tokens = []
    for start in range(0, n, batch):
        size = min(batch, n - start)
        tokens += sampler(logits.expand(size, -1), [row(**params) for _ in range(size)]).token_ids
    return torch.tensor(tokens)


def hand_made(vocab: int = VOCAB) -> torch.Tensor:
    """Seven likely tokens at scattered ids; the other ids share the last 1% of the mass."""
    probs = torch.full((vocab,), 0.01 / (vocab - 7))
    probs[HAND_IDS] = torch.tensor(HAND_PROBS)
    return probs.log()


HAND_PROBS = [0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.01]
HAND_IDS = [301, 17, 900, 256, 999, 12, 537]  # in order of probability


def test_greedy_is_argmax_for_any_float_dtype():
    logits = torch.randn(16, VOCAB)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = sampler(logits.to(dtype), [row(temperature=0) for _ in range(16)])
        assert out.token_ids == logits.to(dtype).argmax(-1).tolist()
        assert out.logprobs is None


def test_greedy_rows_see_the_processed_logits():
    logits = torch.zeros(2, 100)
    logits[:, 5] = 1.0
    out = sampler(logits, [row(temperature=0, logit_bias={9: 2.0}), row(temperature=0)])
    assert out.token_ids == [9, 5]


def test_top_k_1_is_greedy():
    logits = torch.randn(64, VOCAB) * 3
    out = sampler(logits, [row(temperature=1.0, top_k=1, seed=i) for i in range(64)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_same_seed_same_tokens_different_seeds_differ():
    logits = torch.randn(1, VOCAB)

    def run(seed: int) -> list[int]:
        rows = steps(temperature=1.0, seed=seed)
        return [sampler(logits, [next(rows)]).token_ids[0] for _ in range(10)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_seeded_row_ignores_the_rest_of_the_batch():
    logits = torch.randn(6, VOCAB)
    logits[:, torch.randperm(VOCAB)[:100]] += 8.0  # a nucleus of dozens of tokens, as real logits have
    params = dict(temperature=0.8, top_p=0.9, seed=1234)
    alone_rows = steps(**params)
    alone = [sampler(logits[:1], [next(alone_rows)]).token_ids[0] for _ in range(10)]
    seeded = steps(**params)
    others = [row(), row(temperature=0), row(seed=5, top_k=20), row(min_p=0.1), row(repetition_penalty=1.3)]
    batched = [sampler(logits, [next(seeded), *others]).token_ids[0] for _ in range(10)]
    assert batched == alone
    assert len(set(alone)) > 1  # it really sampled


def test_unseeded_rows_follow_the_global_rng():
    logits = torch.randn(8, VOCAB)
    torch.manual_seed(3)
    first = sampler(logits, [row() for _ in range(8)]).token_ids
    torch.manual_seed(3)
    assert sampler(logits, [row() for _ in range(8)]).token_ids == first


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_draws_follow_softmax_of_logits_over_temperature(temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0])
    n = 20000
    counts = torch.bincount(draws(logits, n, temperature=temperature), minlength=8).double()
    expected = (logits / temperature).softmax(-1).double() * n
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 30  # 7 degrees of freedom: exceeded with probability < 1e-4 by a correct sampler


def test_draws_follow_softmax_on_the_full_vocabulary():
    logits = hand_made()
    n = 2000
    counts = torch.bincount(draws(logits, n, temperature=1.0), minlength=VOCAB).double()
    observed = torch.cat([counts[HAND_IDS], (n - counts[HAND_IDS].sum()).reshape(1)])
    expected = torch.tensor(HAND_PROBS + [0.01], dtype=torch.float64) * n
    assert ((observed - expected) ** 2 / expected).sum().item() < 30


def allowed(*ranks: int) -> set[int]:
    return {HAND_IDS[r] for r in ranks}


@pytest.mark.parametrize("params, expected", [
    (dict(top_k=3), allowed(0, 1, 2)),
    (dict(top_p=0.3), allowed(0)),
    (dict(top_p=0.5), allowed(0, 1)),  # 0.4 < 0.5 <= 0.65
    (dict(top_p=0.85), allowed(0, 1, 2, 3)),  # 0.8 < 0.85 <= 0.9
    (dict(top_k=4, top_p=0.85), allowed(0, 1, 2)),  # top-p on the renormalized top 4: 0.72 < 0.85 <= 0.89
    (dict(min_p=0.3), allowed(0, 1, 2)),  # prob >= 0.12
    (dict(min_p=0.3, temperature=2.0), allowed(0, 1, 2, 3, 4)),  # ratios are square roots: sqrt(.05/.4) > .3
    (dict(top_k=5, min_p=0.3), allowed(0, 1, 2)),
])
def test_truncation_keeps_exactly_the_allowed_set(params, expected):
    seen = set(draws(hand_made(vocab=1000), 2000, **params).tolist())
    assert seen == expected


def test_each_row_of_a_mixed_batch_keeps_its_own_set():
    configs = [(dict(top_k=3), allowed(0, 1, 2)), (dict(top_p=0.5), allowed(0, 1)),
               (dict(min_p=0.3), allowed(0, 1, 2)), (dict(top_k=4, top_p=0.85), allowed(0, 1, 2)),
               (dict(temperature=0), allowed(0)), (dict(temperature=0.5, top_p=0.7), allowed(0, 1))]
    logits = hand_made().bfloat16()  # as a bf16 model hands them over
    seen = [set() for _ in configs]
    for _ in range(3):
        rows = [row(**configs[i % len(configs)][0]) for i in range(252)]
        for i, token in enumerate(sampler(logits.expand(len(rows), -1), rows).token_ids):
            seen[i % len(configs)].add(token)
    assert seen == [expected for _, expected in configs]


@pytest.mark.parametrize("top_p", [0.5, 0.95])
def test_wide_nucleus_is_cut_where_a_full_sort_cuts(top_p):
    # Thousands of near-equal tokens: the cut lies beyond the first candidate
    # sets, so this checks the paths that look further (up to the full sort).
    vocab = 5000
    logits = torch.cat([torch.linspace(0.5, 0.0, 4600), torch.full((vocab - 4600,), -4.0)])
    logits = logits[torch.randperm(vocab, generator=torch.Generator().manual_seed(0))]
    probs, order = logits.softmax(-1).sort(descending=True)
    mass_before = probs.cumsum(-1) - probs
    nucleus = order[mass_before < top_p]
    tokens = draws(logits, 1000, top_p=top_p)
    assert set(tokens.tolist()) <= set(nucleus.tolist())
    rank = {t: r for r, t in enumerate(order.tolist())}
    assert max(rank[t] for t in tokens.tolist()) > 0.99 * len(nucleus)  # nor cut short


def test_penalties_and_bias_change_logits_as_defined():
    logits = torch.tensor([[2.0, -1.0, 1.0, -2.0, 0.5, 0.0, 3.0, -0.5]] * 3)
    rows = [
        row(prompt=[0, 1], output=[2, 3, 3], repetition_penalty=2.0),
        row(prompt=[0, 1], output=[2, 3, 3, 3], frequency_penalty=0.5, presence_penalty=0.3),
        row(prompt=[5], output=[4], logit_bias={4: 1.5, 7: -0.5}, repetition_penalty=2.0),
    ]
    out = process_logits(logits, rows)
    # repetition: prompt and output tokens; positive divided, negative multiplied
    assert out[0].tolist() == [1.0, -2.0, 0.5, -4.0, 0.5, 0.0, 3.0, -0.5]
    # frequency * count + presence, output tokens only (the prompt's 0 and 1 untouched)
    assert out[1].tolist() == pytest.approx([2.0, -1.0, 1.0 - 0.8, -2.0 - 1.8, 0.5, 0.0, 3.0, -0.5])
    # bias first, then the penalty on the biased value: (0.5 + 1.5) / 2
    assert out[2].tolist() == [2.0, -1.0, 1.0, -2.0, 1.0, 0.0, 3.0, -1.0]
    assert logits[0, 0] == 2.0  # the input is left alone


def test_penalties_turn_a_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    assert sampler(logits, [row(output=[0], temperature=0, presence_penalty=0.2)]).token_ids == [1]
    assert sampler(logits, [row(output=[0], temperature=0, repetition_penalty=1.1)]).token_ids == [1]
    assert sampler(logits, [row(output=[0], temperature=0, frequency_penalty=0.05)]).token_ids == [0]


def test_allowed_token_ids_leave_nothing_else_greedy_or_drawn():
    logits = torch.tensor([[5.0, 1.0, 0.5, 4.0, 0.0]])
    assert sampler(logits, [row(temperature=0, allowed_token_ids=[1, 2])]).token_ids == [1]
    drawn = sampler(logits.expand(300, -1), [row(allowed_token_ids=[2, 4]) for _ in range(300)]).token_ids
    assert set(drawn) == {2, 4}
    assert sampler(logits, [row(temperature=0)]).token_ids == [0]  # the rule is the row's own


def test_a_bad_word_loses_its_last_token_only_where_the_output_holds_the_rest():
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0]])
    single, pair = row(temperature=0), row(temperature=0)
    single.params.bad_words_token_ids = [[2]]
    pair.params.bad_words_token_ids = [[1, 2]]
    assert sampler(logits, [single]).token_ids == [3]  # a one-token word is never written
    assert sampler(logits, [pair]).token_ids == [2]  # the output does not end with 1: token 2 is fine
    after = row(output=[0, 1], temperature=0)
    after.params.bad_words_token_ids = [[1, 2], [0, 0, 2]]
    assert sampler(logits, [after]).token_ids == [3]


def test_bad_words_become_their_tokens_at_a_start_and_after_a_space(smollm2_tokenizer):
    params = SamplingParams(bad_words=["Paris", " London town"])
    params.tokenize_bad_words(lambda text: smollm2_tokenizer.encode(text, add_special_tokens=False))
    encode = smollm2_tokenizer.hf.encode
    assert encode("Paris") in params.bad_words_token_ids and encode(" Paris") in params.bad_words_token_ids
    assert encode("London town") in params.bad_words_token_ids


def test_min_tokens_forbids_stop_ids_until_reached():
    logits = torch.zeros(1, 10)
    logits[0, 2] = 10.0  # EOS is by far the most likely
    stops = dict(stop_ids=[2, 7])
    early = row(output=[5], min_tokens=3, temperature=0, **stops)
    assert process_logits(logits, [early])[0, [2, 7]].tolist() == [float("-inf")] * 2
    assert sampler(logits, [early]).token_ids != [2]
    torch.manual_seed(0)
    sampled = [row(output=[5, 5], min_tokens=3, ignore_eos=True, **stops) for _ in range(500)]
    assert not {2, 7} & set(sampler(logits.expand(500, -1), sampled).token_ids)
    reached = row(output=[5, 5, 5], min_tokens=3, temperature=0, **stops)
    assert sampler(logits, [reached]).token_ids == [2]


def test_logprobs_come_from_the_raw_distribution():
    logits = torch.randn(4, VOCAB) * 2
    rows = [row(logprobs=5, temperature=0.7, repetition_penalty=1.5, output=[1, 2]),
            row(logprobs=0, temperature=0),
            row(),
            row(logprobs=20, top_k=3, seed=1)]
    out = sampler(logits, rows)
    raw = logits.log_softmax(-1)
    assert out.logprobs[2] is None
    for i, n in [(0, 5), (1, 0), (3, 20)]:
        entry, token = out.logprobs[i], out.token_ids[i]
        assert entry[token].logprob == pytest.approx(raw[i, token].item(), abs=1e-5)
        assert entry[token].rank == int((raw[i] > raw[i, token]).sum()) + 1
        top = raw[i].topk(n)
        assert set(entry) == set(top.indices.tolist()) | {token}
        for rank, (t, lp) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
            assert entry[t].rank == rank and entry[t].logprob == pytest.approx(lp, abs=1e-5)
        assert all(lp.decoded_token is None for lp in entry.values())
    assert list(out.logprobs[1]) == [out.token_ids[1]]


def test_token_logprobs_give_the_chosen_token_and_the_top_k_with_ranks():
    chosen = [9, 2, 7, 7]
    logits = torch.randn(len(chosen), 50)
    out = token_logprobs(logits, chosen, 3)
    raw = logits.log_softmax(-1)
    for j, entry in enumerate(out):
        assert entry[chosen[j]].logprob == pytest.approx(raw[j, chosen[j]].item(), abs=1e-6)
        assert entry[chosen[j]].rank == 1 + int((raw[j] > raw[j, chosen[j]]).sum())
        top3 = raw[j].topk(3).indices.tolist()
        assert all(entry[t].rank == r for r, t in enumerate(top3, start=1))
        assert set(entry) == set(top3) | {chosen[j]}


@pytest.mark.bench
def test_timing_mixed_batch_vs_greedy():
    """Prints what the sampler costs per step on the real vocabulary size (timings are not asserted: make bench)."""
    # Twenty favourite tokens per row, favoured from barely to strongly: nuclei
    # from thousands of tokens down to one, as a real model's rows vary.
    varied = torch.randn(64, VOCAB) * 2
    varied[:, :20] += torch.arange(4.0, 12.0).repeat(8)[:, None]
    flat = torch.randn(64, VOCAB)  # top-p nuclei of most of the vocabulary: every row needs a full sort
    variety = [dict(), dict(temperature=0.7, top_p=0.9), dict(temperature=0.8, top_k=40), dict(min_p=0.05),
               dict(temperature=0.6, top_p=0.95, top_k=50, repetition_penalty=1.1, seed=3),
               dict(temperature=0), dict(presence_penalty=0.5, frequency_penalty=0.5),
               dict(top_p=0.8, seed=9)]
    mixed = [row(output=list(range(i, i + 200)), prompt=list(range(500)), **variety[i % len(variety)])
             for i in range(64)]
    greedy = [row(temperature=0) for _ in range(64)]
    for name, logits, rows in [("all greedy", varied, greedy), ("mixed params", varied, mixed),
                               ("mixed params, flat logits (worst case)", flat, mixed)]:
        out = sampler(logits, rows)
        start = time.perf_counter()
        for _ in range(3):
            sampler(logits, rows)
        print(f"\nsampler 64 x {VOCAB}, {name}: {(time.perf_counter() - start) / 3 * 1e3:.1f} ms/step")
        plain_greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        assert [out.token_ids[i] for i in plain_greedy] == logits[plain_greedy].argmax(-1).tolist()


def test_a_top_p_too_small_for_float32_keeps_only_the_top_token():
    """5e-324 is a valid top_p in (0, 1] but 0 in float32: the nucleus is the top token, not an index error."""
    logits = torch.randn(3, VOCAB)
    out = sampler(logits, [row(top_p=5e-324, seed=i) for i in range(3)])
    assert out.token_ids == logits.argmax(-1).tolist()


# ------------------------------------------------------------------ grammar masks

def constrained_rows(grammars, count: int, every: int) -> list[SamplingRow]:
    """count rows, every `every`-th one held to a yes/no choice (the rest free)."""
    from zhuzi.sampling_params import StructuredOutputsParams

    choice = StructuredOutputsParams(choice=["yes", "no"])
    return [SamplingRow(SamplingParams(temperature=0), [], [], grammar=grammars.matcher(choice) if i % every == 0
                        else None) for i in range(count)]


def test_grammar_masks_touch_only_constrained_rows_and_allow_exactly_the_grammars_tokens(grammars,
                                                                                         smollm2_tokenizer):
    from zhuzi.sample.sampler import apply_grammar_masks

    logits = torch.randn(16, VOCAB)
    rows = constrained_rows(grammars, 16, 3)
    masked = logits.clone()
    apply_grammar_masks(masked, rows)
    # the first token of either choice, spelled any way: every token that is a prefix of one
    allowed = {i for i, text in enumerate(smollm2_tokenizer.token_bytes[:VOCAB])
               if text and (b"yes".startswith(text) or b"no".startswith(text))}
    for i, r in enumerate(rows):
        if r.grammar is None:
            assert torch.equal(masked[i], logits[i])
        else:
            assert set(torch.isfinite(masked[i]).nonzero().flatten().tolist()) == allowed
            assert torch.equal(masked[i, list(allowed)], logits[i, list(allowed)])
    tokens = sampler(logits.clone(), rows).token_ids
    assert all(tokens[i] in allowed for i in range(0, 16, 3))


def test_an_infinite_logit_stays_masked(grammars, smollm2_tokenizer):
    logits = torch.zeros(1, VOCAB)
    forbidden = smollm2_tokenizer.encode("zebra")[0]
    logits[0, forbidden] = float("inf")
    out = sampler(logits, constrained_rows(grammars, 1, 1))
    assert logits[0, forbidden] == float("-inf") and not logits.isnan().any()
    assert out.token_ids[0] != forbidden
