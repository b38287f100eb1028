"""The server's shared machinery, between each API's serving logic and the engine: rendering a chat (in a worker
thread), generate() (admitted by the gateway, one engine stream per prompt, collected into one answer or streamed
in the API's Format, and closed however it ends), probes, and the server's own life (loading, health, a drain
on shutdown, a watch on the engine that stops the server once the engine fails). A server of many models
(models.py's ModelSet) holds the model each request names for the request's life: what the request reads of
"the model" (its engine, its name, its formats) is that one's.
"""
from __future__ import annotations

import asyncio
import contextvars
import datetime
import functools
import gc
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import pydantic
from fastapi import Request
from fastapi.responses import Response

from zhuzi.config import ServerConfig
from zhuzi.engine.front.client import EngineClient, EngineDead
from zhuzi.engine.sequence import Probe
from zhuzi.outputs import EngineStats, RequestError, RequestOutput
from zhuzi.sampling_params import InvalidRequest, SamplingParams
from zhuzi.server.common import harmony
from zhuzi.server.common.errors import ApiError, failure
from zhuzi.server.common.formats import Format, PromptStats, ResponseState
from zhuzi.server.common.gateway import Admission, Gateway
from zhuzi.server.common.harmony_parser import HarmonyParser
from zhuzi.server.common.metrics import ServerMetrics
from zhuzi.server.common.parsers import OutputParser, opened_thought
from zhuzi.server.common.quota import Quotas
from zhuzi.server.common.request import ChatRequest, Constraint
from zhuzi.server.common.store import Database
from zhuzi.server.common.streams import (
    ClosingStreamingResponse,
    first_outputs,
    gather_or_cancel,
    merge_streams,
    until_disconnect,
)
from zhuzi.server.common.tool_formats import Hermes, ToolFormat
from zhuzi.server.common.tools import template_renders_tools, with_calls_as_text, with_generic_tools
from zhuzi.server.models import Model, ModelSet, ServedModel, seconds
from zhuzi.tokenizer import THOUGHT_TAGS, message_text

T = TypeVar("T")
log = logging.getLogger("zhuzi.server")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def json_response(body: pydantic.BaseModel) -> Response:
    return Response(body.model_dump_json(), media_type="application/json")


@dataclass(eq=False)
class ActiveRequest:
    """One API request in flight: its engine streams and what must happen when it ends."""

    key: str
    admission: Admission
    request_ids: list[str]  # the engine's, one per prompt
    streams: list[AsyncIterator[RequestOutput]]
    response: ResponseState
    prompt_tokens: int  # charged at admission
    engine: EngineClient  # the model's that runs it
    merged: AsyncIterator[tuple[int, RequestOutput]] | None = None
    timer: asyncio.TimerHandle | None = None  # --request-timeout
    closed: bool = False


@dataclass
class RenderedChat:
    """A chat request's prompt: its ids, and what the template was given to make it."""

    ids: list[int]
    prefill: str  # the text the prompt already holds of the reply (see OutputParser)
    messages: list[dict[str, Any]]
    args: dict[str, Any]


# Running requests' last events after a shutdown ended them: they need a step or two.
ABORT_GRACE_S = 5.0
# Threads that render and tokenize prompts: a few long prompts must not queue everyone else's behind them.
TOKENIZER_THREADS = 8
WATCH_PERIOD_S = 0.5


@dataclass
class Held:
    """The model a request holds (a server of many models), and what the request reads of it."""

    model: Model | None = None
    served: ServedModel | None = None
    load_time: float = 0.0  # seconds the request waited for the model to load


# Each request's Held, set around it by app.py's middleware, which releases the models as the answer ends.
held: contextvars.ContextVar[Held] = contextvars.ContextVar("held")


