"""The BPE replay on the real SmolLM2 tokenizer: it starts from the bytes, every state spells the same
text, and it ends in exactly the tokenizer's ids."""
from __future__ import annotations

import pytest
from test_detokenizer import sharegpt_texts

from zhuzi.bpe_replay import MAX_BYTES, Replay, replay
from zhuzi.model.loader import default_model_path
from zhuzi.tokenizer import Tokenizer

AWKWARD = ["我家刚领养了一只橘猫, strawberry 🐱 2024", "  leading and   inner   spaces \n\n\t tabs ",
           "x = 1234567 + 0.5e-3;", "Ünïcödé ÀÉÎ ß ﬁ", "🐱🐶🦊👍🏽", "a" * 300, "한국어 텍스트", ""]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.load(default_model_path())


def states(r: Replay) -> list[list[int]]:
    """Every tokenization along the way: the bytes, then one per merge step (applied right to left)."""
    words = [list(w.ids) for w in r.words]
    out = [[i for w in words for i in w]]
    for step in r.steps:
        for w, i in sorted(step.at, reverse=True):
            words[w][i:i + 2] = [step.merged_id]
        out.append([i for w in words for i in w])
    return out


def test_the_replay_ends_in_the_tokenizers_ids_and_every_state_spells_the_text(tok: Tokenizer) -> None:
    texts = AWKWARD + [t for t in sharegpt_texts(150) if len(t.encode()) <= MAX_BYTES]
    for text in texts:
        r = replay(tok, text)
        assert r.token_ids == tok.encode(text)
        seen = states(r)
        assert len(seen[0]) == len(text.encode()) and seen[-1] == r.token_ids
        assert all(tok.decode(ids) == text for ids in seen[::max(1, len(seen) // 5)])
        assert [s.rank for s in r.steps] == sorted({s.rank for s in r.steps})
        for step in r.steps:  # a merge joins its pair's bytes into one vocabulary entry
            assert tok.token_bytes[step.merged_id] == b"".join(tok.token_bytes[tok.bpe_model["vocab"][p]]
                                                              for p in step.pair)


def test_a_text_over_the_limit_is_refused(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="at most"):
        replay(tok, "猫" * (MAX_BYTES // 3 + 1))
