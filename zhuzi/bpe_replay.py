"""The tokenizer step replayed merge by merge: text -> words -> bytes -> the model's own BPE merges -> ids.

The tokenizer's pre-tokenizer cuts the text into words; each word starts as its bytes (in byte-level BPE
every byte is a vocabulary entry) and the model's merges are applied lowest rank first. Words are
independent, so the steps of all words are merged into one sequence by rank: a step is one merge rule
applied wherever its pair occurs. A merge never creates a pair of lower rank than itself (a token exists
before any rule that uses it), so this order gives every word the tokenizer's own result.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from zhuzi.tokenizer import Tokenizer

MAX_BYTES = 2000  # each word is replayed in time quadratic in its length


@dataclass
class Merge:
    rank: int  # the rule's line in the model's merges (0 = learnt first)
    pair: tuple[str, str]  # the rule as the merges list writes it (byte-alphabet strings)
    merged_id: int
    at: list[tuple[int, int]] = field(default_factory=list)  # (word, piece index before this step)


@dataclass
class Word:
    text: str
    ids: list[int]  # its pieces before any merge: one per byte (or the whole word, see ignore_merges)


@dataclass
class Replay:
    words: list[Word]
    steps: list[Merge]
    token_ids: list[int]  # after the last step


@dataclass
class _Tables:
    vocab: dict[str, int]
    merges: list[tuple[str, str]]
    ranks: dict[tuple[str, str], int]
    ignore_merges: bool  # a whole word found in the vocabulary is taken as is (Llama-3's tokenizer)


@functools.cache
def _tables(tokenizer: Tokenizer) -> _Tables:
    model = tokenizer.bpe_model
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return _Tables(model["vocab"], merges, {pair: r for r, pair in enumerate(merges)},
                   bool(model.get("ignore_merges")))


def replay(tokenizer: Tokenizer, text: str) -> Replay:
    """ValueError for a text over MAX_BYTES or a tokenizer that is not byte-level BPE."""
    if len(text.encode()) > MAX_BYTES:
        raise ValueError(f"text is {len(text.encode())} bytes; the replay takes at most {MAX_BYTES}")
    t = _tables(tokenizer)
    words, steps, final = [], {}, []
    for w, (word_text, chars) in enumerate(tokenizer.pre_tokenize(text)):
        pieces = [chars] if t.ignore_merges and chars in t.vocab else list(chars)
        if missing := [p for p in pieces if p not in t.vocab]:
            raise ValueError(f"the vocabulary lacks the byte tokens {missing[:3]}: not a byte-level BPE")
        words.append(Word(word_text, [t.vocab[p] for p in pieces]))
        for rank, at in _merge_word(pieces, t.ranks):
            pair = t.merges[rank]
            step = steps.setdefault(rank, Merge(rank, pair, t.vocab[pair[0] + pair[1]]))
            step.at += [(w, i) for i in at]
        final += [t.vocab[p] for p in pieces]
    return Replay(words, [steps[r] for r in sorted(steps)], final)


def _merge_word(pieces: list[str], ranks: dict[tuple[str, str], int]) -> list[tuple[int, list[int]]]:
    """Merges pieces in place, lowest rank first; returns each applied rule's rank and where it applied
    (every non-overlapping occurrence, left to right, as the tokenizer does)."""
    applied = []
    while len(pieces) > 1:
        rank = min((ranks.get(pair, len(ranks)) for pair in zip(pieces, pieces[1:])), default=len(ranks))
        if rank == len(ranks):
            break
        at, i, merged = [], 0, []
        while i < len(pieces):
            if i + 1 < len(pieces) and ranks.get((pieces[i], pieces[i + 1])) == rank:
                at.append(i)
                merged.append(pieces[i] + pieces[i + 1])
                i += 2
            else:
                merged.append(pieces[i])
                i += 1
        pieces[:] = merged
        applied.append((rank, at))
    return applied
