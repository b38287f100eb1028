"""Detokenizer + stop strings: generated token ids -> text safe to stream (the step after the sampler).

Each new token's bytes (byte-level BPE's, or SentencePiece's text and <0xE6>-style byte tokens) go through an
incremental UTF-8 decoder that returns whole characters only: "🐱"'s three tokens show nothing, nothing, the
cat. The longest tail that could still grow into a stop string is held back, so a stop string is never partly
shown.
"""
from __future__ import annotations

import codecs
import io

from zhuzi.sampling_params import SamplingParams
from zhuzi.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """One sequence's streaming text (byte-level tokens decode the same whatever came before them)."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams):
        self._bytes = tokenizer.token_bytes
        self._skipped = tokenizer.skipped_ids if params.skip_special_tokens else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = params.stop_strings
        self._include_stop = params.include_stop_str_in_output
        self._max_hold = max(map(len, self._stops), default=1) - 1
        self._stop_starts = frozenset(s[0] for s in self._stops)
        self._held = ""  # decoded text not shown yet: it could be the start of a stop string
        self._shown = io.StringIO()  # appending to a str attribute would copy the whole text every token

    @property
    def text(self) -> str:
        """Everything shown so far: the concatenation of all returned pieces."""
        return self._shown.getvalue()

    def step(self, token_id: int) -> tuple[str, str | None]:
        """Feed one generated token: (text now safe to show, the stop string that just completed or None)."""
        if token_id in self._skipped or token_id >= len(self._bytes):
            return "", None
        new = self._utf8.decode(self._bytes[token_id])
        if not new:  # the middle of a character
            return "", None
        if not self._stops:
            self._shown.write(new)
            return new, None
        return self._check_stops(self._held + new)

    def flush(self) -> str:
        """The sequence ended for another reason: show everything held back but an unfinished character,
        whose bytes stay only in the token ids (the text never shows a U+FFFD the model did not write)."""
        piece, self._held = self._held, ""
        self._utf8.reset()
        self._shown.write(piece)
        return piece

    def _check_stops(self, pending: str) -> tuple[str, str | None]:
        hits = [(at, k) for k, s in enumerate(self._stops) if (at := pending.find(s)) >= 0]
        if hits:
            at, k = min(hits)  # the earliest match; on a tie the first listed
            stop = self._stops[k]
            piece = pending[:at + len(stop)] if self._include_stop else pending[:at]
            self._held = ""
            self._shown.write(piece)
            return piece, stop
        keep = self._stop_prefix_len(pending)
        piece, self._held = pending[:len(pending) - keep], pending[len(pending) - keep:]
        self._shown.write(piece)
        return piece, None

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest tail of text that is the start of some stop string."""
        for n in range(min(len(text), self._max_hold), 0, -1):
            if text[-n] in self._stop_starts and any(s.startswith(text[-n:]) for s in self._stops):
                return n
        return 0
