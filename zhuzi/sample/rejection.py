"""Speculative decoding's verification, the sampling step of a step with drafts: which proposed tokens stand,
and the target's own token after them (a step without drafts calls the sampler).

The rule is Leviathan et al. 2023's (vLLM's rejection sampler), on the very distribution the plain sampler draws
from (sampler.sampling_probs), so every emitted token is distributed exactly as without speculation; a sequence
takes k + 1 uniforms a step from its own generator, so a seeded request gets the same tokens in any batch.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from zhuzi.sample.sampler import (
    SamplingRow,
    Verdict,
    apply_bitmask,
    apply_grammar_masks,
    inverse_cdf,
    process_logits,
    sampling_probs,
    token_logprobs,
)


@dataclass
class Draft:
    """One sequence's sampling in a step: its row, and the k >= 0 tokens proposed to follow it."""

    row: SamplingRow
    token_ids: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None  # [k, V]: what each draft was drawn from; None: point masses (ngram)

    @property
    def k(self) -> int:
        return len(self.token_ids)

    @functools.cached_property
    def rows(self) -> list[SamplingRow]:
        """Row j as if the first j drafts had been emitted (its grammar mask is set apart: _mask_drafts)."""
        r = self.row
        return [r] + [SamplingRow(r.params, r.output_token_ids + self.token_ids[:j], r.prompt_token_ids,
                                  r.generator, r.stop_ids) for j in range(1, self.k + 1)]

    @functools.cached_property
    def uniforms(self) -> torch.Tensor:
        """k acceptance tests and one draw, taken once (see SamplingRow.uniform); without drafts, the plain draw."""
        if not self.k:
            return self.row.uniform
        return torch.rand(self.k + 1, dtype=torch.float64, generator=self.row.generator)


def verify(logits: torch.Tensor, drafts: list[Draft]) -> list[Verdict]:
    """Each draft's verdict; logits [sum(k + 1), V]: each draft's k + 1 rows in a run, drafts in order. A draft
    of k = 0 (a sequence with nothing proposed) gets the token the plain sampler would draw.

    Row j is used only if drafts x_1..x_j stand, so it is processed as if they had been emitted (penalties and
    min_tokens see them, its grammar mask is the one after them). Greedy rows accept while the draft is the
    argmax; sampled rows accept x with probability min(1, p(x) / q(x)), q the distribution the draft was drawn
    from (a point mass for prompt lookup); the first rejection draws from norm(max(p - q, 0)), and when all k
    stand a bonus token comes from the last row."""
    starts = [0]
    for d in drafts:
        starts.append(starts[-1] + d.k + 1)
    if starts[-1] != len(logits):
        raise ValueError(f"{len(logits)} rows of logits for drafts needing {starts[-1]}")
    _mask_drafts(logits, drafts, starts)
    chosen: list[tuple[list[int], int]] = [([], 0)] * len(drafts)
    for greedy, decide in ((True, _greedy_verdicts), (False, _sampled_verdicts)):
        picked = [i for i, d in enumerate(drafts) if d.row.params.greedy == greedy]
        if picked:
            for i, outcome in zip(picked, decide(logits, [drafts[i] for i in picked], [starts[i] for i in picked])):
                chosen[i] = outcome
    verdicts = []
    for d, start, (tokens, accepted) in zip(drafts, starts, chosen):
        n = d.row.params.logprobs
        logprobs = None if n is None else token_logprobs(logits[start:start + len(tokens)], tokens, n)
        verdicts.append(Verdict(tokens, accepted, logprobs))
    return verdicts


def sample_drafts(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[torch.Tensor | None]]:
    """A draft model's next tokens, and for sampled rows the distribution each was drawn from (q)."""
    apply_grammar_masks(logits, rows)
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    tokens = process_logits(logits, rows).argmax(dim=-1).tolist()
    probs: list[torch.Tensor | None] = [None] * len(rows)
    if sampled:
        q = sampling_probs(logits[sampled], [rows[i] for i in sampled])
        uniforms = torch.cat([torch.rand(1, dtype=torch.float64, generator=rows[i].generator) for i in sampled])
        for i, token, dist in zip(sampled, inverse_cdf(q, uniforms).tolist(), q):
            tokens[i], probs[i] = token, dist
    return tokens, probs


