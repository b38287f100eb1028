"""Sampling: the step after the forward pass, logits of a batch -> next tokens (+ logprobs).

Order and meanings are vLLM's: grammar masks -> allowed_token_ids and bad_words -> logit_bias -> min_tokens ->
repetition penalty -> frequency/presence penalties -> temperature (0: greedy argmax) -> top-k -> top-p -> min-p
-> draw, each on the whole batch at once. The masks come first, in place, as in vLLM: logprobs then describe the
distribution the token was drawn from. Drafts are verified in rejection.py, on this module's sampling_probs.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain

import torch
import torch.nn.functional as F

from zhuzi.outputs import Logprob
from zhuzi.sample.grammar import GrammarMatcher
from zhuzi.sampling_params import SamplingParams

# top-p first looks for its cut among this many best tokens per row, then among
# more, and sorts the whole vocabulary only for rows whose nucleus is wider
# still: real next-token distributions are peaked, and a full sort costs far more than a top 64.
_TOP_P_CANDIDATES = (64, 512, 4096)
# Sampling sums probabilities block by block (see inverse_cdf).
_BLOCK = 256


def make_generator(seed: int | None) -> torch.Generator | None:
    """The per-sequence random stream for a seeded request (None: use the global one)."""
    if seed is None:
        return None
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


@dataclass
class SamplingRow:
    """One row of a step's batch: what is needed to pick one sequence's next token (a new row each step)."""

    params: SamplingParams
    output_token_ids: list[int]
    prompt_token_ids: list[int]
    generator: torch.Generator | None = None
    stop_ids: list[int] = field(default_factory=list)  # EOS ids + params.stop_token_ids
    grammar: GrammarMatcher | None = None  # structured output: only the tokens it allows

    @property
    def forbids_stop(self) -> bool:
        return bool(self.stop_ids) and len(self.output_token_ids) < self.params.min_tokens

    @functools.cached_property
    def uniform(self) -> torch.Tensor:
        """The row's one random draw of this step, taken once: a row sampled again on its own (after a
        neighbour failed the batch) draws the same number, so its result does not change."""
        return torch.rand(1, dtype=torch.float64, generator=self.generator)

    @property
    def needs_processing(self) -> bool:
        p = self.params
        return (bool(p.logit_bias) or self.forbids_stop or p.repetition_penalty != 1 or p.frequency_penalty != 0
                or p.presence_penalty != 0 or bool(p.allowed_token_ids) or bool(p.bad_words_token_ids))


@dataclass
class Verdict:
    """What one sequence emits in a step: its accepted drafts (rejection.py), then one token of the target's own."""

    token_ids: list[int]
    num_accepted: int
    logprobs: list[dict[int, Logprob]] | None = None  # one per emitted token, when the request asked


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row, None where that row asked for no logprobs; None overall when no row did.
    logprobs: list[dict[int, Logprob] | None] | None

    def verdicts(self) -> list[Verdict]:
        """Each row's one token, as what its sequence emits."""
        logprobs = self.logprobs or [None] * len(self.token_ids)
        return [Verdict([t], 0, None if lp is None else [lp]) for t, lp in zip(self.token_ids, logprobs)]


class Sampler:
    """Picks each row's next token; logprobs come from the raw (unprocessed) logits."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        apply_grammar_masks(logits, rows)
        if all(r.params.greedy and not r.needs_processing for r in rows):
            token_ids = logits.argmax(dim=-1)
        else:
            token_ids = _choose_tokens(process_logits(logits, rows), rows)
        return SamplerOutput(token_ids.tolist(), _sample_logprobs(logits, token_ids, rows))


_MASK_BOUNDS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _mask_bounds(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 8]: for each byte of a bitmask, the upper bound of each of its 8 tokens' logits (+inf or -inf)."""
    if (dtype, device) not in _MASK_BOUNDS:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        _MASK_BOUNDS[dtype, device] = torch.where(bits.bool(), float("inf"), float("-inf")).to(device, dtype)
    return _MASK_BOUNDS[dtype, device]


