"""The first and last steps of the request path: HTTP in, JSON or SSE out.

A request comes in -> gateway (key, rate, queue room) -> validated into the
protocol models -> chat template + tokenizer -> the async engine, which
yields deltas -> parsers split reasoning / content / tool calls -> one JSON
response, or SSE chunks as the deltas arrive. Every refusal is OpenAI's
error object with a 4xx; a client that goes away aborts its generation.

`zhuzi serve` starts uvicorn at once and loads the model in a thread, so
/health says 503 until the model is ready.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pydantic
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import zhuzi
from zhuzi.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from zhuzi.sampling_params import SamplingParams
from zhuzi.server import protocol as p
from zhuzi.server.gateway import Admission, Gateway, GatewayError, retry_after_header
from zhuzi.server.metrics import ServerMetrics
from zhuzi.server.parsers import THINK_CLOSE, THINK_OPEN, OutputParser, ParsedText, opened_thought

log = logging.getLogger("zhuzi.server")
SERVE_LONG_PREFILL_TOKENS = 128
T = TypeVar("T")
ModelT = TypeVar("ModelT", bound=pydantic.BaseModel)


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: list[str] = field(default_factory=list)
    served_model_name: str | None = None  # default: the engine's model name
    rate_limit_rpm: int | None = None
    rate_limit_tpm: int | None = None
    max_waiting: int = 256  # sequences allowed to queue beyond the engine's max_num_seqs


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


def error_response(status: int, message: str, type: str, param: str | None = None, code: str | int | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = p.ErrorResponse(error=p.ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def sse(payload: pydantic.BaseModel | dict) -> str:
    data = payload.model_dump_json() if isinstance(payload, pydantic.BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


# ------------------------------------------------------------------ one generation's state

@dataclass
class Choice:
    """One of the n completions of one prompt, as its deltas accumulate."""

    index: int
    parser: OutputParser
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    parsed: ParsedText = field(default_factory=ParsedText)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    started: bool = False  # streaming: whether its first chunk went out

    def absorb(self, delta: CompletionOutput) -> ParsedText:
        """Take one engine delta; return the parsed news it brings."""
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        piece = self.parser.feed(delta.text)
        if delta.finish_reason is not None:
            piece.extend(self.parser.finish())
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        self.parsed.extend(piece)
        return piece

    @property
    def openai_finish_reason(self) -> str | None:
        if self.finish_reason == "stop" and self.parsed.tool_calls:
            return "tool_calls"
        return self.finish_reason


@dataclass
class PromptState:
    token_count: int = 0
    cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    logprobs: list[dict[int, Logprob] | None] | None = None  # prompt logprobs (echo)


@dataclass
class Generation:
    """Everything one API request produced so far, across its prompts and choices."""

    n: int
    new_parser: Callable[[], OutputParser]
    prompts: list[PromptState]
    choices: dict[int, Choice] = field(default_factory=dict)

    def update(self, prompt_index: int, out: RequestOutput) -> list[tuple[Choice, CompletionOutput, ParsedText]]:
        state = self.prompts[prompt_index]
        state.token_count, state.cached_tokens = len(out.prompt_token_ids), out.num_cached_tokens
        state.metrics = out.metrics or state.metrics
        if state.logprobs is None:
            state.logprobs = out.prompt_logprobs
        news = []
        for delta in out.outputs:
            index = prompt_index * self.n + delta.index
            choice = self.choices.setdefault(index, Choice(index, self.new_parser()))
            news.append((choice, delta, choice.absorb(delta)))
        return news

    def usage(self) -> p.Usage:
        completion = sum(len(c.token_ids) for c in self.choices.values())
        return p.Usage.of(sum(s.token_count for s in self.prompts), completion,
                          sum(s.cached_tokens for s in self.prompts))

    def sorted_choices(self) -> list[Choice]:
        return [self.choices[i] for i in sorted(self.choices)]


# ------------------------------------------------------------------ response formats

class ChatFormat:
    """chat.completion / chat.completion.chunk."""

    def __init__(self, request_id: str, model: str, body: p.ChatCompletionRequest) -> None:
        self.request_id, self.model, self.body = request_id, model, body
        self.created = int(time.time())
        self.tool_call_counts: dict[int, int] = {}

    def _chunk(self, index: int, delta: p.DeltaMessage, logprobs: p.ChatLogprobs | None = None,
               finish_reason: str | None = None, stop_reason: int | str | None = None) -> str:
        choice = p.ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason,
                                   stop_reason=stop_reason)
        return sse(p.ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model,
                                         choices=[choice]))

    def _logprobs(self, token_ids: list[int], entries: list[dict[int, Logprob]]) -> p.ChatLogprobs | None:
        return p.ChatLogprobs.of(token_ids, entries, self.body.top_logprobs or 0) if self.body.logprobs else None

    def chunks(self, gen: Generation, choice: Choice, delta: CompletionOutput, piece: ParsedText,
               prompt_index: int) -> list[str]:
        out = []
        if not choice.started:
            choice.started = True
            out.append(self._chunk(choice.index, p.DeltaMessage(role="assistant", content="")))
        logprobs = self._logprobs(delta.token_ids, delta.logprobs or [])
        if piece.content or piece.reasoning_content or (logprobs and logprobs.content):
            message = p.DeltaMessage(content=piece.content or None,
                                     reasoning_content=piece.reasoning_content or None)
            if message.content is None and message.reasoning_content is None:
                message.content = ""  # logprobs of text still held back
            out.append(self._chunk(choice.index, message, logprobs))
        for call in piece.tool_calls:
            number = self.tool_call_counts.get(choice.index, 0)
            self.tool_call_counts[choice.index] = number + 1
            tool = p.DeltaToolCall(index=number, id=call.id, type="function",
                                   function=p.DeltaFunction(name=call.name, arguments=call.arguments))
            out.append(self._chunk(choice.index, p.DeltaMessage(tool_calls=[tool])))
        if choice.finish_reason is not None:
            out.append(self._chunk(choice.index, p.DeltaMessage(), finish_reason=choice.openai_finish_reason,
                                   stop_reason=choice.stop_reason))
        return out

    def usage_chunk(self, gen: Generation) -> str:
        return sse(p.ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model,
                                         choices=[], usage=gen.usage()))

    def response(self, gen: Generation) -> p.ChatCompletionResponse:
        choices = []
        for c in gen.sorted_choices():
            calls = [p.ToolCallOut(id=t.id, function=p.FunctionCallOut(name=t.name, arguments=t.arguments))
                     for t in c.parsed.tool_calls]
            message = p.ChatResponseMessage(content=c.parsed.content if c.parsed.content or not calls else None,
                                            reasoning_content=c.parsed.reasoning_content or None,
                                            tool_calls=calls or None)
            choices.append(p.ChatChoice(index=c.index, message=message, finish_reason=c.openai_finish_reason,
                                        stop_reason=c.stop_reason, logprobs=self._logprobs(c.token_ids, c.logprobs)))
        return p.ChatCompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                        choices=choices, usage=gen.usage())


class CompletionFormat:
    """text_completion, whole or chunked; echo puts the prompt before the first text of each choice."""

    def __init__(self, request_id: str, model: str, body: p.CompletionRequest, prompt_texts: list[str],
                 prompt_ids: list[list[int]], decode: Callable[[int], str]) -> None:
        self.request_id, self.model, self.body = request_id, model, body
        self.prompt_texts, self.prompt_ids, self.decode = prompt_texts, prompt_ids, decode
        self.created = int(time.time())
        self.offsets: dict[int, int] = {}  # text_offset reached per choice

    def _piece(self, gen: Generation, choice: Choice, prompt_index: int, text: str, token_ids: list[int],
               entries: list[dict[int, Logprob]], first: bool) -> p.CompletionChoice:
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
            logprobs = p.CompletionLogprobs.of(token_ids, entries_in, self.body.logprobs, offset, self.decode)
            self.offsets[choice.index] = offset + sum(len(token) for token in logprobs.tokens)
        return p.CompletionChoice(index=choice.index, text=text, logprobs=logprobs,
                                  finish_reason=choice.finish_reason, stop_reason=choice.stop_reason)

    def chunks(self, gen: Generation, choice: Choice, delta: CompletionOutput, piece: ParsedText,
               prompt_index: int) -> list[str]:
        first, choice.started = not choice.started, True
        item = self._piece(gen, choice, prompt_index, piece.content, delta.token_ids, delta.logprobs or [], first)
        if not (item.text or item.finish_reason or (item.logprobs and item.logprobs.tokens)):
            return []
        return [sse(p.CompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                         choices=[item]))]

    def usage_chunk(self, gen: Generation) -> str:
        return sse(p.CompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                        choices=[], usage=gen.usage()))

    def response(self, gen: Generation) -> p.CompletionResponse:
        choices = [self._piece(gen, c, c.index // gen.n, c.parsed.content, c.token_ids, c.logprobs, True)
                   for c in gen.sorted_choices()]
        return p.CompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                    choices=choices, usage=gen.usage())


Format = ChatFormat | CompletionFormat


# ------------------------------------------------------------------ async plumbing

async def first_outputs(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """The first output of every stream, concurrently; a refusal (ValueError) surfaces here."""
    tasks = [asyncio.ensure_future(anext(s)) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def merge_streams(firsts: list[RequestOutput],
                        streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from all streams as they come, each stream's first output first."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, first: RequestOutput, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            await queue.put((index, first, None))
            if not first.finished:
                async for out in stream:
                    await queue.put((index, out, None))
            await queue.put((index, None, done))
        except Exception as exc:  # handed to the consumer, who raises it
            await queue.put((index, None, exc))

    tasks = [asyncio.create_task(pump(i, f, s)) for i, (f, s) in enumerate(zip(firsts, streams))]
    try:
        remaining = len(tasks)
        while remaining:
            index, out, end = await queue.get()
            if end is done:
                remaining -= 1
            elif end is not None:
                raise end
            else:
                yield index, out
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run work, cancelling it if the client hangs up first (which aborts its generation)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


class ClientGone(Exception):
    pass


class ClosingStreamingResponse(StreamingResponse):
    """An SSE response that always runs its cleanup, even if the client left before the first byte."""

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.on_close()


# ------------------------------------------------------------------ the server

@dataclass
class Run:
    """One API request in flight: its engine streams and what must happen when it ends."""

    key: str
    admission: Admission
    streams: list[AsyncIterator[RequestOutput]]
    gen: Generation
    merged: AsyncIterator[tuple[int, RequestOutput]] | None = None
    closed: bool = False


class Server:
    def __init__(self, engine_or_loader: Any, config: ServerConfig,
                 on_load_error: Callable[[BaseException], None] | None = None) -> None:
        self.config = config
        self.engine: Any = None
        self.loader = engine_or_loader if callable(engine_or_loader) else None
        self.load_error: BaseException | None = None
        self.on_load_error = on_load_error
        self.gateway = Gateway(config.api_keys, config.rate_limit_rpm, config.rate_limit_tpm)
        self.metrics = ServerMetrics(self.engine_state)
        self.model_name = ""
        self.reasoning = False
        self.created = int(time.time())
        if self.loader is None:
            self.attach(engine_or_loader)

    # -- loading

    def attach(self, engine: Any) -> None:
        self.model_name = self.config.served_model_name or engine.model_name
        vocab = engine.tokenizer.hf.get_vocab()
        self.reasoning = THINK_OPEN in vocab and THINK_CLOSE in vocab  # a thinking model's own tags
        self.gateway.capacity = engine.config.max_num_seqs + self.config.max_waiting
        self.engine = engine
        stats = engine.stats()
        log.info("model %s loaded: dtype %s, KV cache %d tokens (%d blocks of %d), context %d tokens%s",
                 self.model_name, engine.config.dtype, stats.num_blocks * engine.config.block_size,
                 stats.num_blocks, engine.config.block_size, engine.max_model_len,
                 ", reasoning parser on" if self.reasoning else "")
        log.info("serving at http://%s:%d/v1", self.config.host, self.config.port)

    def start_loading(self, loop: asyncio.AbstractEventLoop) -> None:
        def load() -> None:
            try:
                engine = self.loader()
            except BaseException as exc:
                # A bad path or option is the user's to fix; anything else gets its traceback.
                log.error("failed to load the model: %s", exc, exc_info=not isinstance(exc, (ValueError, OSError)))
                self.load_error = exc
                if self.on_load_error:
                    loop.call_soon_threadsafe(self.on_load_error, exc)
                return
            loop.call_soon_threadsafe(self.attach, engine)

        threading.Thread(target=load, name="zhuzi-load", daemon=True).start()

    def engine_state(self) -> Any:
        return (self.model_name, self.engine.stats()) if self.engine is not None else None

    def ready(self) -> Any:
        if self.engine is None:
            why = f"the model failed to load: {self.load_error}" if self.load_error else "the model is loading"
            raise ApiError(503, f"Service unavailable: {why}.", "service_unavailable")
        return self.engine

    # -- request helpers

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model {model!r} does not exist; this server serves {self.model_name!r}.",
                           param="model", code="model_not_found")

    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = len(self.engine.tokenizer)
        if bad := [t for t in ids if not 0 <= t < vocab]:
            raise ApiError(400, f"{param} holds token ids outside the vocabulary [0, {vocab}): {bad[:5]}",
                           param=param)

    def sampling_params(self, body: p.ChatCompletionRequest | p.CompletionRequest) -> SamplingParams:
        try:
            params = body.to_sampling_params()
        except ValueError as exc:
            name = str(exc).split(" ", 1)[0]
            raise ApiError(400, str(exc), param=name if name in type(body).model_fields else None) from exc
        self.check_token_ids(params.stop_token_ids, "stop_token_ids")
        self.check_token_ids(list(params.logit_bias or {}), "logit_bias")
        return params

    def render_chat(self, body: p.ChatTemplateRequest) -> tuple[list[int], str]:
        """The prompt ids, and the text the prompt already holds of the reply (see OutputParser)."""
        tokenizer, messages, args = self.engine.tokenizer, body.template_messages(), body.template_args()
        try:
            ids = tokenizer.encode_chat(messages, **args)
            if body.continue_final_message:
                return ids, body.messages[-1].text
            # Only a thinking model's template can open a thought; skip the second render otherwise.
            return ids, opened_thought(tokenizer.render_chat(messages, **args)) if self.reasoning else ""
        except (ValueError, TypeError) as exc:  # template errors, and templates fed unexpected types
            raise ApiError(400, f"Cannot render the chat template: {exc}", param="messages") from exc

    # -- generation

    async def generate(self, request: Request, key: str, prompts: list[list[int]], params: SamplingParams,
                       fmt: Format, new_parser: Callable[[], OutputParser], stream: bool,
                       include_usage: bool) -> Response:
        admission = self.gateway.admit(params.n * len(prompts))
        self.gateway.charge_tokens(key, sum(len(ids) for ids in prompts))
        streams = [self.engine.generate(ids, params, f"{fmt.request_id}-{i}") for i, ids in enumerate(prompts)]
        run = Run(key, admission, streams, Generation(params.n, new_parser, [PromptState() for _ in prompts]))
        try:
            firsts = await until_disconnect(request, first_outputs(streams))
        except ValueError as exc:  # the engine refused it: too long for the context or the KV pool
            await self.close(run, ran=False)
            raise ApiError(400, str(exc), code="context_length_exceeded") from exc
        except BaseException:
            await self.close(run)
            raise
        run.merged = merge_streams(firsts, streams)
        if stream:
            return ClosingStreamingResponse(self.stream(run, fmt, include_usage), lambda: self.close(run))
        try:
            await until_disconnect(request, self.collect(run))
        finally:
            await self.close(run)
        return JSONResponse(fmt.response(run.gen).model_dump())

    async def collect(self, run: Run) -> None:
        async for index, out in run.merged:
            run.gen.update(index, out)

    async def stream(self, run: Run, fmt: Format, include_usage: bool) -> AsyncIterator[str]:
        try:
            async for index, out in run.merged:
                for choice, delta, piece in run.gen.update(index, out):
                    for chunk in fmt.chunks(run.gen, choice, delta, piece, index):
                        yield chunk
            if include_usage:
                yield fmt.usage_chunk(run.gen)
        except Exception as exc:  # the headers are out: report in-band, as OpenAI's streams do
            log.exception("stream %s failed", fmt.request_id)
            yield sse({"error": {"message": str(exc), "type": "internal_error", "param": None, "code": 500}})
        yield "data: [DONE]\n\n"

    async def close(self, run: Run, ran: bool = True) -> None:
        """End a request however it ended: abort what still runs, free its place, count it if it ran."""
        if run.closed:
            return
        run.closed = True
        if run.merged is not None:
            await run.merged.aclose()
        for stream in run.streams:
            await stream.aclose()  # aborts a request the engine still runs
        run.admission.release()
        gen = run.gen
        self.gateway.charge_tokens(run.key, sum(len(c.token_ids) for c in gen.choices.values()))
        if not ran:
            return
        for prompt_index, state in enumerate(gen.prompts):
            choices = [gen.choices.get(prompt_index * gen.n + i) for i in range(gen.n)]
            self.metrics.observe_request(
                self.model_name, state.metrics, state.token_count, sum(len(c.token_ids) for c in choices if c),
                [c.finish_reason if c and c.finish_reason else "abort" for c in choices])

    # -- endpoints

    async def chat(self, request: Request, key: str, body: p.ChatCompletionRequest) -> Response:
        self.check_model(body.model)
        params = self.sampling_params(body)
        ids, prefill = self.render_chat(body)
        fmt = ChatFormat(p.new_id("chatcmpl"), self.model_name, body)
        tools = body.parse_tool_calls

        def new_parser() -> OutputParser:
            return OutputParser(reasoning=self.reasoning, tools=tools, prefill=prefill)

        return await self.generate(request, key, [ids], params, fmt, new_parser, body.stream, body.include_usage_chunk)

    async def completions(self, request: Request, key: str, body: p.CompletionRequest) -> Response:
        self.check_model(body.model)
        params = self.sampling_params(body)
        tokenizer = self.engine.tokenizer
        prompts = body.prompts()
        prompt_ids = [tokenizer.encode(x, parse_special=True) if isinstance(x, str) else x for x in prompts]
        for ids in prompt_ids:
            self.check_token_ids(ids, "prompt")
        if any(not ids for ids in prompt_ids):
            raise ApiError(400, "prompt must not be empty", param="prompt")
        texts = [x if isinstance(x, str) else tokenizer.decode(x, skip_special_tokens=False) for x in prompts]

        def decode(token_id: int) -> str:
            return tokenizer.decode([token_id], skip_special_tokens=False)

        fmt = CompletionFormat(p.new_id("cmpl"), self.model_name, body, texts, prompt_ids, decode)

        def new_parser() -> OutputParser:
            return OutputParser(reasoning=False, tools=False)

        return await self.generate(request, key, prompt_ids, params, fmt, new_parser, body.stream,
                                   body.include_usage_chunk)

    def tokenize(self, body: p.TokenizeRequest) -> p.TokenizeResponse:
        self.check_model(body.model)
        tokenizer = self.engine.tokenizer
        ids = self.render_chat(body)[0] if body.messages is not None else tokenizer.encode(body.prompt,
                                                                                            parse_special=True)
        return p.TokenizeResponse(tokens=ids, token_strs=tokenizer.token_strs(ids), count=len(ids),
                                  max_model_len=self.engine.max_model_len)

    def detokenize(self, body: p.DetokenizeRequest) -> p.DetokenizeResponse:
        self.check_model(body.model)
        self.check_token_ids(body.tokens, "tokens")
        return p.DetokenizeResponse(prompt=self.engine.tokenizer.decode(body.tokens, skip_special_tokens=False))

    def models(self) -> p.ModelList:
        card = p.ModelCard(id=self.model_name, created=self.created,
                           root=self.engine.config.model or self.engine.model_name,
                           max_model_len=self.engine.max_model_len)
        return p.ModelList(data=[card])


async def parse_body(request: Request, model: type[ModelT]) -> ModelT:
    raw = await request.body()
    try:
        return model.model_validate_json(raw)
    except pydantic.ValidationError as exc:
        raise validation_error(exc) from exc


def validation_error(exc: pydantic.ValidationError) -> ApiError:
    first = exc.errors()[0]
    if first["type"] == "json_invalid":
        return ApiError(400, f"The body is not valid JSON: {first['msg']}")
    # A union's alternatives add their type names to loc; keep the list indexes and field names.
    loc = [str(x) for x in first["loc"] if isinstance(x, int) or x in _FIELD_NAMES]
    param = ".".join(loc) or None
    message = first["msg"].removeprefix("Value error, ")
    return ApiError(400, f"{param}: {message}" if param else message, param=param)


_FIELD_NAMES = {name for model in vars(p).values()
                if isinstance(model, type) and issubclass(model, p.Request) for name in model.model_fields}


# ------------------------------------------------------------------ routes

def create_app(engine_or_loader: Any, server_config: ServerConfig | None = None,
               on_load_error: Callable[[BaseException], None] | None = None) -> FastAPI:
    """The FastAPI app around an AsyncEngine, or around a callable that loads one (in a thread)."""
    server = Server(engine_or_loader, server_config or ServerConfig(), on_load_error)

    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if server.loader is not None:
            server.start_loading(asyncio.get_running_loop())
        yield

    app = FastAPI(title="zhuzi", version=zhuzi.__version__, lifespan=lifespan)
    app.state.server = server

    def authenticated(request: Request) -> str:
        return server.gateway.authenticate(request.headers.get("authorization"))

    async def generation(request: Request, body_model: type[ModelT],
                         handler: Callable[[Request, str, ModelT], Awaitable[Response]]) -> Response:
        key = authenticated(request)
        server.ready()
        server.gateway.check_rate(key)
        body = await parse_body(request, body_model)
        try:
            return await handler(request, key, body)
        except ClientGone:
            return Response(status_code=499)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generation(request, p.ChatCompletionRequest, server.chat)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generation(request, p.CompletionRequest, server.completions)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        authenticated(request)
        server.ready()
        return JSONResponse(server.models().model_dump())

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        authenticated(request)
        server.ready()
        return JSONResponse(server.tokenize(await parse_body(request, p.TokenizeRequest)).model_dump())

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        authenticated(request)
        server.ready()
        return JSONResponse(server.detokenize(await parse_body(request, p.DetokenizeRequest)).model_dump())

    @app.get("/health")
    async def health() -> Response:
        server.ready()
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": zhuzi.__version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = server.metrics.render()
        return Response(body, media_type=content_type)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, exc: GatewayError) -> Response:
        headers = {"Retry-After": retry_after_header(exc.retry_after)} if exc.retry_after is not None else None
        if exc.status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
        return error_response(exc.status, exc.message, exc.type, None, exc.code, headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error")

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        # Starlette logs the traceback after this answer goes out.
        return error_response(500, f"Internal server error: {type(exc).__name__}", "internal_error", code=500)

    return app


# ------------------------------------------------------------------ command line

def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    from zhuzi.cli import add_engine_arguments

    parser.add_argument("model", nargs="?", default=None,
                        help="HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    add_engine_arguments(parser, model_flag=False)
    # A server has streams to protect: a long prompt joins them in small chunks (offline runs don't cap).
    parser.set_defaults(long_prefill_token_threshold=SERVE_LONG_PREFILL_TOKENS)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", action="append", default=[], dest="api_keys",
                        help="accept this key as 'Authorization: Bearer KEY' (repeatable); none: no auth")
    parser.add_argument("--served-model-name", default=None, help="the model name clients send (default: the file's)")
    parser.add_argument("--rate-limit-rpm", type=int, default=None, help="requests per minute per key")
    parser.add_argument("--rate-limit-tpm", type=int, default=None, help="prompt+completion tokens per minute per key")
    parser.add_argument("--max-waiting", type=int, default=ServerConfig.max_waiting,
                        help="sequences that may queue beyond --max-num-seqs before 429")


def serve(args: argparse.Namespace) -> None:
    from zhuzi.cli import engine_config
    from zhuzi.engine.async_engine import AsyncEngine

    config = ServerConfig(host=args.host, port=args.port, api_keys=args.api_keys,
                          served_model_name=args.served_model_name, rate_limit_rpm=args.rate_limit_rpm,
                          rate_limit_tpm=args.rate_limit_tpm, max_waiting=args.max_waiting)
    engine_cfg = engine_config(args)
    log.info("loading %s (%s) in the background; /health answers 503 until it is ready",
             engine_cfg.model or "the embedded SmolLM2-135M-Instruct", engine_cfg.dtype)
    holder: dict[str, uvicorn.Server] = {}

    def stop(exc: BaseException) -> None:
        holder["server"].should_exit = True

    app = create_app(lambda: AsyncEngine.from_config(engine_cfg), config, on_load_error=stop)
    holder["server"] = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_config=None,
                                                     timeout_graceful_shutdown=2))
    holder["server"].run()
    if (error := app.state.server.load_error) is not None:
        raise SystemExit(f"zhuzi: failed to load the model: {error}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m zhuzi.server.app", description="zhuzi OpenAI-compatible server")
    add_serve_arguments(parser)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve(parser.parse_args())


if __name__ == "__main__":
    main()
