"""Structured output: the grammar that decides which tokens a sequence may sample next (between the forward
pass and sampling).

A request's constraint (a JSON schema, a regex, a choice, a Lark/GBNF grammar) is compiled once per source by
llguidance; each sequence gets its own matcher, whose token bitmask the sampler applies and which the engine
advances with each sampled token, never on prefill (a preempted sequence's matcher stays where its output is).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import llguidance
import torch

from zhuzi.sampling_params import StructuredOutputError, StructuredOutputsParams

# Where JSON allows whitespace: at most this much of it, so a small model cannot write newlines
# until max_tokens (deep pretty-printed JSON still fits).
_WHITESPACE = r"[\x20\x0A\x0D\x09]{1,16}"
# Short error messages: llguidance's verbose ones dump the parser's state.
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)
# JSON-schema keywords whose value is a schema, a list of schemas, or a map of name -> schema.
_SUBSCHEMA = {"items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
              "unevaluatedItems", "unevaluatedProperties"}
_SUBSCHEMA_LISTS = {"prefixItems", "anyOf", "oneOf", "allOf"}
_SUBSCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}


def json_options(params: StructuredOutputsParams | None = None) -> dict[str, Any]:
    """llguidance's x-guidance options for the whitespace of params' JSON (None: the defaults)."""
    if params is not None and params.disable_any_whitespace:
        return {"whitespace_flexible": False}
    return {"whitespace_pattern": params and params.whitespace_pattern or _WHITESPACE}


def close_objects(schema: Any) -> Any:
    """A copy of a JSON schema where every object schema that does not say otherwise gets
    additionalProperties: false (OpenAI's strict mode, vLLM's disable_additional_properties)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key, value in schema.items():
        if key in _SUBSCHEMA:
            out[key] = close_objects(value)
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            out[key] = [close_objects(v) for v in value]
        elif key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: close_objects(v) for name, v in value.items()}
    is_object = "properties" in out or out.get("type") == "object"
    if is_object and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def json_schema(params: StructuredOutputsParams) -> dict[str, Any]:
    """The JSON schema that a json or json_object constraint stands for."""
    schema = {"type": "object"} if params.kind == "json_object" else params.json
    if schema is False:
        raise StructuredOutputError("json", "the schema false allows no value at all")
    schema = {} if schema is True else schema
    return close_objects(schema) if params.disable_additional_properties else schema


def grammar_text(params: StructuredOutputsParams) -> str:
    """llguidance's grammar for params' constraint (checked only once compiled against a tokenizer)."""
    kind = params.kind
    if kind in ("json", "json_object"):
        return llguidance.LLMatcher.grammar_from_json_schema(json_schema(params), overrides=json_options(params))
    if kind == "choice":
        return llguidance.grammar_from("choice", params.choice)
    if kind == "regex":  # as Lark, so that \d, \D mean ASCII digits as in JSON-schema patterns
        return llguidance.LLMatcher.grammar_from_lark(f"start: /{llguidance.regex_to_lark(params.regex, 'd')}/")
    try:
        return llguidance.grammar_from("grammar", params.grammar)  # Lark, or GBNF converted to Lark
    except ValueError as exc:
        raise StructuredOutputError("grammar", str(exc)) from exc


def _reason(error: str) -> str:
    """llguidance's message in one line: its first line and any "error:" detail, without the source echo."""
    lines = error.strip().splitlines()
    return " ".join([lines[0].strip()] + [ln.strip() for ln in lines[1:] if ln.strip().startswith("error:")])


