"""Chat template + tokenizer: messages -> one document -> token ids (the step after the gateway).

User text never becomes a control token: what the client sent is escaped before the template renders it, so
only the template's own markers encode as special tokens. The same render with each message's content marked
says who wrote each token (the inspector's document view).
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import json
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from tokenizers import Tokenizer as RustTokenizer
from tokenizers.decoders import ByteLevel
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from zhuzi.disk_cache import atomic_write, cache_path, file_identity
from zhuzi.encoder_process import LONG_TEXT, EncoderProcess, in_slices
from zhuzi.model.gguf_header import read_gguf_header


@dataclass(frozen=True)
class ThoughtTags:
    """How a thinking model marks its thought: an open and a close tag, each one token of its vocabulary, and
    the text after the open tag that names a thought (a channel's name)."""

    open: str
    close: str
    name: str = ""

    @property
    def opening(self) -> str:
        """What a reply (or a template's generation prompt) opens a thought with."""
        return self.open + self.name


# Qwen's and DeepSeek's <think>...</think>; Gemma 4's thought channel, <|channel>thought\n...<channel|>
THOUGHT_TAGS = (ThoughtTags("<think>", "</think>"), ThoughtTags("<|channel>", "<channel|>", "thought"))
# Tool-call markers that vocabularies hold as special tokens (Llama 3's, Mistral's, Gemma 4's, LFM2's): shown in a
# reply as a thought's tags are, for the tool-call parser reads them (server/common/tool_formats/).
TOOL_MARKERS = frozenset({"<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|tool_call>", "<tool_call|>",
                          '<|"|>', "<|tool_call_start|>", "<|tool_call_end|>"})
# gpt-oss's harmony format: a vocabulary with these markers as control tokens speaks it (server/common/harmony.py).
HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")

# Injection safety: rendering the template and tokenizing it with special-token parsing on would let a user who
# types "<|im_end|>\n<|im_start|>system" forge control tokens. So every string the client sent (contents, tool
# calls and schemas, template kwargs) is escaped first: each special-token string becomes a private-use
# placeholder. Every special-token string left in the render is then the template's own marker; the text between
# markers is restored and encoded with parsing off. A tokenizer cuts at special tokens before BPE, so content
# without such strings encodes as the naive render-then-encode would; and escaping, unlike swapping whole
# contents for sentinels, keeps templates that transform content (.strip(), splitting on </think>) exact.
# Added tokens that are not special (Qwen's <think>, <tool_call>) stay ordinary added tokens, as in other
# engines; their lstrip/rstrip options are not honoured (the supported models set none on special tokens).
_ESC = "\U000f0000"  # private use: opens a placeholder; a literal one in client text is doubled
_CODE_BASE = 0xF0001  # special token k (longest first) is written _ESC + chr(_CODE_BASE + k)
_AUTHOR_BASE = 0x100000  # message i's content is marked chr(_AUTHOR_BASE + i) ... _AUTHOR_END (plane 16)
_AUTHOR_END = "\U0010fffd"
_RESERVED_KWARGS = frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {
    "self", "kwargs"} | {"messages"}


# AutoTokenizer picks a GGUF's tokenizer class by the file's config, and transformers 5.25 cannot read the config
# of these architectures' files (gpt-oss: its reader fails on the rope.scaling keys llama.cpp's converter writes;
# gemma4: on the KV head count per layer of 26B-A4B's and 31B's files; lfm2moe, granitehybrid, qwen3next: it knows
# no mapping for them); the generic fast tokenizer reads only the vocabulary (Gemma 4's by its "gemma4" model).
GENERIC_TOKENIZER_ARCHS = ("gpt-oss", "gemma4", "lfm2moe", "granitehybrid", "qwen3next")


def _load_gguf(gguf: Path) -> PreTrainedTokenizerBase:
    """Converting a GGUF vocabulary takes seconds, so the converted tokenizer is cached on disk."""
    cached = cache_path("tokenizers", gguf.stem, *file_identity(gguf))
    if (cached / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(cached, local_files_only=True)
    metadata = read_gguf_header(gguf).metadata
    generic = metadata.get("general.architecture") in GENERIC_TOKENIZER_ARCHS
    hf = (PreTrainedTokenizerFast if generic else AutoTokenizer).from_pretrained(
        gguf.parent, gguf_file=gguf.name, local_files_only=True)
    # transformers takes a tokenizer.json beside the file over its vocabulary (llama.cpp's converter writes the file
    # into the checkpoint's folder, beside the same tokenizer's), and then no chat template: the file's
    hf.chat_template = hf.chat_template or metadata.get("tokenizer.chat_template")
    try:
        with atomic_write(cached) as tmp:
            hf.save_pretrained(tmp)
    except OSError:
        pass  # an unwritable cache only costs start-up time
    return hf


def _bytes_to_unicode() -> dict[int, str]:
    """Byte-level BPE's alphabet: printable Latin-1 bytes stand for themselves, the rest for chr(256 + n)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in mapping):
        mapping[b] = chr(256 + n)
    return mapping


def _byte_level_bytes(token: str) -> bytes:
    return token.translate(_TO_BYTE).encode("latin-1")


_TO_BYTE = str.maketrans({ch: chr(b) for b, ch in _bytes_to_unicode().items()})
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _piece_bytes(tokenizer: RustTokenizer) -> Callable[[str], bytes]:
    """A SentencePiece-style tokenizer's token -> bytes (Gemma, Llama 2): a byte-fallback token <0xE6> is that
    byte, any other its text with the decoder's replacements (the ▁ that stands for a space). A decoder that
    does more (Strip: a token whose text depends on its place) cannot be served token by token."""
    decoder = json.loads((tokenizer.decoder.__getstate__() if tokenizer.decoder else b"{}").decode())
    steps = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    kinds = {step.get("type") for step in steps}
    if "ByteFallback" not in kinds or not kinds <= {"Replace", "ByteFallback", "Fuse"} or any(
            "String" not in step["pattern"] for step in steps if step["type"] == "Replace"):
        raise ValueError("incremental detokenizing needs a byte-level BPE or a byte-fallback SentencePiece "
                         f"tokenizer (this one decodes with {decoder.get('type') or 'nothing'})")
    replaced = [(step["pattern"]["String"], step["content"]) for step in steps if step["type"] == "Replace"]

    def to_bytes(token: str) -> bytes:
        if byte := _BYTE_PIECE.fullmatch(token):
            return bytes.fromhex(byte[1])
        for old, new in replaced:
            token = token.replace(old, new)
        return token.encode()
    return to_bytes


def message_text(content: str | list[dict] | None) -> str:
    """A message's content as one string: OpenAI's list of parts is joined with newlines, as vLLM does."""
    if not isinstance(content, list):
        return content or ""
    texts = []
    for part in content:
        if part.get("type") != "text":
            raise ValueError(f"content part of type {part.get('type')!r} is not supported (text only)")
        texts.append(part["text"])
    return "\n".join(texts)


# Mistral's templates refuse a call id that is not nine characters (its models write nine letters and digits).
_NINE_CHAR_IDS = re.compile(r"id['\"\]]*\s*\|\s*length\s*!=\s*9")  # tool_call.id|length, ['tool_call_id']|length
_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


def _mistral_call_id(call_id: str) -> str:
    """A call id as Mistral's models write one: an id of another form becomes nine hex digits of its hash, the
    same for the call and the result that answers it."""
    return call_id if _MISTRAL_ID.fullmatch(call_id) else hashlib.sha256(call_id.encode()).hexdigest()[:9]


def _tool_call(call: dict, call_id: Callable[[str], str]) -> dict:
    """Templates (Qwen's, Llama's) index into the arguments, so a JSON object string becomes a dict."""
    function = dict(call.get("function") or {})
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            function["arguments"] = parsed
    out = {**call, "function": function}
    if call.get("id") is not None:
        out["id"] = call_id(call["id"])
    return out


def _message(message: dict, call_id: Callable[[str], str]) -> dict:
    msg = dict(message)
    msg["content"] = message_text(msg.get("content"))  # None: an assistant turn that only calls tools
    if msg.get("tool_calls"):
        msg["tool_calls"] = [_tool_call(c, call_id) for c in msg["tool_calls"]]
    if msg.get("tool_call_id") is not None:
        msg["tool_call_id"] = call_id(msg["tool_call_id"])
    return msg


@dataclass
class DocToken:
    """One token of the document the model reads, and who wrote its text."""

    id: int
    author: str  # "template" (markers, role names, defaults it adds) or the role of the message it came from
    special: bool  # a control token: only the template's own markers become one


class Tokenizer:
    """A transformers tokenizer plus injection-safe chat encoding and a byte table for detokenizing."""

    def __init__(self, hf: PreTrainedTokenizerBase):
        if getattr(hf, "backend_tokenizer", None) is None:
            raise ValueError(f"{type(hf).__name__} has no fast (tokenizers) backend, which zhuzi needs")
        self.hf = hf
        self.eos_token_id: int | None = hf.eos_token_id
        # A private copy that never parses special tokens: the transformers tokenizer flips that flag on
        # its shared backend per call, which races between threads.
        self._text = RustTokenizer.from_str(hf.backend_tokenizer.to_str())
        self._text.encode_special_tokens = True
        # Where a server's long texts are encoded (see encoder_process.py); else in the caller's thread.
        self.encoder: EncoderProcess | None = None
        self._special_ids = {t.content: i for i, t in hf.added_tokens_decoder.items() if t.special}
        self.all_special_ids: frozenset[int] = frozenset(self._special_ids.values()) | frozenset(hf.all_special_ids)
        specials = sorted(self._special_ids, key=len, reverse=True)  # longest match wins, as in the tokenizer
        self._special_re = re.compile("|".join(map(re.escape, specials)) or "(?!)")
        self._placeholders = {s: _ESC + chr(_CODE_BASE + k) for k, s in enumerate(specials)}
        self._originals = {p: s for s, p in self._placeholders.items()} | {_ESC * 2: _ESC}
        self._prefix, self._suffix = self._plain_text_wrapping()

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """A Hugging Face directory or a GGUF file (named .gguf, or as Ollama's store names its blobs)."""
        path = Path(path)
        if path.is_file():
            return cls(_load_gguf(path))
        if path.is_dir():
            return cls(AutoTokenizer.from_pretrained(path, local_files_only=True))
        raise FileNotFoundError(f"no tokenizer at {path} (expected a Hugging Face directory or a GGUF file)")

    def use_encoder_process(self) -> None:
        """From now on long texts are encoded in a helper process (a server's choice: see encoder_process.py)."""
        self.encoder = EncoderProcess(self._text)

    def __len__(self) -> int:
        return len(self.hf)

    def _plain_text_wrapping(self) -> tuple[list[int], list[int]]:
        """The ids the tokenizer always puts around plain text (a BOS for Llama-3, nothing for ChatML models)."""
        bare = self._text.encode("a", add_special_tokens=False).ids
        full = self._text.encode("a", add_special_tokens=True).ids
        at = next(i for i in range(len(full)) if full[i:i + len(bare)] == bare)
        return full[:at], full[at + len(bare):]

    def encode(self, text: str, *, parse_special: bool = False, add_special_tokens: bool = True) -> list[int]:
        """add_special_tokens: the ids the tokenizer puts around plain text (a BOS for Llama-3)."""
        core = self._encode_markup(text, lambda s: s) if parse_special else self._encode_text(text)
        return self._prefix + core + self._suffix if add_special_tokens else core

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """A completions prompt: ids as given, or text whose special-token strings are control tokens
        (a raw prompt is the caller's own document, as vLLM reads it)."""
        return self.encode(prompt, parse_special=True) if isinstance(prompt, str) else list(prompt)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_strs(self, ids: list[int]) -> list[str]:
        """Each id's token as the vocabulary writes it ("Ġworld")."""
        return in_slices(functools.partial(map, self._token_strs.__getitem__), ids)

    def warm(self) -> None:
        """Build token_strs' table now (a server does as it loads): built on first use, it would hold the GIL
        in the middle of a request, and the event loop would wait with it."""
        self._token_strs  # noqa: B018 (a cached property: reading it builds it)

    @functools.cached_property
    def _token_strs(self) -> list[str]:
        # A table: converting a million ids one by one would hold the GIL for half a second.
        size = max(len(self), max(self.hf.get_vocab().values()) + 1)
        return [token or "" for token in self.hf.convert_ids_to_tokens(list(range(size)))]

    @functools.cached_property
    def token_bytes(self) -> list[bytes]:
        """Each id's exact bytes: what the detokenizer joins, so it never decodes a window of text twice."""
        vocab = self._text.get_vocab(with_added_tokens=False)
        to_bytes = _byte_level_bytes if isinstance(self._text.decoder, ByteLevel) else _piece_bytes(self._text)
        table = [b""] * max(len(self), max(vocab.values()) + 1)
        for token, i in vocab.items():
            table[i] = to_bytes(token)
        for i, added in self.hf.added_tokens_decoder.items():
            table[i] = added.content.encode()  # added tokens are stored as text, not in the byte alphabet
        return table

    def bytes_of(self, token_id: int) -> bytes:
        """A token's own bytes; empty for the spare ids of a model whose vocabulary outgrows its tokenizer's."""
        table = self.token_bytes
        return table[token_id] if token_id < len(table) else b""

    @functools.cached_property
    def thought_tags(self) -> ThoughtTags | None:
        """The tags of a thinking model's thought (the first kind whose both tags its vocabulary has); None for
        a model that does not think."""
        vocab = self.hf.get_vocab()
        return next((tags for tags in THOUGHT_TAGS if tags.open in vocab and tags.close in vocab), None)

    @functools.cached_property
    def think_ids(self) -> tuple[int, int] | None:
        """The ids of a thinking model's open and close tags; None for a model that does not think."""
        tags, vocab = self.thought_tags, self.hf.get_vocab()
        return (vocab[tags.open], vocab[tags.close]) if tags else None

    @functools.cached_property
    def skipped_ids(self) -> frozenset[int]:
        """What skip_special_tokens leaves out: the special tokens, but a thought's tags and tool-call markers,
        which the parsers read (Gemma 4's are special; llama.cpp renders them for the same reason)."""
        markers = frozenset(i for text, i in self._special_ids.items() if text in TOOL_MARKERS)
        return self.all_special_ids - frozenset(self.think_ids or ()) - markers

    @functools.cached_property
    def harmony(self) -> bool:
        """Whether the model speaks gpt-oss's harmony format: its vocabulary has harmony's markers as control
        tokens (the switch for every checkpoint of the family, a GGUF file's too, whatever its template)."""
        return all(marker in self._special_ids for marker in HARMONY_MARKERS)

    def special_id(self, marker: str) -> int:
        """A control token's id ("<|start|>")."""
        return self._special_ids[marker]

    def encode_pieces(self, pieces: list[str | int]) -> list[int]:
        """A document built piece by piece: ids as given, each text encoded apart as plain text (never a control
        token), in one batch."""
        texts = iter(self._encode_texts([piece for piece in pieces if isinstance(piece, str)]))
        return [i for piece in pieces for i in ([piece] if isinstance(piece, int) else next(texts))]

    @functools.cached_property
    def template_variables(self) -> frozenset[str]:
        """The names the chat template reads (tools, enable_thinking, ...), so callers know what it renders."""
        template = self.hf.chat_template
        if not isinstance(template, str):
            return frozenset()
        try:
            parsed = jinja2.Environment(extensions=[jinja2.ext.loopcontrols]).parse(template)
        except jinja2.TemplateSyntaxError:  # an extension tag transformers knows: read the words instead
            return frozenset(re.findall(r"[A-Za-z_]\w*", template))
        return frozenset(jinja2.meta.find_undeclared_variables(parsed))

    @functools.cached_property
    def _call_id(self) -> Callable[[str], str]:
        """A call id as the template takes it: Mistral's nine characters, or as the client sent it."""
        template = self.hf.chat_template
        return _mistral_call_id if isinstance(template, str) and _NINE_CHAR_IDS.search(template) else str

    @functools.cached_property
    def bpe_model(self) -> dict[str, Any]:
        """The BPE model as tokenizer.json stores it: vocab, merges in rank order, options."""
        model = json.loads(self._text.to_str())["model"]
        if model.get("type") != "BPE":
            raise ValueError(f"this tokenizer's model is {model.get('type')}, not byte-level BPE")
        return model

    def pre_tokenize(self, text: str) -> list[tuple[str, str]]:
        """The words BPE runs on, each as (its text, its characters in the model's byte alphabet)."""
        if self._text.normalizer is not None:
            text = self._text.normalizer.normalize_str(text)
        if self._text.pre_tokenizer is None:
            return [(text, text)] if text else []
        return [(text[a:b], word) for word, (a, b) in self._text.pre_tokenizer.pre_tokenize_str(text)]

    def render_chat(self, messages: list[dict], *, tools: list[dict] | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    chat_template_kwargs: dict | None = None) -> str:
        """The document the model reads, as text."""
        escaped = self._render_escaped(messages, tools, add_generation_prompt, continue_final_message,
                                       chat_template_kwargs)
        return self._unescape(escaped)

    def encode_chat(self, messages: list[dict], *, tools: list[dict] | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    chat_template_kwargs: dict | None = None) -> list[int]:
        """The ids of render_chat's document, where only the template's own markers are control ids."""
        escaped = self._render_escaped(messages, tools, add_generation_prompt, continue_final_message,
                                       chat_template_kwargs)
        return self._encode_markup(escaped, self._unescape)

    def chat_document(self, messages: list[dict], *, tools: list[dict] | None = None,
                      add_generation_prompt: bool = True, continue_final_message: bool = False,
                      chat_template_kwargs: dict | None = None) -> list[DocToken]:
        """encode_chat's tokens, each with its author.

        A template that cuts into content (a strip, dropping an answer's reasoning) damages the marks or
        changes the tokens; each message's content (else each of its lines) is then searched for, in order,
        in the unmarked render."""
        args = (tools, add_generation_prompt, continue_final_message, chat_template_kwargs)
        ids = self.encode_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message,
                               chat_template_kwargs=chat_template_kwargs)
        roles = [m.get("role", "template") for m in messages]
        pieces = self._pieces(self._render_escaped(messages, *args, mark_authors=True), roles)
        tokens = self.author_tokens(pieces) if pieces is not None else []
        if [t.id for t in tokens] != ids:
            pieces = self._pieces(self._render_escaped(messages, *args), [])  # no roles: nothing reads as a mark
            assert pieces is not None
            self._search_authors(pieces, messages)
            tokens = self.author_tokens(pieces)
        return tokens

    def _pieces(self, escaped: str, roles: list[str]) -> list[tuple[str, list[str]] | int] | None:
        """A rendered document cut as encode_chat cuts it: the template's markers (their ids) and the
        text between them with each character's author; None if the marks came out damaged."""
        pieces: list[tuple[str, list[str]] | int] = []
        start = 0
        for m in [*self._special_re.finditer(escaped), None]:
            text = self._unmark(escaped[start:m.start() if m else len(escaped)], roles)
            if text is None:
                return None
            pieces.append(text)
            if m:
                pieces.append(self._special_ids[m.group()])
                start = m.end()
        return pieces

    def _unmark(self, escaped: str, roles: list[str]) -> tuple[str, list[str]] | None:
        """Escaped, marked text -> the real text and each character's author (None: unpaired marks)."""
        text: list[str] = []
        authors: list[str] = []
        author, chars = None, iter(escaped)
        for ch in chars:
            if ch == _AUTHOR_END or 0 <= ord(ch) - _AUTHOR_BASE < len(roles):
                if (ch == _AUTHOR_END) == (author is None):  # an end without a start, or a start inside one
                    return None
                author = None if ch == _AUTHOR_END else roles[ord(ch) - _AUTHOR_BASE]
            else:
                real = self._unescape(ch + next(chars, "")) if ch == _ESC else ch
                text.append(real)
                authors += [author or "template"] * len(real)
        return ("".join(text), authors) if author is None else None

    @staticmethod
    def _search_authors(pieces: list[tuple[str, list[str]] | int], messages: list[dict]) -> None:
        """Marks each message's text found, in order, in the pieces: its stripped content, else its lines."""
        k, at = 0, 0  # where the search goes on: piece index, offset in it
        for message in messages:
            content = message_text(message.get("content")).strip()
            parts = [content] if content else []
            if parts and not any(content in p[0] for p in pieces[k:] if not isinstance(p, int)):
                parts = [line.strip() for line in content.splitlines() if line.strip()]
            for part in parts:
                for j in range(k, len(pieces)):
                    piece = pieces[j]
                    found = -1 if isinstance(piece, int) else piece[0].find(part, at if j == k else 0)
                    if found >= 0:
                        piece[1][found:found + len(part)] = [message.get("role", "template")] * len(part)
                        k, at = j, found + len(part)
                        break

    def author_tokens(self, pieces: list[tuple[str, list[str]] | int]) -> list[DocToken]:
        """Tokens of the pieces; a token's author is the one who wrote most of its characters."""
        texts = [piece for piece in pieces if not isinstance(piece, int)]
        encodings = iter(self._text.encode_batch([text for text, _ in texts], add_special_tokens=False))
        tokens = []
        for piece in pieces:
            if isinstance(piece, int):
                tokens.append(DocToken(piece, "template", True))
                continue
            authors, encoding = piece[1], next(encodings)
            for token_id, (start, end) in zip(encoding.ids, encoding.offsets):
                owners = Counter(authors[start:max(end, start + 1)])
                tokens.append(DocToken(token_id, owners.most_common(1)[0][0] if owners else "template", False))
        return tokens

    def _render_escaped(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool,
                        continue_final_message: bool, chat_template_kwargs: dict | None,
                        mark_authors: bool = False) -> str:
        if not self.hf.chat_template:
            raise ValueError("this checkpoint has no chat template: use the completions API with a plain prompt")
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message needs add_generation_prompt=False")
        kwargs = dict(chat_template_kwargs or {})
        if clash := sorted(kwargs.keys() & _RESERVED_KWARGS):
            raise ValueError(f"chat_template_kwargs may not set {', '.join(clash)}")
        escaped = self._escape([_message(m, self._call_id) for m in messages])
        if mark_authors:
            escaped = [{**m, "content": f"{chr(_AUTHOR_BASE + i)}{m['content']}{_AUTHOR_END}"} if m["content"] else m
                       for i, m in enumerate(escaped)]
        try:
            return self.hf.apply_chat_template(
                escaped, tools=self._escape(tools),
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                tokenize=False, **self._escape(kwargs))
        except jinja2.TemplateError as e:  # e.g. the template's raise_exception("roles must alternate")
            raise ValueError(f"chat template: {self._unescape(str(e))}") from e

    def _escape(self, value: Any) -> Any:
        if isinstance(value, str):
            doubled = value.replace(_ESC, _ESC * 2)
            return self._special_re.sub(lambda m: self._placeholders[m.group()], doubled)
        if isinstance(value, dict):
            return {self._escape(k): self._escape(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._escape(v) for v in value]
        return value

    def _unescape(self, text: str) -> str:
        if _ESC not in text:
            return text
        return re.sub(f"{_ESC}.", lambda m: self._originals.get(m.group(), m.group()), text, flags=re.DOTALL)

    def _encode_markup(self, doc: str, restore: Callable[[str], str]) -> list[int]:
        """Special-token strings in doc become their ids; the text between them, restored, is plain text."""
        texts, markers = [], []
        start = 0
        for m in self._special_re.finditer(doc):
            texts.append(restore(doc[start:m.start()]))
            markers.append([self._special_ids[m.group()]])
            start = m.end()
        texts.append(restore(doc[start:]))
        pieces = self._encode_texts(texts)
        return [i for text, marker in zip(pieces, markers + [[]]) for i in text + marker]

    def _encode_text(self, text: str) -> list[int]:
        return self._encode_texts([text])[0]

    def _encode_texts(self, texts: list[str]) -> list[list[int]]:
        # A batch call, even for one text: the tokenizers library lets go of the GIL for a batch (not for a
        # single encode), so that the event loop and the engine go on meanwhile.
        if self.encoder is not None and sum(map(len, texts)) >= LONG_TEXT:
            return self.encoder.encode(texts)
        return [e.ids for e in self._text.encode_batch_fast(texts, add_special_tokens=False)]