def apply_grammar_masks(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Set to -inf, in place, the logits [B, V] of the tokens each row's grammar forbids; rows without
    one stay as they are."""
    constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
    if not constrained:
        return
    grammars = [rows[i].grammar for i in constrained]
    bitmask = torch.empty(len(grammars), grammars[0].mask_words, dtype=torch.int32)
    for k, grammar in enumerate(grammars):
        grammar.fill_mask(bitmask, k)
    apply_bitmask(logits, constrained, bitmask)


def apply_bitmask(logits: torch.Tensor, constrained: list[int], bitmask: torch.Tensor) -> None:
    """logits[constrained[i]] keeps only what bitmask[i] allows.

    The bitmask is unpacked through a 256-entry byte table and applied as an elementwise minimum:
    faster here than bit shifts and masked_fill_, and a +inf logit cannot turn into
    NaN as it would with an added -inf.
    """
    vocab = logits.shape[1]
    table = _mask_bounds(logits.dtype, logits.device)
    byte_values = bitmask.view(torch.uint8).flatten().to(logits.device, torch.int32)
    bound = table.index_select(0, byte_values).view(len(constrained), -1)[:, :vocab]
    if len(constrained) == len(logits):
        torch.minimum(logits, bound, out=logits)
    else:
        index = torch.tensor(constrained, device=logits.device)
        logits.index_copy_(0, index, torch.minimum(logits.index_select(0, index), bound))


def process_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """A float32 copy of logits [B, V] with bias, min_tokens and penalties applied."""
    out = logits.to(torch.float32, copy=True)
    _restrict_tokens(out, rows)
    _add_logit_bias(out, rows)
    _forbid_stop_ids(out, rows)
    _apply_repetition_penalty(out, rows)
    _apply_output_penalties(out, rows)
    return out


def _index(token_lists: dict[int, list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) tensors addressing the given tokens of the given rows."""
    lengths = torch.tensor([len(t) for t in token_lists.values()], device=device)
    row_ids = torch.tensor(list(token_lists), device=device).repeat_interleave(lengths)
    token_ids = torch.tensor(list(chain.from_iterable(token_lists.values())), dtype=torch.long, device=device)
    return row_ids, token_ids


def _restrict_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """vLLM's allowed_token_ids (nothing else may be drawn) and bad_words (a word's last token is ruled out
    where the output already ends with the rest of it)."""
    for i, row in enumerate(rows):
        p = row.params
        if p.allowed_token_ids:
            outside = torch.ones(logits.shape[1], dtype=torch.bool, device=logits.device)
            outside[p.allowed_token_ids] = False
            logits[i].masked_fill_(outside, float("-inf"))
        output = row.output_token_ids
        banned = [word[-1] for word in p.bad_words_token_ids
                  if len(word) <= len(output) + 1 and output[len(output) - len(word) + 1:] == word[:-1]]
        if banned:
            logits[i, banned] = float("-inf")


def _add_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    biases = {i: r.params.logit_bias for i, r in enumerate(rows) if r.params.logit_bias}
    if biases:
        values = torch.tensor([v for b in biases.values() for v in b.values()], device=logits.device)
        logits.index_put_(_index({i: list(b) for i, b in biases.items()}, logits.device), values,
                          accumulate=True)


def _forbid_stop_ids(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    stops = {i: r.stop_ids for i, r in enumerate(rows) if r.forbids_stop}
    if stops:
        logits.index_put_(_index(stops, logits.device), torch.tensor(float("-inf"), device=logits.device))


def _apply_repetition_penalty(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    seen = {i: r.prompt_token_ids + r.output_token_ids
            for i, r in enumerate(rows) if r.params.repetition_penalty != 1}
    if not seen:
        return
    row_ids, token_ids = _index(seen, logits.device)
    penalty = torch.tensor([r.params.repetition_penalty for r in rows], device=logits.device)[row_ids]
    values = logits[row_ids, token_ids]
    # A token seen twice is written twice, with the same value: no double penalty.
    logits[row_ids, token_ids] = torch.where(values > 0, values / penalty, values * penalty)


def _apply_output_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    outputs = {i: r.output_token_ids for i, r in enumerate(rows)
               if r.params.frequency_penalty or r.params.presence_penalty}
    if not outputs:
        return
    row_ids, token_ids = _index(outputs, logits.device)
    vocab = logits.shape[1]
    keys, counts = (row_ids * vocab + token_ids).unique(return_counts=True)
    row_ids, token_ids = keys // vocab, keys % vocab
    frequency = torch.tensor([r.params.frequency_penalty for r in rows], device=logits.device)
    presence = torch.tensor([r.params.presence_penalty for r in rows], device=logits.device)
    logits[row_ids, token_ids] -= frequency[row_ids] * counts + presence[row_ids]


def _choose_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Argmax for greedy rows, a draw for the others; logits is ours to change."""
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if len(sampled) < len(rows):
        tokens = logits.argmax(dim=-1)  # the greedy rows' answer; sampled rows overwrite theirs
    else:
        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    if sampled:
        tokens[sampled] = _draw(_select(logits, sampled), [rows[i] for i in sampled])
    return tokens


def _draw(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """One token per row from its sampling distribution; logits is ours to change."""
    # Inverse-CDF sampling takes a single uniform per row, from the row's own
    # generator, so a seeded row draws the same whatever else is in the batch.
    uniforms = torch.cat([r.uniform for r in rows])
    return inverse_cdf(sampling_distribution(logits, rows), uniforms.to(logits.device))


def sampling_distribution(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """What a non-greedy row draws from: softmax(logits / T) truncated by top-k, top-p and min-p.
    logits (processed: bias and penalties applied) is changed in place."""
    logits /= torch.tensor([[r.params.temperature] for r in rows], device=logits.device)
    # Extreme temperatures or penalties overflow; an infinite logit must not turn into NaN odds.
    logits.nan_to_num_(nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)
    _truncate(logits, rows)
    return logits.softmax(dim=-1)


def sampling_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """[B, V]: the distribution each (sampled) row draws its token from, after every processing step.
    Grammar masks must already be in logits."""
    return sampling_distribution(process_logits(logits, rows), rows)


def inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row of weights [n, V] (>= 0, not all 0): the token where the running sum passes uniform * total.

    A float32 running sum over a whole vocabulary would blur the rare tokens
    and a float64 one costs a pass of its own, so the sum is taken in two
    levels: block totals pick a block, a float64 sum inside it picks the token.
    """
    n, vocab = weights.shape
    blocks = (F.pad(weights, (0, -vocab % _BLOCK)) if vocab % _BLOCK else weights).view(n, -1, _BLOCK)
    block_cdf = blocks.sum(dim=-1).double().cumsum(dim=-1)
    # uniforms < 1, so target < block_cdf[:, -1]: the chosen block has mass.
    target = uniforms[:, None] * block_cdf[:, -1:]
    block = torch.searchsorted(block_cdf, target, right=True)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    chunk = blocks.gather(1, block[:, :, None].expand(-1, -1, _BLOCK)).squeeze(1)
    offset = torch.searchsorted(chunk.double().cumsum(dim=-1), target - before, right=True)
    # The block total and the sum inside it may differ in the last bits; never
    # step past the block's last token of nonzero probability.
    last = _BLOCK - 1 - (chunk > 0).flip(-1).int().argmax(dim=-1, keepdim=True)
    return (block * _BLOCK + torch.minimum(offset, last)).squeeze(1)


def _truncate(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Sets to -inf, in place, what top-k rules out, then top-p of what is left, then min-p.

    Each cut is at a value, not at a position in a sort: tokens tied with the
    last kept one stay too, so the allowed set never depends on how a sort
    orders ties.
    """
    params = [r.params for r in rows]
    _cut(logits, params, [i for i, p in enumerate(params) if p.top_k > 0], _outside_top_k)
    _cut(logits, params, [i for i, p in enumerate(params) if p.top_p < 1], _outside_top_p)
    _cut(logits, params, [i for i, p in enumerate(params) if p.min_p > 0], _below_min_p)


def _cut(logits: torch.Tensor, params: list[SamplingParams], chosen: list[int],
         rule: Callable[[torch.Tensor, list[SamplingParams]], torch.Tensor]) -> None:
    """Sets to -inf the logits of the chosen rows where rule says they are out."""
    if chosen:
        selected = _select(logits, chosen)
        selected.masked_fill_(rule(selected, [params[i] for i in chosen]), float("-inf"))
        if selected is not logits:
            logits[chosen] = selected


def _select(logits: torch.Tensor, rows: list[int] | torch.Tensor) -> torch.Tensor:
    """logits[rows], without a copy when rows (ascending, distinct) are all of them."""
    return logits if len(rows) == len(logits) else logits[rows]


def _outside_top_k(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    k = torch.tensor([p.top_k for p in params], device=logits.device).clamp(max=logits.shape[1])
    best = logits.topk(int(k.max()), dim=-1).values
    return logits < best.gather(1, k[:, None] - 1)


def _outside_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Outside the smallest top set that holds top_p of the probability."""
    # softmax, not exp or logsumexp: its kernel stays fast on -inf and on
    # probabilities too small for a normal float.
    probs = logits.softmax(dim=-1)
    vocab = probs.shape[1]
    top_p = torch.tensor([p.top_p for p in params], device=logits.device)
    floor = torch.empty_like(top_p)
    pending = torch.arange(len(params), device=logits.device)
    for size in (*_TOP_P_CANDIDATES, vocab):
        best = _select(probs, pending).topk(min(size, vocab), dim=-1).values
        mass_before = F.pad(best.cumsum(dim=-1)[:, :-1], (1, 0))
        # The top token always stays, also for a top_p too small for float32 (5e-324 becomes 0).
        kept = (mass_before < top_p[pending, None]).sum(dim=-1).clamp(min=1)
        # Also done: rows whose candidates already reach the tokens ruled out before.
        done = (kept < best.shape[1]) | (best.shape[1] == vocab) | (best[:, -1] == 0)
        floor[pending[done]] = best[done].gather(1, kept[done, None] - 1).squeeze(1)
        pending = pending[~done]
        if not len(pending):
            break
    return probs < floor[:, None]


def _below_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    # A probability min_p times the top one's is a fixed distance below the top logit.
    min_p = torch.tensor([p.min_p for p in params], device=logits.device)
    return logits < (logits.amax(dim=-1) + min_p.log())[:, None]


def _sample_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                     rows: list[SamplingRow]) -> list[dict[int, Logprob] | None] | None:
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if not wanted:
        return None
    dicts = token_logprobs(logits[wanted], token_ids[wanted], [rows[i].params.logprobs for i in wanted])
    out: list[dict[int, Logprob] | None] = [None] * len(rows)
    for i, d in zip(wanted, dicts):
        out[i] = d
    return out


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor | list[int],
                   num_top: list[int] | int) -> list[dict[int, Logprob]]:
    """Per row of logits [N, V]: the given token's logprob and rank, plus the top num_top tokens.

    Logprobs are log_softmax of these logits; a rank is 1 + the number of
    tokens strictly more likely. Tokens a grammar forbids (-inf) are never among the top.
    """
    logprobs = logits.float().log_softmax(dim=-1)
    token_ids = torch.as_tensor(token_ids, dtype=torch.long, device=logits.device)
    num_top = [num_top] * len(token_ids) if isinstance(num_top, int) else num_top
    chosen = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_values, top_ids = (t.tolist() for t in logprobs.topk(max(num_top), dim=-1))
    out = []
    for token, value, rank, n, ids, values in zip(token_ids.tolist(), chosen.squeeze(1).tolist(),
                                                 ranks.tolist(), num_top, top_ids, top_values):
        entry = {token: Logprob(value, rank)}
        for top_id, top_value in zip(ids[:n], values[:n]):
            if top_value == float("-inf"):
                break
            # values are sorted: the first equal one's place counts the tokens strictly more likely
            entry.setdefault(top_id, Logprob(top_value, values.index(top_value) + 1))
        out.append(entry)
    return out
