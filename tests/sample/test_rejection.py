"""rejection.verify keeps the target's distribution: the exact probability of every 3-token output of a toy
model against thousands of speculative draws (chi-square), with penalties, min_tokens, top-k/p/min-p and
bias on, for prompt-lookup (point-mass) and draft-model proposals; greedy verdicts; seeded draws."""
from __future__ import annotations

import itertools

import pytest
import torch
from chi_square import chi_square_p

from zhuzi.sample.rejection import Draft, verify
from zhuzi.sample.sampler import Sampler, SamplingRow, make_generator, sampling_probs
from zhuzi.sampling_params import SamplingParams

V, L = 6, 3  # vocabulary and output length of the toy: 216 possible outputs
PROMPT = [0, 1]
STOP = [4]
_gen = torch.Generator().manual_seed(1234)
A = torch.randn(V, V, generator=_gen) * 1.5
B = torch.randn(3, V, generator=_gen) * 0.5
C = A * 0.6 + torch.randn(V, V, generator=_gen)  # the draft model: related to the target, not equal

FULL = dict(temperature=0.9, top_k=5, top_p=0.95, min_p=0.02, repetition_penalty=1.3, frequency_penalty=0.5,
            presence_penalty=0.3, logit_bias={2: 0.7}, min_tokens=2)
PLAIN = dict(temperature=1.0)
N = 8000


def toy_logits(context: list[int]) -> torch.Tensor:
    """The target: the next token's logits depend on the last token and the length."""
    return A[context[-1]] + B[len(context) % 3]


def row(output: list[int], seed: int | None = None, **params) -> SamplingRow:
    return SamplingRow(SamplingParams(max_tokens=None, seed=seed, **params), output, list(PROMPT),
                       make_generator(seed), list(STOP))


def draft_probs(context: list[int]) -> torch.Tensor:
    """The draft model: top-4 of softmax(C[last]), so some tokens the target may emit get q = 0."""
    logits = C[context[-1]].clone()
    logits[logits < logits.topk(4).values[-1]] = float("-inf")
    return logits.softmax(-1)


def propose_point(context: list[int], k: int) -> tuple[list[int], None]:
    """Prompt-lookup-like: a fixed guess per context (the target's raw argmax chain)."""
    out = []
    for _ in range(k):
        out.append(int(toy_logits(context + out).argmax()))
    return out, None


def propose_model(context: list[int], k: int) -> tuple[list[int], torch.Tensor]:
    out, probs = [], []
    for _ in range(k):
        q = draft_probs(context + out)
        out.append(int(torch.multinomial(q, 1)))
        probs.append(q)
    return out, torch.stack(probs)


def generate(rows: list[SamplingRow], k: int, proposer, claimed_q=None) -> tuple[list[list[int]], torch.Tensor]:
    """L tokens for every row by speculative steps, all rows verified together each step. claimed_q replaces
    the draft distribution the verifier is told (to show the test can fail)."""
    outs: list[list[int]] = [[] for _ in rows]
    accepted = torch.zeros(k + 1, dtype=torch.long)  # how often 0..k drafts stood
    while active := [i for i, o in enumerate(outs) if len(o) < L]:
        drafts, logits = [], []
        for i in active:
            context = PROMPT + outs[i]
            tokens, probs = proposer(context, k)
            r = rows[i]
            drafts.append(Draft(SamplingRow(r.params, outs[i], r.prompt_token_ids, r.generator, r.stop_ids), tokens,
                                claimed_q(probs) if claimed_q else probs))
            logits += [toy_logits(context + tokens[:j]) for j in range(len(tokens) + 1)]
        for i, verdict in zip(active, verify(torch.stack(logits), drafts)):
            outs[i] = (outs[i] + verdict.token_ids)[:L]
            accepted[verdict.num_accepted] += 1
    return outs, accepted


def exact_distribution(**params) -> dict[tuple[int, ...], float]:
    """P(output) = product of the processed target probabilities, for every possible output."""
    out = {}
    for seq in itertools.product(range(V), repeat=L):
        p = 1.0
        for i in range(L):
            probs = sampling_probs(toy_logits(PROMPT + list(seq[:i]))[None], [row(list(seq[:i]), **params)])
            p *= float(probs[0, seq[i]])
        out[seq] = p
    return out


@pytest.fixture(autouse=True)
def fixed_rng():
    torch.manual_seed(0)


@pytest.mark.parametrize("params,proposer,k", [(FULL, propose_point, 3), (FULL, propose_model, 1),
                                               (PLAIN, propose_point, 1), (PLAIN, propose_model, 3)],
                         ids=["penalties-ngram-k3", "penalties-draft-k1", "plain-ngram-k1", "plain-draft-k3"])