def _mask_drafts(logits: torch.Tensor, drafts: list[Draft], starts: list[int]) -> None:
    """The grammar masks of every verification row, in place: row j of a draft gets the mask of its
    grammar after the draft's first j tokens."""
    constrained = [i for i, d in enumerate(drafts) if d.row.grammar is not None]
    if not constrained:
        return
    bitmask = torch.empty(sum(drafts[i].k + 1 for i in constrained), drafts[constrained[0]].row.grammar.mask_words,
                          dtype=torch.int32)
    row = 0
    for i in constrained:
        drafts[i].row.grammar.fill_draft_masks(bitmask, row, drafts[i].token_ids)
        row += drafts[i].k + 1
    apply_bitmask(logits, [r for i in constrained for r in range(starts[i], starts[i + 1])], bitmask)


def _greedy_verdicts(logits: torch.Tensor, drafts: list[Draft], starts: list[int]) -> list[tuple[list[int], int]]:
    """Accept while the draft is the argmax of its processed row; then that row's argmax."""
    picked = [r for d, s in zip(drafts, starts) for r in range(s, s + d.k + 1)]
    rows = [r for d in drafts for r in d.rows]
    best = logits[picked]
    if any(r.needs_processing for r in rows):  # otherwise the raw argmax: no float copy of [rows, V]
        best = process_logits(best, rows)
    argmax, out, offset = best.argmax(dim=-1).tolist(), [], 0
    for d in drafts:
        n = 0
        while n < d.k and d.token_ids[n] == argmax[offset + n]:
            n += 1
        out.append((d.token_ids[:n] + [argmax[offset + n]], n))
        offset += d.k + 1
    return out


def _sampled_verdicts(logits: torch.Tensor, drafts: list[Draft], starts: list[int]) -> list[tuple[list[int], int]]:
    """The rejection rule, batched over every row of the given drafts."""
    probs = sampling_probs(logits[[r for d, s in zip(drafts, starts) for r in range(s, s + d.k + 1)]],
                           [r for d in drafts for r in d.rows])
    local = [0]
    for d in drafts:
        local.append(local[-1] + d.k + 1)
    accepted = _accepted_counts(probs, drafts, local)
    weights = probs[[local[b] + n for b, n in enumerate(accepted)]]
    for b, (d, n) in enumerate(zip(drafts, accepted)):
        if n < d.k:  # rejected at n: the token comes from the residual norm(max(p - q, 0))
            q = d.probs[n] if d.probs is not None else F.one_hot(torch.tensor(d.token_ids[n]), weights.shape[1])
            residual = (weights[b] - q.to(weights.device)).clamp_(min=0)
            # p == q leaves nothing (rejection then had probability 0, up to rounding): p is the answer.
            if residual.sum() > 0:
                weights[b] = residual
    final = inverse_cdf(weights, torch.stack([d.uniforms[-1] for d in drafts]).to(weights.device)).tolist()
    return [(d.token_ids[:n] + [token], n) for d, n, token in zip(drafts, accepted, final)]


def _accepted_counts(probs: torch.Tensor, drafts: list[Draft], local: list[int]) -> list[int]:
    """Per draft: how many leading tokens pass u < p(x) / q(x), all tested at once."""
    rows = [local[b] + j for b, d in enumerate(drafts) for j in range(d.k)]
    if not rows:
        return [0] * len(drafts)
    tokens = torch.tensor([t for d in drafts for t in d.token_ids], device=probs.device)
    p = probs[rows, tokens].double()
    q = torch.cat([d.probs[torch.arange(d.k), torch.tensor(d.token_ids)].double().to(probs.device)
                   if d.probs is not None else torch.ones(d.k, dtype=torch.float64, device=probs.device)
                   for d in drafts])
    u = torch.cat([d.uniforms[:-1] for d in drafts]).to(probs.device)
    # u < p / q, written so that q = 0 (a token the draft could not have drawn) never divides.
    passed = (u * q < p).tolist()
    counts, offset = [], 0
    for d in drafts:
        run = passed[offset:offset + d.k]
        counts.append(run.index(False) if False in run else d.k)
        offset += d.k
    return counts
