"""OpenAI's formats, the last step before the wire: what a request produced (common/formats.py's ResponseState)
-> chat.completion(.chunk) and text_completion objects, whole or as SSE chunks, with their logprobs and usage;
and OpenAI's error object.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from fastapi.responses import JSONResponse

from zhuzi.outputs import CompletionOutput, Logprob, PromptProgress
from zhuzi.server.common.errors import ApiError
from zhuzi.server.common.formats import Choice, ResponseState, sse
from zhuzi.server.common.parsers import ParsedText
from zhuzi.server.openai import answers as r
from zhuzi.server.openai import protocol as p


def error_info(error: ApiError) -> r.ErrorInfo:
    return r.ErrorInfo(message=error.message, type=error.type, param=error.param, code=error.code)


def error_response(error: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI's error object, with the error's status."""
    return JSONResponse(r.ErrorResponse(error=error_info(error)).model_dump(), status_code=error.status,
                        headers=headers)


def usage_of(gen: ResponseState) -> r.Usage:
    return r.Usage.of(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens, gen.reasoning_tokens)


def finish_reason_of(choice: Choice) -> str | None:
    """OpenAI's finish_reason: tool_calls for a reply that stopped after calling (a call that failed is text, and
    stop_reason says why: OpenAI's set of finish reasons is closed)."""
    if choice.finish_reason == "stop" and choice.parsed.tool_calls:
        return "tool_calls"
    return choice.finish_reason


class OpenAIStream:
    """How OpenAI's chat and completion streams end: the usage chunk if asked for, an error object, [DONE]."""

    body: p.ChatCompletionRequest | p.CompletionRequest
    chunk_type: type[r.ChatCompletionChunk] | type[r.CompletionResponse]
    request_id: str
    model: str
    created: int

    def progress(self, progress: PromptProgress) -> list[str]:
        if not self.body.return_progress:
            return []
        return [sse(self.chunk_type(id=self.request_id, created=self.created, model=self.model, choices=[],
                                    prompt_progress=progress_of(progress)))]

    def end(self, gen: ResponseState) -> list[str]:
        usage = sse(self.chunk_type(id=self.request_id, created=self.created, model=self.model, choices=[],
                                    usage=usage_of(gen)))
        return ([usage] if self.body.include_usage_chunk else []) + [DONE]

    def failure(self, gen: ResponseState, error: ApiError) -> list[str]:
        return [sse(r.ErrorResponse(error=error_info(error))), DONE]


DONE = "data: [DONE]\n\n"