class Server:
    def __init__(self, engine: EngineClient | Callable[[], EngineClient] | ModelSet, config: ServerConfig,
                 on_failure: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.models = engine if isinstance(engine, ModelSet) else None
        self.default: ServedModel | None = None  # one model's server: the model, once loaded
        self.loader = engine if callable(engine) and self.models is None else None
        self.failure: str | None = None  # why the server must stop: the model failed to load, or the engine
        self.on_failure = on_failure
        self.draining = False
        self.drain_deadline = 0.0
        self.active: set[ActiveRequest] = set()
        # Templates and tokenizing run in workers, long texts' encoding in the tokenizer's helper process.
        self.workers = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="zhuzi-tokenize")
        self.gateway = Gateway(config.api_keys, config.rate_limit_rpm, config.rate_limit_tpm, config.max_waiting,
                               config.weights)
        # One file keeps what outlives the process (stored responses, usage); one zhuzi cannot use stops the
        # server here, in one line. What was answered is committed: a killed server loses nothing.
        self.store = Database(config.responses_store)
        self.quotas = Quotas.open(config.quotas, self.store)
        self.metrics = ServerMetrics(self.engine_state, self.quotas.usage)
        self.created = int(time.time())
        if self.models is None and not callable(engine):
            self.attach(self.prepare(engine))

    # -- the request's model

    def served(self) -> ServedModel | None:
        """The model the request holds; a server of one model: that one, once loaded."""
        request = held.get(None)
        return request.served if request is not None and request.served is not None else self.default

    def load_time(self) -> float:
        """Seconds the request waited for its model to load (0 when it was loaded)."""
        request = held.get(None)
        return request.load_time if request is not None else 0.0

    @property
    def engine(self) -> EngineClient | None:
        return served.engine if (served := self.served()) else None

    @property
    def model_name(self) -> str:
        return served.name if (served := self.served()) else ""

    @property
    def harmony(self) -> bool:
        """The model speaks gpt-oss's harmony format (harmony.py renders, harmony_parser.py parses)."""
        return bool(served := self.served()) and served.harmony

    @property
    def reasoning(self) -> bool:
        return bool(served := self.served()) and served.reasoning

    @property
    def think_close(self) -> int | None:
        return served.think_close if (served := self.served()) else None

    @property
    def thought_tags(self) -> tuple[str, str]:
        return served.thought_tags if (served := self.served()) else THOUGHT_TAGS[0]

    @property
    def added_tokens(self) -> dict[str, int]:
        return served.added_tokens if (served := self.served()) else {}

    @property
    def tool_format(self) -> type[ToolFormat]:
        """How the model writes calls (a harmony model: harmony_parser)."""
        return served.tool_format if (served := self.served()) else Hermes

    @property
    def template(self) -> str:
        """The chat template's text."""
        return served.template if (served := self.served()) else ""

    async def hold(self, body: object, key: str) -> None:
        """Load (or wait for) the model the request names and hold it for the request's life; Ollama's
        keep_alive, in any API's request, sets how long it stays loaded after. A server of one model holds
        nothing (an unknown name is check_model's 404), nor does a request that unloads the model (Ollama's);
        a key past its quota loads none (nor evicts one for nothing)."""
        if self.models is None or getattr(body, "unloads", False):
            return
        name = getattr(body, "model", None) or (next(iter(self.models.models)) if len(self.models.models) == 1
                                                 else None)
        if name is None:
            return  # ready() asks for one
        if self.models.find(name).served is None:
            self.quotas.check(key)
        started = time.monotonic()
        model = await self.models.acquire(name, seconds(getattr(body, "keep_alive", None)))
        request = held.get()
        request.model, request.served = model, model.served
        request.load_time = time.monotonic() - started
        assert model.served is not None
        self.gateway.batches[model.served.name] = model.served.engine.config.max_num_seqs

    def view(self, name: str | None) -> None:
        """Let the request read the model it names without holding it (a look at a model, such as the inspector's
        polls, neither loads it nor keeps it loaded): 404 for a model not here, 503 for one not loaded."""
        if self.models is None:
            self.ready()  # 503 while it loads
            self.check_model(name)
            return
        if name is None:
            return  # ready() asks for one
        model = self.models.find(name)
        if model.served is None:
            raise ApiError(503, f"the model {model.spec.id!r} is not loaded: a request naming it loads it",
                           "service_unavailable", param="model", code="model_not_loaded")
        held.get().served = model.served

    # -- loading

    def prepare(self, engine: EngineClient) -> None:
        """The tokenizer's share of loading, done in the loading thread so that the event loop answers /health
        meanwhile: its table of token strings, its helper process for long texts, and what the server reads of
        the model (ValueError where --tool-call-parser or --reasoning-parser does not fit it)."""
        return ServedModel.ready(self.config.served_model_name or engine.model_name, engine,
                                 self.config.tool_call_parser, self.config.reasoning_parser)

    def attach(self, served: ServedModel) -> None:
        engine = served.engine
        # What loading left is here to stay: frozen, it is no longer walked by every oldest-generation
        # collection, a pause of 0.1 s or more on the event loop.
        gc.collect()
        gc.freeze()
        self.gateway.batches[served.name] = engine.config.max_num_seqs
        self.default = served
        stats = engine.stats()
        log.info("model %s loaded: dtype %s, KV cache %d tokens (%d pages of %d), context %d tokens, %s",
                 self.model_name, engine.config.precision, stats.num_pages * engine.config.page_size,
                 stats.num_pages, engine.config.page_size, engine.max_model_len, served.formats)
        log.info("serving at http://%s:%d/v1", self.config.host, self.config.port)

    def start_loading(self, loop: asyncio.AbstractEventLoop) -> None:
        assert self.loader is not None
        loader = self.loader

        def load() -> None:
            try:
                served = self.prepare(loader())
            except BaseException as exc:
                # A bad path or option is the user's to fix; anything else gets its traceback.
                if not isinstance(exc, (ValueError, OSError)):
                    log.error("failed to load the model", exc_info=exc)
                loop.call_soon_threadsafe(self.fail, f"the model failed to load: {exc}")
                return
            loop.call_soon_threadsafe(self.attach, served)

        threading.Thread(target=load, name="zhuzi-load", daemon=True).start()

    def engine_state(self) -> dict[str, dict[int, EngineStats]]:
        """Each loaded model's replicas' stats."""
        loaded = self.models.loaded() if self.models is not None else [self.default] if self.default else []
        return {served.name: served.engine.replica_stats() for served in loaded}

    # -- health and the end of the server's life

    def unavailable(self) -> str | None:
        """Why the server takes no request now (what /health says with its 503), or None."""
        if self.failure is not None:
            return self.failure
        if self.draining:
            return "the server is shutting down"
        if self.models is not None:  # each model's engine answers for itself
            return None
        if self.engine is None:
            return "the model is loading"
        return self.engine.health(self.config.engine_stall_timeout)

    def available(self) -> None:
        if (why := self.unavailable()) is not None:
            raise ApiError(503, f"Service unavailable: {why}.", "service_unavailable")

    def ready(self) -> EngineClient:
        """The request's model's engine."""
        self.available()
        if (engine := self.engine) is None:
            raise ApiError(400, "Name a model: this server has several (GET /v1/models lists them).", param="model")
        return engine

    def fail(self, reason: str) -> None:
        """The server cannot go on: say why, and have the process exit non-zero."""
        if self.failure is not None:
            return
        log.error("%s; the server stops", reason)
        self.failure = reason
        if self.on_failure:
            self.on_failure(reason)

    async def watch_engine(self) -> None:
        """Stops the server once the engine has failed or stalled; its open streams end with the error."""
        while self.failure is None:
            await asyncio.sleep(WATCH_PERIOD_S)
            if self.models is not None:  # a model whose engine fails fails its own requests, and reloads
                self.models.expire()
                for served in self.models.loaded():
                    if problem := served.engine.health(self.config.engine_stall_timeout):
                        served.engine.fail(problem)
                continue
            if self.engine is not None and (problem := self.engine.health(self.config.engine_stall_timeout)):
                self.engine.fail(problem)
                self.fail(problem)

    async def drain(self, timeout: float) -> None:
        """Take no new request; give the running ones timeout seconds to finish, then end them with
        finish_reason "abort" (their streams still end properly, with [DONE])."""
        self.draining = True
        self.drain_deadline = time.monotonic() + timeout
        log.info("shutting down: %d requests running, %g s for them to finish", len(self.active), timeout)
        while self.active and time.monotonic() < self.drain_deadline:
            await asyncio.sleep(0.05)
        if not self.active:
            return
        log.warning("ending the %d requests still running (finish_reason 'abort')", len(self.active))
        for call in list(self.active):
            self.end(call)
        deadline = time.monotonic() + ABORT_GRACE_S
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def hurry(self) -> None:
        """A second signal: end the running requests now."""
        self.drain_deadline = 0.0

    def end(self, call: ActiveRequest) -> None:
        """End a running request early; its outputs end with finish_reason "abort" (timeouts, shutdown)."""
        if not call.closed:
            for request_id in call.request_ids:
                call.engine.abort(request_id)

    async def in_worker(self, fn: Callable[..., T], *args: object) -> T:
        """Run CPU-bound work (templates, tokenizing, big JSON) off the event loop."""
        # In the request's context: the work reads the request's model.
        context = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(self.workers, context.run, functools.partial(fn, *args))

    # -- request helpers

    def check_model(self, model: str | None) -> None:
        """404 for a model this server does not serve (a server of many found the request's as it held it)."""
        if model is not None and self.models is None and model != self.model_name:
            raise ApiError(404, f"The model {model!r} does not exist; this server serves {self.model_name!r}.",
                           param="model", code="model_not_found")

    async def check_constraints(self, constraints: list[Constraint]) -> None:
        """Each output constraint compiled before anything is queued: a bad one is a 400 naming its field."""
        for constraint in constraints:
            try:
                await self.ready().check_structured_output(constraint.params)
            except InvalidRequest as exc:
                raise ApiError.of(constraint.rename(exc)) from exc

    @staticmethod
    def log_user(request_id: str, user: str | None) -> None:
        if user is not None:  # the end user's id: what an operator needs to trace abuse
            log.info("%s for user %r", request_id, user)

    # -- probes (inspections, embeddings)

    async def probe(self, request: Request, key: str, contexts: list[list[int]], probe: Probe,
                    param: str) -> list[RequestOutput]:
        """Each context through the step loop, admitted and charged as a generation's prompts are; a client
        that hangs up aborts them all. param: the request field the contexts came from, for errors."""
        engine = self.ready()
        try:
            for k, ids in enumerate(contexts):
                engine.check_token_ids(ids, f"{param}.{k}" if len(contexts) > 1 else param)
        except InvalidRequest as exc:
            raise ApiError.of(exc) from exc
        self.quotas.check(key)
        admission = self.gateway.admit(len(contexts), self.model_name)
        request_id = new_id("probe")
        try:
            outs = await until_disconnect(request, gather_or_cancel(
                [engine.probe(ids, probe, f"{request_id}-{k}") for k, ids in enumerate(contexts)]))
        except InvalidRequest as exc:  # longer than the context window or the KV pool
            raise ApiError(400, str(exc), param=param, code=exc.code) from exc
        finally:
            admission.release()
        self.charge(key, sum(len(ids) - out.num_cached_tokens for ids, out in zip(contexts, outs)))
        return outs

    # -- generation

    async def generate(self, request: Request, key: str, prompts: list[list[int]], params: SamplingParams,
                       fmt: Format, new_parser: Callable[[], OutputParser | HarmonyParser], stream: bool,
                       on_answer: Callable[[pydantic.BaseModel], Awaitable[None]] | None = None) -> Response:
        """Run the prompts; answer with fmt's whole answer, or stream its events. on_answer sees the whole
        answer before the client does (a stream's last events wait for it): what must outlive the answer
        (a stored response) is kept by then."""
        engine = self.ready()
        self.quotas.check(key)
        admission = self.gateway.admit(params.n * len(prompts), self.model_name)
        prompt_tokens = sum(len(ids) for ids in prompts)
        self.charge(key, prompt_tokens)
        request_ids = [f"{fmt.request_id}-{i}" for i in range(len(prompts))]
        tenant = self.gateway.tenant(key)
        streams = [engine.generate(ids, params, rid, tenant) for ids, rid in zip(prompts, request_ids)]
        call = ActiveRequest(key, admission, request_ids, streams,
                             ResponseState(params.n, new_parser, [PromptStats() for _ in prompts], self.think_close),
                             prompt_tokens, engine)
        self.active.add(call)
        if self.config.request_timeout:
            call.timer = asyncio.get_running_loop().call_later(self.config.request_timeout, self.end, call)
        try:
            firsts = await until_disconnect(request, first_outputs(streams))
        except InvalidRequest as exc:  # the engine refused it: too long for the context or the KV pool
            await self.close(call, ran=False)
            raise ApiError.of(exc) from exc
        except BaseException:
            await self.close(call)
            raise
        call.merged = merge_streams(firsts, streams)
        if stream:
            return ClosingStreamingResponse(self.stream(call, fmt, on_answer), lambda: self.close(call))
        try:
            await until_disconnect(request, self.collect(call))
        finally:
            await self.close(call)
        answer = fmt.response(call.response)
        if on_answer is not None:
            await on_answer(answer)
        return json_response(answer)

    @staticmethod
    async def collect(call: ActiveRequest) -> None:
        assert call.merged is not None
        async for index, out in call.merged:
            call.response.update(index, out)

    @staticmethod
    async def stream(call: ActiveRequest, fmt: Format,
                     on_answer: Callable[[pydantic.BaseModel], Awaitable[None]] | None) -> AsyncIterator[str]:
        assert call.merged is not None
        try:
            async for index, out in call.merged:
                if (progress := call.response.progress(index, out)) is not None:
                    for event in fmt.progress(progress):
                        yield event
                for choice, delta, piece in call.response.update(index, out):
                    for event in fmt.events(call.response, choice, delta, piece, index):
                        yield event
            if on_answer is not None:
                await on_answer(fmt.response(call.response))
            for event in fmt.end(call.response):
                yield event
        except Exception as exc:  # the headers are out: report in-band, as OpenAI's streams do
            if not isinstance(exc, (RequestError, EngineDead)):  # the engine logged those
                log.exception("stream %s failed", fmt.request_id)
            for event in fmt.failure(call.response, failure(exc)):
                yield event

    async def close(self, call: ActiveRequest, ran: bool = True) -> None:
        """End a request however it ended: abort what still runs, free its place, count it if it ran."""
        if call.closed:
            return
        call.closed = True
        self.active.discard(call)
        if call.timer is not None:
            call.timer.cancel()
        if call.merged is not None:
            await call.merged.aclose()  # type: ignore[attr-defined]
        for stream in call.streams:
            await stream.aclose()  # type: ignore[attr-defined]  # aborts a request the engine still runs
        call.admission.release()
        gen = call.response
        self.charge(call.key, sum(len(c.token_ids) for c in gen.choices.values()))
        if not ran:
            self.quotas.charge(call.key, -call.prompt_tokens)  # the engine refused it: nothing was read
            return
        for prompt_index, state in enumerate(gen.prompts):
            choices = [gen.choices.get(prompt_index * gen.n + i) for i in range(gen.n)]
            self.metrics.observe_request(
                self.model_name, state.metrics, state.token_count, sum(len(c.token_ids) for c in choices if c),
                [c.finish_reason if c and c.finish_reason else "abort" for c in choices])

    def charge(self, key: str, tokens: int) -> None:
        """A generation's tokens count against the key's tokens per minute and its daily quota."""
        self.gateway.charge_tokens(key, tokens)
        self.quotas.charge(key, tokens)

    # -- prompts (in worker threads)

    def tool_prompt(self, chat: ChatRequest) -> str | None:
        """Who tells the model about the request's tools: "template", "generic" (zhuzi's generic prompt in the
        system message, for templates that ignore tools), or None (no tools to parse)."""
        if not chat.parse_tool_calls:
            return None
        return "template" if template_renders_tools(self.ready().tokenizer.template_variables) else "generic"

    def calls_format(self, chat: ChatRequest) -> ToolFormat:
        """The format a chat's reply writes its calls in: the model's, or Hermes' where zhuzi's generic prompt
        teaches it."""
        functions = [tool.function() for tool in chat.tools]
        if self.tool_prompt(chat) == "generic":
            return Hermes(functions)
        return self.tool_format(functions, self.template)

    def render_chat(self, chat: ChatRequest, constraint: Constraint | None = None) -> RenderedChat:
        """The prompt a chat request makes (the generic tool format written in where the template has none;
        under a constraint a thinking model is asked for no thought)."""
        tokenizer, messages, args = self.ready().tokenizer, chat.template_messages(), chat.template_args()
        if self.harmony:  # the format is zhuzi's to write, whatever the checkpoint's template
            return RenderedChat(harmony.render(tokenizer, chat, self.today()), "", messages, args)
        if not template_renders_tools(tokenizer.template_variables):
            messages = with_calls_as_text(messages)
        if self.tool_prompt(chat) == "generic":
            messages = with_generic_tools(messages, args["tools"])
        if constraint is not None and self.reasoning:
            args["chat_template_kwargs"] = self.without_thought(args["chat_template_kwargs"])
        try:
            ids = tokenizer.encode_chat(messages, **args)
            if chat.continue_final_message:
                return RenderedChat(ids, message_text(messages[-1].get("content")), messages, args)
            # Only a thinking model's template can open a thought; skip the second render otherwise.
            prefill = opened_thought(tokenizer.render_chat(messages, **args), self.thought_tags) \
                if self.reasoning else ""
        except (ValueError, TypeError) as exc:  # template errors, and templates fed unexpected types
            raise ApiError(400, f"Cannot render the chat template: {exc}", param="messages") from exc
        if constraint is not None and prefill:
            raise ApiError(400, f"{constraint.source} cannot hold here: this model's template opens a thought, "
                           "and a constrained reply cannot think", param=constraint.source)
        return RenderedChat(ids, prefill, messages, args)

    @staticmethod
    def today() -> str:
        """The date a harmony system message gives the conversation."""
        return datetime.date.today().isoformat()

    @staticmethod
    def without_thought(kwargs: dict | None) -> dict:
        kwargs = dict(kwargs or {})
        if kwargs.setdefault("enable_thinking", False):
            raise ApiError(400, "chat_template_kwargs.enable_thinking: a constrained reply cannot think",
                           param="chat_template_kwargs.enable_thinking")
        return kwargs