class GrammarMatcher:
    """One sequence's place in its grammar.

    llguidance stops counting tokens once its grammar has ended: a stop token taken after that is not
    in its history, so this wrapper counts those itself for rollback. A token the grammar forbids is
    refused without touching the state (llguidance's own matcher would enter a permanent error).

    Speculative decoding: prompt-lookup drafts are cut where validate() says the grammar stops taking them (the
    target's masked distribution gives the rest zero odds, and a point-mass proposal may be cut anywhere); a
    draft model masks its own logits with the matcher while drafting (accept, then rollback), so its q is the
    distribution it really drew from; the verifier takes a draft's k + 1 masks from fill_draft_masks.
    """

    def __init__(self, inner: llguidance.LLMatcher, stop_ids: frozenset[int], mask_words: int):
        self._inner, self._stop_ids, self.mask_words = inner, stop_ids, mask_words
        self._uncounted = 0  # stop tokens accepted after the grammar ended

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token bits into bitmask[row] (int32, CPU, contiguous; bit t of the row: token t)."""
        words = bitmask[row]
        self._inner.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)

    def fill_draft_masks(self, bitmask: torch.Tensor, row: int, draft: list[int]) -> None:
        """The masks of a draft's k + 1 positions into bitmask[row:row + k + 1]: the mask here, then after
        each draft token in turn; the matcher ends where it started. After a token the grammar refuses,
        rows allow everything: they are never used, since the refused token is rejected for certain."""
        taken = 0
        try:
            for j in range(len(draft) + 1):
                if j > taken:
                    bitmask[row + j] = -1
                    continue
                self.fill_mask(bitmask, row + j)
                if j < len(draft) and self.accept(draft[j]):
                    taken += 1
        finally:
            self.rollback(taken)

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False (and no change) when the grammar forbids it."""
        if self._inner.is_stopped():
            if token not in self._stop_ids:
                return False
            self._uncounted += 1
            return True
        if not self._inner.validate_tokens([token]):
            return False
        return self._inner.consume_token(token)

    def validate(self, tokens: list[int]) -> int:
        """How many of tokens, in order, the grammar would take from here (nothing is committed)."""
        if self._inner.is_stopped():
            return int(bool(tokens) and tokens[0] in self._stop_ids)
        return self._inner.validate_tokens(tokens)

    def rollback(self, num_tokens: int) -> None:
        """Forget the last num_tokens accepted tokens."""
        uncounted = min(num_tokens, self._uncounted)
        self._uncounted -= uncounted
        counted = num_tokens - uncounted
        if counted and not self._inner.rollback(counted):
            raise RuntimeError(f"grammar rollback of {counted} tokens failed: {self._inner.get_error()}")

    @property
    def is_terminated(self) -> bool:
        """The grammar has ended: nothing but a stop token can follow, so the sequence is done."""
        return self._inner.is_stopped()

    def copy(self) -> GrammarMatcher:
        """An independent matcher in the same state."""
        twin = GrammarMatcher(self._inner.deep_copy(), self._stop_ids, self.mask_words)
        twin._uncounted = self._uncounted
        return twin


class GrammarCompiler:
    """Compiles StructuredOutputsParams into matchers, caching each source's start state (LRU).

    vocab_size is the model's: its logits may be wider than the tokenizer (Qwen pads its embedding),
    and ids past the tokenizer are never allowed. The tokenizer view is slow to build, so it
    is built on first use (warm() builds it ahead). Thread-safe: a server may compile in its
    own threads while the engine thread takes matchers (llguidance drops the GIL while compiling).
    """

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_ids: list[int], capacity: int = 256):
        self._tokenizer_json = hf_tokenizer.backend_tokenizer.to_str()
        self.vocab_size = max(vocab_size, len(hf_tokenizer))
        self.stop_ids = frozenset(stop_ids)
        self.capacity = capacity
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    @property
    def mask_words(self) -> int:
        return (self.vocab_size + 31) // 32

    def warm(self) -> None:
        """Build the tokenizer view now, so that the first constrained request does not wait for it."""
        with self._lock:
            self._tokenizer_view()

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        """A matcher at the start of params' grammar; StructuredOutputError says what is wrong with it."""
        key = params.key
        with self._lock:
            start = self._cache.get(key)
            if start is None:
                start = self._compile(params)
                self._cache[key] = start
                if len(self._cache) > self.capacity:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
            inner = start.deep_copy()
        return GrammarMatcher(inner, self.stop_ids, self.mask_words)

    def _tokenizer_view(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                                     eos_token=sorted(self.stop_ids))
        return self._tokenizer

    def _compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        try:
            grammar = grammar_text(params)
        except StructuredOutputError:
            raise
        except ValueError as exc:  # e.g. a schema llguidance cannot read as JSON
            raise StructuredOutputError(params.kind, str(exc)) from exc
        start = llguidance.LLMatcher(self._tokenizer_view(), grammar, log_level=0, limits=_LIMITS)
        if start.is_error():
            raise StructuredOutputError(params.kind, _reason(start.get_error()))
        return start


_SHARED: dict[tuple[str, int, frozenset[int]], GrammarCompiler] = {}
_SHARED_LOCK = threading.Lock()


def shared_compiler(hf_tokenizer: Any, vocab_size: int, stop_ids: list[int]) -> GrammarCompiler:
    """This process's one compiler for a tokenizer (by its path), vocabulary and stop ids: a server and an engine
    thread in the same process share its cache and its tokenizer view."""
    key = (hf_tokenizer.name_or_path, vocab_size, frozenset(stop_ids))
    with _SHARED_LOCK:
        if key not in _SHARED:
            _SHARED[key] = GrammarCompiler(hf_tokenizer, vocab_size, stop_ids)
        return _SHARED[key]