class ChatFormat(OpenAIStream):
    """chat.completion / chat.completion.chunk."""

    chunk_type = r.ChatCompletionChunk

    def __init__(self, request_id: str, model: str, body: p.ChatCompletionRequest, prompt_ids: list[int],
                 token_bytes: Callable[[int], bytes]) -> None:
        self.request_id, self.model, self.body = request_id, model, body
        self.prompt_ids, self.token_bytes = prompt_ids, token_bytes
        self.created = int(time.time())

    def _chunk(self, index: int, delta: r.DeltaMessage, logprobs: r.ChatLogprobs | None = None,
               finish_reason: str | None = None, stop_reason: int | str | None = None,
               token_ids: list[int] | None = None, prompt_token_ids: list[int] | None = None,
               **marks: list | None) -> str:
        choice = r.ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason,
                                   stop_reason=stop_reason, token_ids=token_ids, **marks)
        return sse(r.ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model,
                                         choices=[choice], prompt_token_ids=prompt_token_ids))

    def _logprobs(self, token_ids: list[int], entries: list[dict[int, Logprob]]) -> r.ChatLogprobs | None:
        if not self.body.logprobs:
            return None
        return chat_logprobs(token_ids, entries, self.body.top_logprobs or 0, self.token_bytes,
                             self.body.return_tokens_as_token_ids)

    def draft_marks(self, tokens: CompletionOutput | Choice) -> dict[str, list | None]:
        """With return_token_ids on a speculating server, per token: whether it was an accepted draft, and for
        the model's own token of a step that checked drafts, the drafts that step rejected."""
        if not self.body.return_token_ids:
            return {}
        return {"draft_accepted": tokens.draft_accepted, "drafts_rejected": tokens.drafts_rejected}

    def events(self, gen: ResponseState, choice: Choice, delta: CompletionOutput, piece: ParsedText,
               prompt_index: int) -> list[str]:
        out = []
        with_ids = self.body.return_token_ids
        if not choice.started:
            choice.started = True
            out.append(self._chunk(choice.index, r.DeltaMessage(role="assistant", content=""),
                                   prompt_token_ids=self.prompt_ids if with_ids else None))
        logprobs = self._logprobs(delta.token_ids, delta.logprobs or [])
        held_back = (logprobs and logprobs.content) or (with_ids and delta.token_ids)  # news without text
        if piece.content or piece.reasoning_content or held_back:
            message = r.DeltaMessage(content=piece.content or None,
                                     reasoning_content=piece.reasoning_content or None)
            if message.content is None and message.reasoning_content is None:
                message.content = ""  # logprobs or ids of text still held back
            out.append(self._chunk(choice.index, message, logprobs, token_ids=delta.token_ids if with_ids else None,
                                   **self.draft_marks(delta)))
        for call in piece.tool_calls:  # a whole call, or OpenAI's pieces: id and name first, then arguments
            tool = r.DeltaToolCall(index=call.index, id=call.id, type="function" if call.id else None,
                                   function=r.DeltaFunction(name=call.name, arguments=call.arguments))
            out.append(self._chunk(choice.index, r.DeltaMessage(tool_calls=[tool])))
        if choice.finish_reason is not None:
            out.append(self._chunk(choice.index, r.DeltaMessage(), finish_reason=finish_reason_of(choice),
                                   stop_reason=choice.call_failure or choice.stop_reason))
        return out

    def response(self, gen: ResponseState) -> r.ChatCompletionResponse:
        choices = []
        for c in gen.sorted_choices():
            calls = [r.ToolCallOut(id=t.id, function=r.FunctionCallOut(name=t.name, arguments=t.arguments))
                     for t in c.parsed.tool_calls]
            message = r.ChatResponseMessage(content=c.parsed.content if c.parsed.content or not calls else None,
                                            reasoning_content=c.parsed.reasoning_content or None,
                                            tool_calls=calls or None)
            choices.append(r.ChatChoice(index=c.index, message=message, finish_reason=finish_reason_of(c),
                                        stop_reason=c.call_failure or c.stop_reason,
                                        logprobs=self._logprobs(c.token_ids, c.logprobs),
                                        token_ids=c.token_ids if self.body.return_token_ids else None,
                                        **self.draft_marks(c)))
        return r.ChatCompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                        choices=choices, usage=usage_of(gen),
                                        prompt_token_ids=self.prompt_ids if self.body.return_token_ids else None)


