"""The serving logic of each endpoint, between the HTTP routes and the engine.

A request is checked (model name, sampling fields; the engine checks the rest), its prompt
rendered by the chat template and tokenized, admitted by the gateway, handed to the async
engine as one stream per prompt, and its deltas collected into one response or streamed as
SSE chunks. However it ends, close() aborts what still runs and frees its place.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from zhuzi.config import ServerConfig
from zhuzi.engine.async_engine import AsyncEngine
from zhuzi.outputs import EngineStats, RequestOutput
from zhuzi.sampling_params import InvalidRequest, SamplingParams
from zhuzi.server import protocol as p
from zhuzi.server.formats import ChatFormat, CompletionFormat, Format, Generation, PromptState, sse
from zhuzi.server.gateway import Admission, Gateway
from zhuzi.server.metrics import ServerMetrics
from zhuzi.server.parsers import THINK_CLOSE, THINK_OPEN, OutputParser, opened_thought
from zhuzi.server.streams import ClosingStreamingResponse, first_outputs, merge_streams, until_disconnect
from zhuzi.tokenizer import message_text

log = logging.getLogger("zhuzi.server")


class ApiError(Exception):
    """An answer other than success: the routes turn it into OpenAI's error object."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    @classmethod
    def of(cls, exc: InvalidRequest) -> ApiError:
        return cls(400, str(exc), param=exc.param, code=exc.code)


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
    def __init__(self, engine: AsyncEngine | Callable[[], AsyncEngine], config: ServerConfig,
                 on_load_error: Callable[[BaseException], None] | None = None) -> None:
        self.config = config
        self.engine: AsyncEngine | None = None
        self.loader = engine if callable(engine) else None
        self.load_error: BaseException | None = None
        self.on_load_error = on_load_error
        self.gateway = Gateway(config.api_keys, config.rate_limit_rpm, config.rate_limit_tpm)
        self.metrics = ServerMetrics(self.engine_state)
        self.model_name = ""
        self.reasoning = False
        self.created = int(time.time())
        if isinstance(engine, AsyncEngine):
            self.attach(engine)

    # -- loading

    def attach(self, engine: AsyncEngine) -> None:
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
        assert self.loader is not None
        loader = self.loader

        def load() -> None:
            try:
                engine = loader()
            except BaseException as exc:
                # A bad path or option is the user's to fix; anything else gets its traceback.
                log.error("failed to load the model: %s", exc, exc_info=not isinstance(exc, (ValueError, OSError)))
                self.load_error = exc
                if self.on_load_error:
                    loop.call_soon_threadsafe(self.on_load_error, exc)
                return
            loop.call_soon_threadsafe(self.attach, engine)

        threading.Thread(target=load, name="zhuzi-load", daemon=True).start()

    def engine_state(self) -> tuple[str, EngineStats] | None:
        return (self.model_name, self.engine.stats()) if self.engine is not None else None

    def ready(self) -> AsyncEngine:
        if self.engine is None:
            why = f"the model failed to load: {self.load_error}" if self.load_error else "the model is loading"
            raise ApiError(503, f"Service unavailable: {why}.", "service_unavailable")
        return self.engine

    # -- request helpers

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model {model!r} does not exist; this server serves {self.model_name!r}.",
                           param="model", code="model_not_found")

    @staticmethod
    def sampling_params(body: p.ChatCompletionRequest | p.CompletionRequest) -> SamplingParams:
        try:
            return body.to_sampling_params()
        except InvalidRequest as exc:
            raise ApiError.of(exc) from exc

    def render_chat(self, body: p.ChatTemplateRequest) -> tuple[list[int], str]:
        """The prompt ids, and the text the prompt already holds of the reply (see OutputParser)."""
        tokenizer, messages, args = self.ready().tokenizer, body.template_messages(), body.template_args()
        try:
            ids = tokenizer.encode_chat(messages, **args)
            if body.continue_final_message:
                return ids, message_text(messages[-1].get("content"))
            # Only a thinking model's template can open a thought; skip the second render otherwise.
            return ids, opened_thought(tokenizer.render_chat(messages, **args)) if self.reasoning else ""
        except (ValueError, TypeError) as exc:  # template errors, and templates fed unexpected types
            raise ApiError(400, f"Cannot render the chat template: {exc}", param="messages") from exc

    # -- generation

    async def generate(self, request: Request, key: str, prompts: list[list[int]], params: SamplingParams,
                       fmt: Format, new_parser: Callable[[], OutputParser], stream: bool,
                       include_usage: bool) -> Response:
        engine = self.ready()
        admission = self.gateway.admit(params.n * len(prompts))
        self.gateway.charge_tokens(key, sum(len(ids) for ids in prompts))
        streams = [engine.generate(ids, params, f"{fmt.request_id}-{i}") for i, ids in enumerate(prompts)]
        run = Run(key, admission, streams, Generation(params.n, new_parser, [PromptState() for _ in prompts]))
        try:
            firsts = await until_disconnect(request, first_outputs(streams))
        except InvalidRequest as exc:  # the engine refused it: too long for the context or the KV pool
            await self.close(run, ran=False)
            raise ApiError.of(exc) from exc
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

    @staticmethod
    async def collect(run: Run) -> None:
        assert run.merged is not None
        async for index, out in run.merged:
            run.gen.update(index, out)

    @staticmethod
    async def stream(run: Run, fmt: Format, include_usage: bool) -> AsyncIterator[str]:
        assert run.merged is not None
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
            await run.merged.aclose()  # type: ignore[attr-defined]
        for stream in run.streams:
            await stream.aclose()  # type: ignore[attr-defined]  # aborts a request the engine still runs
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
        tokenizer = self.ready().tokenizer
        prompts = body.prompts()
        texts = [x if isinstance(x, str) else tokenizer.decode(x, skip_special_tokens=False) for x in prompts]
        prompt_ids = [tokenizer.encode_prompt(x) for x in prompts]  # echo and logprobs show the prompt's tokens

        def decode(token_id: int) -> str:
            return tokenizer.decode([token_id], skip_special_tokens=False)

        fmt = CompletionFormat(p.new_id("cmpl"), self.model_name, body, texts, prompt_ids, decode)

        def new_parser() -> OutputParser:
            return OutputParser(reasoning=False, tools=False)

        return await self.generate(request, key, prompt_ids, params, fmt, new_parser, body.stream,
                                   body.include_usage_chunk)

    def tokenize(self, body: p.TokenizeRequest) -> p.TokenizeResponse:
        self.check_model(body.model)
        engine = self.ready()
        tokenizer = engine.tokenizer
        if body.messages is not None:
            ids = self.render_chat(body)[0]
        else:
            ids = tokenizer.encode_prompt(body.prompt or "")
        return p.TokenizeResponse(tokens=ids, token_strs=tokenizer.token_strs(ids), count=len(ids),
                                  max_model_len=engine.max_model_len)

    def detokenize(self, body: p.DetokenizeRequest) -> p.DetokenizeResponse:
        self.check_model(body.model)
        engine = self.ready()
        try:
            engine.check_token_ids(body.tokens, "tokens")
        except InvalidRequest as exc:
            raise ApiError.of(exc) from exc
        return p.DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens, skip_special_tokens=False))

    def models(self) -> p.ModelList:
        engine = self.ready()
        card = p.ModelCard(id=self.model_name, created=self.created, root=engine.config.model or engine.model_name,
                           max_model_len=engine.max_model_len)
        return p.ModelList(data=[card])