def test_speculative_outputs_follow_the_target_distribution(params, proposer, k):
    samples, accepted = generate([row([], **params) for _ in range(N)], k, proposer)
    assert accepted[0] > 0 and accepted[1:].sum() > 0  # both rejections and acceptances happened
    assert chi_square_p([tuple(x) for x in samples], exact_distribution(**params)) > 1e-3


def test_the_plain_sampler_follows_the_same_exact_distribution():
    """Ties sampling_probs (the verifier's target) to what zhuzi's Sampler draws without speculation."""
    rows = [row([], **FULL) for _ in range(N)]
    outs: list[list[int]] = [[] for _ in rows]
    for _ in range(L):
        logits = torch.stack([toy_logits(PROMPT + o) for o in outs])
        step = [SamplingRow(r.params, o, r.prompt_token_ids, r.generator, r.stop_ids) for r, o in zip(rows, outs)]
        for o, t in zip(outs, Sampler()(logits, step).token_ids):
            o.append(t)
    assert chi_square_p([tuple(x) for x in outs], exact_distribution(**FULL)) > 1e-3


def test_a_verifier_told_the_wrong_draft_distribution_is_caught():
    """The test has power: drafts drawn from q but verified against a uniform q skew the outputs.
    (Claiming a point mass would not do: accepting x with probability p(x), else drawing from p without x,
    keeps p for any x however it was chosen, which is why prompt lookup needs no q.)"""
    samples, _ = generate([row([], **PLAIN) for _ in range(N)], 3, propose_model,
                          claimed_q=lambda q: torch.full_like(q, 1 / V))
    assert chi_square_p([tuple(x) for x in samples], exact_distribution(**PLAIN)) < 1e-6


def test_greedy_accepts_while_the_draft_is_the_argmax():
    params = dict(temperature=0, repetition_penalty=1.5, logit_bias={3: 0.4})
    expected: list[int] = []
    for _ in range(L):
        expected += Sampler()(toy_logits(PROMPT + expected)[None], [row(list(expected), **params)]).token_ids
    for k in (1, 2, 4):
        for proposer in (propose_point, propose_model):
            samples, _ = generate([row([], **params) for _ in range(20)], k, proposer)
            assert all(s == expected for s in samples)


def test_a_greedy_verdict_stops_at_the_first_mismatch_and_reports_logprobs():
    r = row([], temperature=0, logprobs=1)
    logits = torch.zeros(4, V)
    logits[0, 3], logits[1, 5], logits[2, 1], logits[3, 2] = 1, 1, 1, 1  # argmax chain 3, 5, 1, 2
    (v,) = verify(logits.clone(), [Draft(r, [3, 5, 0])])
    assert (v.token_ids, v.num_accepted) == ([3, 5, 1], 2)
    assert [next(iter(lp)) for lp in v.logprobs] == [3, 5, 1]  # each token's logprob from its own row
    assert all(lp[t].rank == 1 for lp, t in zip(v.logprobs, v.token_ids))
    (v,) = verify(logits.clone(), [Draft(r, [3, 5, 1])])
    assert (v.token_ids, v.num_accepted) == ([3, 5, 1, 2], 3)  # all stand: the bonus token follows


def test_seeded_rows_give_the_same_tokens_alone_and_in_any_batch():
    def run(before: int, after: int) -> list[int]:
        torch.manual_seed(before * 7 + after)  # the unseeded neighbours draw differently each time
        rows = ([row([], **PLAIN) for _ in range(before)] + [row([], seed=42, **FULL)]
                + [row([], **PLAIN) for _ in range(after)])
        return generate(rows, 3, propose_point)[0][before]

    alone = run(0, 0)
    assert run(5, 0) == alone and run(0, 9) == alone and run(3, 3) == alone


def test_without_drafts_a_row_draws_what_the_plain_sampler_draws():
    """k = 0 is ordinary sampling, uniform for uniform, also beside rows that do have drafts."""
    logits = torch.randn(8, 49152) * 3
    params = [dict(temperature=0.7, top_p=0.9), dict(temperature=1.0, top_k=50), dict(temperature=1.3, min_p=0.1),
              dict(temperature=0.8, repetition_penalty=1.2, frequency_penalty=0.5)] * 2

    def rows() -> list[SamplingRow]:
        return [SamplingRow(SamplingParams(seed=i, max_tokens=None, **p), [5, 6, 7], [1, 2, 3], make_generator(i), [2])
                for i, p in enumerate(params)]

    plain = Sampler()(logits.clone(), rows()).token_ids
    alone = verify(logits.clone(), [Draft(r) for r in rows()])
    assert [v.token_ids for v in alone] == [[t] for t in plain]
    extra = torch.randn(3, 49152)  # a neighbour with two drafts, verified in the same call
    mixed = verify(torch.cat([logits, extra]), [Draft(r) for r in rows()]
                   + [Draft(SamplingRow(SamplingParams(max_tokens=None), [], [1], None, [2]), [7, 8])])
    assert [v.token_ids for v in mixed[:8]] == [[t] for t in plain]
