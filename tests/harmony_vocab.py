"""gpt-oss's vocabulary (o200k_harmony) for tests, offline: its ranks as the quicktok-v1 package ships them (MIT,
from OpenAI's tiktoken), written as the o200k_base.tiktoken file that openai-harmony reads (the reference renderer),
and as a Hugging Face tokenizer with harmony's control tokens at openai-harmony's ids, as gpt-oss's tokenizer.json
has them."""
from __future__ import annotations

import base64
import struct
from pathlib import Path

import openai_harmony
import pytest
import quicktok
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

# o200k's pre-tokenizer (tiktoken's pattern)
PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])


def ranks() -> dict[bytes, int]:
    """o200k_base's ranks, from quicktok's file: a count, then per token its length, bytes and rank."""
    data = (Path(quicktok.__file__).parent / "data" / "o200k.vocab").read_bytes()
    (count,), at, out = struct.unpack_from("<I", data), 4, {}
    for _ in range(count):
        (length,) = struct.unpack_from("<H", data, at)
        token = data[at + 2:at + 2 + length]
        (rank,) = struct.unpack_from("<I", data, at + 2 + length)
        out[token], at = rank, at + 6 + length
    return out


def reference_encoding(directory: Path, vocab: dict[bytes, int]) -> openai_harmony.HarmonyEncoding:
    """openai-harmony's gpt-oss encoding, reading the vocabulary from directory instead of downloading it."""
    lines = [f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in vocab.items()]
    (directory / "o200k_base.tiktoken").write_text("".join(lines))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TIKTOKEN_ENCODINGS_BASE", str(directory))
        return openai_harmony.load_harmony_encoding(openai_harmony.HarmonyEncodingName.HARMONY_GPT_OSS)


def _merges(vocab: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """BPE's merges in rank order: a token is the merge of the two parts that byte-pair encoding with only the
    lower ranks leaves of it."""
    merges = []
    for token, rank in sorted(vocab.items(), key=lambda item: item[1]):
        if len(token) < 2:
            continue
        parts = [token[i:i + 1] for i in range(len(token))]
        while len(parts) > 2:
            pairs = [(vocab.get(a + b, rank), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            best, i = min(pairs)
            if best >= rank:
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
    return merges


def save_tokenizer(directory: Path, vocab: dict[bytes, int], encoding: openai_harmony.HarmonyEncoding) -> None:
    """gpt-oss's tokenizer, saved in directory as Hugging Face saves it."""
    alphabet = _byte_alphabet()

    def text(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    bpe = models.BPE({text(t): r for t, r in vocab.items()}, [(text(a), text(b)) for a, b in _merges(vocab)])
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    specials = sorted((encoding.encode(s, allowed_special="all")[0], s) for s in encoding.special_tokens_set)
    assert [token_id for token_id, _ in specials] == list(range(len(vocab), len(vocab) + len(specials)))
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|return|>")
    hf.add_special_tokens({"additional_special_tokens": [special for _, special in specials]})
    hf.save_pretrained(directory)


def _byte_alphabet() -> dict[int, str]:
    """Byte-level BPE's characters for bytes: printable ones stand for themselves, the rest for chr(256 + n)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in out):
        out[b] = chr(256 + n)
    return out
