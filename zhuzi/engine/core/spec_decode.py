"""Speculative decoding's proposers, called after each step: guesses of each decoding sequence's next
tokens, which the next step's forward pass checks (zhuzi/sample/rejection.py decides which stand). Drafts
never enter Sequence.token_ids: page hashes (the prefix cache) assume tokens only grow."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from zhuzi.config import EngineConfig, SpeculativeConfig
from zhuzi.engine.core.kv.page_manager import PageManager
from zhuzi.engine.core.scheduler import scheduled
from zhuzi.engine.sequence import ScheduledSeq, Sequence
from zhuzi.engine.worker.model_builder import build_model
from zhuzi.engine.worker.model_runner import ModelRunner
from zhuzi.model.decoder import Decoder
from zhuzi.model.mtp import MTP
from zhuzi.sample.rejection import sample_drafts
from zhuzi.sample.sampler import SamplingRow
from zhuzi.tokenizer import Tokenizer


def lookup(tokens: np.ndarray | list[int], k: int, low: int, high: int) -> list[int]:
    """Up to k tokens after the latest earlier occurrence of the longest suffix of low..high tokens.

    Vectorised: every earlier position of the last token is a candidate end, extended backwards one
    comparison per candidate and step."""
    tokens = np.asarray(tokens)
    n = len(tokens)
    if k < 1 or n <= low:
        return []
    ends = np.flatnonzero(tokens[:n - 1] == tokens[n - 1])
    matched = np.ones(len(ends), dtype=np.int64)  # length of the suffix match ending at each candidate
    alive = np.ones(len(ends), dtype=bool)
    for back in range(1, high):
        if not alive.any():
            break
        ok = alive & (ends >= back)
        ok[ok] = tokens[ends[ok] - back] == tokens[n - 1 - back]
        matched += ok
        alive = ok
    best = int(matched.max(initial=0))
    if best < low:
        return []
    start = int(ends[matched == best][-1]) + 1
    proposal = tokens[start:start + k].tolist()
    period = n - start  # the proposal so far is the context's last `period` tokens: it repeats
    return proposal + [proposal[i % period] for i in range(len(proposal), k)]


Advance = Callable[[list[tuple[Sequence, int]], dict[int, list[int]]],
                   tuple[dict[int, torch.Tensor], list[tuple[Sequence, int]]]]


def draw(drafting: list[tuple[Sequence, int]], logits: dict[int, torch.Tensor], eos_ids: list[int],
         advance: Advance) -> None:
    """A model proposer's drafts: up to k per (sequence, k), each drawn with its request's sampling settings (and
    grammar) from the proposer's logits (by sequence id), and the distribution it was drawn from recorded;
    advance(step, drafts) feeds each sequence of step its newest draft and gives the logits for the next."""
    drafts: dict[int, list[int]] = {seq.seq_id: [] for seq, _ in drafting}
    probs: dict[int, list[torch.Tensor]] = {seq.seq_id: [] for seq, _ in drafting}
    seqs = [seq for seq, _ in drafting]
    try:  # a grammar follows the drafts while they are drawn, and goes back where it was
        while drafting:
            rows = [SamplingRow(seq.params, seq.output_token_ids + drafts[seq.seq_id], seq.prompt_token_ids,
                                seq.generator, eos_ids + seq.params.stop_token_ids, seq.grammar)
                    for seq, _ in drafting]
            tokens, dists = sample_drafts(torch.stack([logits[seq.seq_id] for seq, _ in drafting]), rows)
            step = []
            for (seq, k), token, q in zip(drafting, tokens, dists):
                if seq.grammar is not None and not seq.grammar.accept(token):
                    continue  # the grammar's own end: nothing can follow
                drafts[seq.seq_id].append(token)
                if q is not None:
                    probs[seq.seq_id].append(q)
                if len(drafts[seq.seq_id]) < k:
                    step.append((seq, k))
            logits, drafting = advance(step, drafts)
    finally:
        for seq in seqs:
            if seq.grammar is not None and drafts[seq.seq_id]:
                seq.grammar.rollback(len(drafts[seq.seq_id]))
    for seq in seqs:
        seq.spec_token_ids = drafts[seq.seq_id]
        seq.spec_probs = torch.stack(probs[seq.seq_id]) if probs[seq.seq_id] else None


class NgramProposer:
    """vLLM's "ngram" (prompt lookup): the text a model is asked to edit, comment or quote is already in its
    context, so the tokens that followed an earlier occurrence of the current suffix are a good guess. For n
    from prompt_lookup_max down to prompt_lookup_min, the latest earlier occurrence of the last n tokens of
    prompt + output; its followers are proposed. A match close to the end has fewer than k followers (in a
    loop of period p it is p tokens back): the copy then runs on through what it has just copied, like an
    overlapping LZ77 copy, so a loop proposes k tokens of itself. A point-mass proposal needs no q:
    accepting x with probability p(x), else drawing from p without x, keeps p for any x."""

    def __init__(self, spec: SpeculativeConfig):
        self.low, self.high = spec.prompt_lookup_min, spec.prompt_lookup_max

    def propose(self, seqs: list[Sequence], limits: list[int]) -> None:
        for seq, k in zip(seqs, limits):
            drafts = lookup(seq.token_ids, k, self.low, self.high)
            if seq.grammar is not None and drafts:  # the rest would have zero odds under the grammar's mask
                drafts = drafts[:seq.grammar.validate(drafts)]
            seq.spec_token_ids = drafts

    def release(self, seq: Sequence) -> None:
        pass


@dataclass
class _Shadow:
    """A target sequence's copy in the draft model's pool."""

    target: Sequence
    seq: Sequence  # the draft's own: token_ids = the target's as of the last proposal, then its drafts
    synced: int = 0  # how many of seq.token_ids are the target's own


class DraftModelProposer:
    """"draft_model": a small model with the target's tokenizer, its own paged KV pool and page manager,
    drafts k tokens with the request's own sampling settings (and its grammar) and records the distribution
    each was drawn from. Per target sequence it keeps a shadow sequence in its pool; after a verdict the
    shadow keeps the K/V of the prefix it shares with the target and recomputes the rest."""

    def __init__(self, spec: SpeculativeConfig, config: EngineConfig, tokenizer: Tokenizer, eos_ids: list[int],
                 vocab_size: int, num_pages: int, max_positions: int):
        ckpt, model = build_model(config, spec.model, min_positions=max_positions)
        if ckpt.config.state_layers:
            raise ValueError(f"speculative_config: the draft model {spec.model} ({ckpt.config.architecture}) has "
                             "recurrent layers, which do not run as a draft model yet")
        vocab = Tokenizer.load(ckpt.path).hf.get_vocab()
        if ckpt.config.vocab_size != vocab_size or vocab != tokenizer.hf.get_vocab():
            raise ValueError(f"speculative_config: the draft model {spec.model} does not share the target's "
                             f"tokenizer (vocabulary, or size {ckpt.config.vocab_size} vs {vocab_size})")
        self.eos_ids = eos_ids
        self.runner = ModelRunner(model, config, num_pages, self.eos_ids)
        self.pages = PageManager(num_pages, config.page_size, enable_prefix_caching=False)
        self.budget = config.max_num_batched_tokens  # tokens a catch-up pass computes at most
        self.shadows: dict[int, _Shadow] = {}

    def release(self, seq: Sequence) -> None:
        if (shadow := self.shadows.pop(seq.seq_id, None)) is not None:
            self.pages.free_sequence(shadow.seq)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], limits: list[int]) -> None:
        ready = self._catch_up(seqs)
        draw([(seq, k) for seq, k in zip(seqs, limits) if seq.seq_id in ready], ready, self.eos_ids, self._advance)

    def _catch_up(self, seqs: list[Sequence]) -> dict[int, torch.Tensor]:
        """Feed each shadow what it has not computed of its target's tokens (within the step's budget);
        the logits after the target's last token, for those that got there."""
        batch, budget = [], self.budget
        for seq in seqs:
            shadow = self._sync(seq)
            n = min(len(shadow.token_ids) - shadow.num_computed_tokens, budget)
            if n < 1:
                continue
            if not self.pages.allocate_slots(shadow, n):
                self.release(seq)  # the draft never takes room from anyone: this sequence goes without
                continue
            batch.append(scheduled(shadow, n))
            budget -= n
        if not batch:
            return {}
        logits = self.runner.last_logits(batch)
        ready = {}
        for item, row in zip(batch, logits):
            self.pages.computed(item.seq, item.num_new_tokens)
            if item.seq.num_computed_tokens == item.seq.num_tokens:
                ready[item.seq.seq_id] = row
        return ready

    def _sync(self, seq: Sequence) -> Sequence:
        """The target's shadow with the target's tokens; K/V kept for the prefix the two still share."""
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:
            own_seq = Sequence(seq.seq_id, seq.request_id, 0, seq.prompt_token_ids, seq.params)
            shadow = self.shadows[seq.seq_id] = _Shadow(seq, own_seq)
        own, target = shadow.seq.token_ids, seq.token_ids
        common = shadow.synced
        while common < min(len(own), len(target)) and own[common] == target[common]:
            common += 1
        shadow.seq.token_ids = list(target)
        self.pages.keep_computed(shadow.seq, min(common, len(target) - 1))
        shadow.synced = len(target)
        return shadow.seq

    def _advance(self, step: list[tuple[Sequence, int]],
                 drafts: dict[int, list[int]]) -> tuple[dict[int, torch.Tensor], list[tuple[Sequence, int]]]:
        """Feed each sequence's newest draft to the draft model: the logits for its next one."""
        batch, kept = [], []
        for seq, k in step:
            shadow = self.shadows[seq.seq_id].seq
            shadow.token_ids.append(drafts[seq.seq_id][-1])
            if self.pages.allocate_slots(shadow, 1):
                batch.append(scheduled(shadow, 1))
                kept.append((seq, k))
        if not batch:
            return {}, []
        logits = self.runner.last_logits(batch)
        for item in batch:
            self.pages.computed(item.seq, 1)
        return {seq.seq_id: row for (seq, _), row in zip(kept, logits)}, kept