class CompletionFormat(OpenAIStream):
    """text_completion, whole or chunked; echo puts the prompt before the first text of each choice."""

    chunk_type = r.CompletionResponse

    def __init__(self, request_id: str, model: str, body: p.CompletionRequest, prompt_texts: list[str],
                 prompt_ids: list[list[int]], decode: Callable[[int], str]) -> None:
        self.request_id, self.model, self.body = request_id, model, body
        self.prompt_texts, self.prompt_ids, self.decode = prompt_texts, prompt_ids, decode
        self.created = int(time.time())
        self.offsets: dict[int, int] = {}  # text_offset reached per choice

    def _piece(self, gen: ResponseState, choice: Choice, prompt_index: int, text: str, token_ids: list[int],
               entries: list[dict[int, Logprob]], first: bool) -> r.CompletionChoice:
        """A choice's text and logprobs for some tokens, with the echoed prompt before the first."""
        entries_in: list[dict[int, Logprob] | None] = list(entries)
        if first and self.body.echo:
            prompt = self.prompt_ids[prompt_index]
            text = self.prompt_texts[prompt_index] + text
            token_ids = prompt + token_ids
            entries_in = (gen.prompts[prompt_index].logprobs or [None] * len(prompt)) + entries_in
        logprobs = None
        if self.body.logprobs is not None:
            offset = self.offsets.get(choice.index, 0)
            logprobs = completion_logprobs(token_ids, entries_in, self.body.logprobs, offset, self.decode)
            self.offsets[choice.index] = offset + sum(len(token) for token in logprobs.tokens)
        return r.CompletionChoice(index=choice.index, text=text, logprobs=logprobs,
                                  finish_reason=choice.finish_reason, stop_reason=choice.stop_reason,
                                  prompt_logprobs=self._prompt_logprobs(gen, prompt_index) if first else None)

    def _prompt_logprobs(self, gen: ResponseState, prompt_index: int) -> list[dict[str, r.PromptLogprob] | None] | None:
        """vLLM's prompt_logprobs: per prompt token (none for the first) its own and the top ones."""
        top_n, entries = self.body.prompt_logprobs, gen.prompts[prompt_index].logprobs
        if top_n is None or entries is None:
            return None
        return [None if entry is None else {
            str(i): r.PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
            for i, lp in entry.items() if i == token_id or lp.rank <= top_n}
            for token_id, entry in zip(self.prompt_ids[prompt_index], entries)]

    def events(self, gen: ResponseState, choice: Choice, delta: CompletionOutput, piece: ParsedText,
               prompt_index: int) -> list[str]:
        first, choice.started = not choice.started, True
        item = self._piece(gen, choice, prompt_index, piece.content, delta.token_ids, delta.logprobs or [], first)
        if not (item.text or item.finish_reason or item.prompt_logprobs or (item.logprobs and item.logprobs.tokens)):
            return []
        return [sse(r.CompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                         choices=[item]))]

    def response(self, gen: ResponseState) -> r.CompletionResponse:
        choices = [self._piece(gen, c, c.index // gen.n, c.parsed.content, c.token_ids, c.logprobs, True)
                   for c in gen.sorted_choices()]
        return r.CompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                    choices=choices, usage=usage_of(gen))


def progress_of(progress: PromptProgress) -> r.PromptProgress:
    return r.PromptProgress(prompt_tokens_processed=progress.processed, prompt_tokens_total=progress.total,
                            cached=progress.cached)


# ------------------------------------------------------------------ logprobs

def _top(entry: dict[int, Logprob], top_n: int) -> list[tuple[int, Logprob]]:
    return sorted((item for item in entry.items() if item[1].rank <= top_n), key=lambda item: item[1].rank)[:top_n]


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], top_n: int,
                  token_bytes: Callable[[int], bytes], as_ids: bool = False) -> r.ChatLogprobs:
    """From the engine's per-token entries (the chosen token plus the top ones). bytes are each token's own,
    as OpenAI defines them: a token holding part of a character shows U+FFFD as text but its real bytes."""
    def item(token_id: int, lp: Logprob) -> r.TopLogprob:
        token = f"token_id:{token_id}" if as_ids else lp.decoded_token or ""
        return r.TopLogprob(token=token, logprob=lp.logprob, bytes=list(token_bytes(token_id)))

    content = []
    for token_id, entry in zip(token_ids, entries):
        chosen = item(token_id, entry[token_id])
        tops = [item(i, lp) for i, lp in _top(entry, top_n)]
        content.append(r.TokenLogprob(**chosen.model_dump(), top_logprobs=tops))
    return r.ChatLogprobs(content=content)


def completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob] | None], top_n: int, offset: int,
                        decode: Callable[[int], str]) -> r.CompletionLogprobs:
    """The legacy format; a None entry (a prompt's first token) has no logprob."""
    out = r.CompletionLogprobs()
    for token_id, entry in zip(token_ids, entries):
        token = (entry[token_id].decoded_token if entry else None) or decode(token_id)
        out.tokens.append(token)
        out.token_logprobs.append(entry[token_id].logprob if entry else None)
        out.top_logprobs.append({lp.decoded_token or "": lp.logprob for _, lp in _top(entry, top_n)}
                                if entry else None)
        out.text_offset.append(offset)
        offset += len(token)
    return out