@dataclass
class _MTPShadow:
    """A target sequence's copy in the MTP layer's pool: its position i is the target's position offset + i, where
    it reads the target's token offset + i + 1 and the target's final hidden state (its drafts: its own output)."""

    seq: Sequence  # its token_ids: the target's from offset + 1 on, then its drafts
    offset: int
    pending: torch.Tensor  # the target's hidden states from position offset + valid on, not through the layer yet
    valid: int = 0  # its positions computed from the target's hidden states

    @property
    def known(self) -> int:
        """The first target position whose hidden state it lacks."""
        return self.offset + self.valid + len(self.pending)


class MTPProposer:
    """"mtp": the checkpoint's multi-token-prediction layer (model/mtp.py), drafting from the target's final hidden
    states, which the model runner hands out after each step (observe). Per target sequence a shadow in a KV pool of
    the layer's own takes them in for the rows that stand; a proposal runs those positions through the layer, draws
    the first draft from its output at the target's last computed position, and each next one from its output at
    the draft before. A prefix the target took from its cache has no hidden states: the shadow starts after it."""

    def __init__(self, config: EngineConfig, target: Decoder, path: Path, eos_ids: list[int], num_pages: int,
                 max_positions: int):
        self.runner = ModelRunner(MTP.load(path, target, max_positions), config, num_pages, eos_ids)
        self.pages = PageManager(num_pages, config.page_size, enable_prefix_caching=False)
        self.eos_ids = eos_ids
        self.shadows: dict[int, _MTPShadow] = {}

    def release(self, seq: Sequence) -> None:
        if (shadow := self.shadows.pop(seq.seq_id, None)) is not None:
            self.pages.free_sequence(shadow.seq)

    def observe(self, hidden: list[tuple[Sequence, int, torch.Tensor]]) -> None:
        """A step's final hidden states (model runner's StepResult.hidden): those of the rows that stand."""
        for seq, start, rows in hidden:
            rows = rows[:max(0, seq.num_computed_tokens - start)]
            shadow = self.shadows.get(seq.seq_id)
            if shadow is None or not shadow.offset + shadow.valid <= start <= shadow.known:
                self.release(seq)  # new, or starting again elsewhere (preempted; after a cached prefix)
                own = Sequence(seq.seq_id, seq.request_id, 0, [], seq.params)
                shadow = self.shadows[seq.seq_id] = _MTPShadow(own, start, rows[:0])
            shadow.pending = torch.cat([shadow.pending[:start - shadow.offset - shadow.valid], rows])

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], limits: list[int]) -> None:
        batch, inputs, drafting = [], [], []
        for seq, k in zip(seqs, limits):
            shadow = self.shadows.get(seq.seq_id)
            if shadow is None or shadow.known != seq.num_computed_tokens or not len(shadow.pending):
                continue
            own = shadow.seq
            own.token_ids = seq.token_ids[shadow.offset + 1:seq.num_computed_tokens + 1]
            self.pages.keep_computed(own, shadow.valid)  # its drafts' positions are computed again
            if not self.pages.allocate_slots(own, len(shadow.pending)):
                self.release(seq)  # the layer never takes room from anyone: this sequence goes without
                continue
            batch.append(scheduled(own, len(shadow.pending)))
            inputs.append(shadow.pending)
            drafting.append((seq, k))
        if not batch:
            return
        hidden = self._run(batch, inputs)
        for item, (seq, _) in zip(batch, drafting):
            shadow = self.shadows[seq.seq_id]
            shadow.valid, shadow.pending = shadow.valid + item.num_new_tokens, shadow.pending[:0]
        draw(drafting, self._logits(drafting, hidden), self.eos_ids, lambda step, drafts: self._advance(
            step, drafts, hidden))

    def _run(self, batch: list[ScheduledSeq], inputs: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """The layer's output at each item's last row, by target sequence id."""
        out = self.runner.last_hidden(batch, inputs)
        for item in batch:
            self.pages.computed(item.seq, item.num_new_tokens)
        return {item.seq.seq_id: row for item, row in zip(batch, out)}

    def _logits(self, drafting: list[tuple[Sequence, int]], hidden: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        rows = [seq.seq_id for seq, _ in drafting]
        return dict(zip(rows, self.runner.model.logits(torch.stack([hidden[i] for i in rows])))) if rows else {}

    def _advance(self, step: list[tuple[Sequence, int]], drafts: dict[int, list[int]],
                 hidden: dict[int, torch.Tensor]) -> tuple[dict[int, torch.Tensor], list[tuple[Sequence, int]]]:
        """Each sequence's newest draft through the layer, beside its output at the draft before: the logits for
        its next one (hidden is updated to the new outputs)."""
        batch, inputs, kept = [], [], []
        for seq, k in step:
            own = self.shadows[seq.seq_id].seq
            own.token_ids.append(drafts[seq.seq_id][-1])
            if self.pages.allocate_slots(own, 1):
                batch.append(scheduled(own, 1))
                inputs.append(hidden[seq.seq_id][None])
                kept.append((seq, k))
        if not batch:
            return {}, []
        hidden.update(self._run(batch, inputs))
        return self._logits(kept, hidden), kept


Proposer = NgramProposer | DraftModelProposer | MTPProposer
