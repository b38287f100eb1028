"""The server's assembly: what every API shares (common/serving.py's Server, the chat path), each API's router
(OpenAI's, Anthropic's Messages, the Responses API, Ollama's, the inspector, the prefix-cache pins, the server's
own status routes), the error handlers, and the OpenAPI spec. An error takes the shape of the router that
received the request (OpenAI's error object where no route matched). One model loads in a thread: /health says
503 until it is ready; a server of many models (models.py) loads each as a request names it, and releases the
models a request held once its answer has ended (ReleaseModels).
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

import zhuzi
from zhuzi.config import ServerConfig
from zhuzi.engine.front.client import EngineClient, EngineDead
from zhuzi.outputs import RequestError
from zhuzi.sampling_params import InvalidRequest
from zhuzi.server import status
from zhuzi.server.anthropic import protocol as a
from zhuzi.server.anthropic import router as anthropic_router
from zhuzi.server.anthropic.serving import Messages
from zhuzi.server.common import schema
from zhuzi.server.common.chat import ChatPath
from zhuzi.server.common.errors import ApiError, failure
from zhuzi.server.common.gateway import GatewayError, retry_after_header
from zhuzi.server.common.routes import ErrorRenderer, Intake
from zhuzi.server.common.serving import Held, Server, held
from zhuzi.server.inspect import protocol as ip
from zhuzi.server.inspect import router as inspect_router
from zhuzi.server.inspect.serving import Inspector
from zhuzi.server.models import ModelSet
from zhuzi.server.ollama import protocol as o
from zhuzi.server.ollama import router as ollama_router
from zhuzi.server.ollama.serving import Ollama
from zhuzi.server.openai import answers as r
from zhuzi.server.openai import protocol as p
from zhuzi.server.openai import router as openai_router
from zhuzi.server.openai.embeddings import Embeddings
from zhuzi.server.openai.formats import error_response as openai_error
from zhuzi.server.openai.serving import Completions
from zhuzi.server.openai.tokenize import Tokenization
from zhuzi.server.pins import protocol as cp
from zhuzi.server.pins import router as pins_router
from zhuzi.server.pins.serving import CachePins
from zhuzi.server.responses import protocol as rp
from zhuzi.server.responses import router as responses_router
from zhuzi.server.responses.serving import Responses
from zhuzi.server.responses.store import ResponseStore


def error_response(request: Request, error: ApiError, headers: dict[str, str] | None = None) -> Response:
    """The error in the shape of the router whose route received the request; for a path no route matches
    (an Ollama client's /api/copy), of the router whose paths share the most leading segments with it."""
    route = request.scope.get("route") or _nearest_route(request.app.state.routes, request.url.path)
    render: ErrorRenderer = getattr(route, "render_error", openai_error)
    return render(error, headers)


def _nearest_route(routes: list[Any], path: str) -> Any:
    def shared(route: Any) -> int:
        common = 0
        for mine, theirs in zip(path.strip("/").split("/"), route.path.strip("/").split("/"), strict=False):
            if mine != theirs:
                break
            common += 1
        return common

    answering = [route for route in routes if hasattr(route, "render_error")]
    best = max(answering, key=shared, default=None)
    return best if best is not None and shared(best) else None


# What a validation error may name: every API's request fields, and why zhuzi refuses some undeclared ones.
UNSUPPORTED = {**p.UNSUPPORTED, **rp.UNSUPPORTED, **a.UNSUPPORTED}
_FIELD_NAMES = frozenset(field.alias or name for module in (p, ip, a, rp, cp, o) for model in vars(module).values()
                         if isinstance(model, type) and issubclass(model, schema.Request)
                         for name, field in model.model_fields.items())

# ---------------------------------------------------------------- the OpenAPI description

_BODIES = [p.ChatCompletionRequest, p.CompletionRequest, p.EmbeddingRequest, p.TokenizeRequest, p.DetokenizeRequest,
           ip.NextTokenRequest, ip.LogitLensRequest, ip.DocumentRequest, ip.BpeRequest,
           a.MessagesRequest, a.CountTokensRequest, rp.ResponsesRequest, cp.PinRequest, o.ChatRequest,
           o.GenerateRequest, o.EmbedRequest, o.EmbeddingsRequest, o.ShowRequest]
# A completion's events are CompletionResponse objects, as OpenAI's are.
_EVENTS = [r.ChatCompletionChunk, a.MessageStreamEvent, a.AnthropicError, rp.ResponseStreamEvent]


def _openapi(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """FastAPI's spec plus the request bodies, which the routes parse themselves (to check the key, the
    size and the content type first), and the SSE events."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, routes=app.routes,
                               description="OpenAI's, Anthropic's and Ollama's APIs, each with its own error object.")
            models = [(model, "validation") for model in _BODIES] + [(model, "serialization") for model in _EVENTS]
            _, defs = models_json_schema(models, ref_template="#/components/schemas/{model}")
            spec.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
            app.openapi_schema = spec
        return app.openapi_schema
    return openapi


class ReleaseModels:
    """Around each HTTP request: the model it holds (Server.hold) is released once its answer, a stream's
    last event included, has gone out."""

    def __init__(self, app: ASGIApp, server: Server) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.server.models is None:
            await self.app(scope, receive, send)
            return
        request = Held()
        token = held.set(request)
        try:
            await self.app(scope, receive, send)
        finally:
            held.reset(token)
            if request.model is not None:
                self.server.models.release(request.model)


def create_app(engine: EngineClient | Callable[[], EngineClient] | ModelSet, server_config: ServerConfig | None = None,
               on_failure: Callable[[str], None] | None = None) -> FastAPI:
    """The FastAPI app around an engine client, around a callable that starts one (in a thread), or around a
    set of models that each load as requests name them. on_failure hears why the server cannot go on (the
    model failed to load, the engine failed)."""
    server = Server(engine, server_config or ServerConfig(), on_failure)
    intake = Intake(server, _FIELD_NAMES, UNSUPPORTED)
    chats = ChatPath(server)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if server.loader is not None:
            server.start_loading(asyncio.get_running_loop())
        watcher = asyncio.create_task(server.watch_engine())
        yield
        watcher.cancel()
        if server.models is not None:
            server.models.close()

    app = FastAPI(title="zhuzi", version=zhuzi.__version__, lifespan=lifespan)
    app.add_middleware(ReleaseModels, server=server)
    app.state.server = server
    embeddings = Embeddings(server)
    store = ResponseStore(server.store, server.config.responses_ttl)
    routers = [openai_router.router(intake, Completions(server, chats), Tokenization(server), embeddings),
               anthropic_router.router(intake, Messages(chats)),
               responses_router.router(intake, Responses(chats, store)),
               inspect_router.router(intake, Inspector(server)),
               pins_router.router(intake, CachePins(server)),
               ollama_router.router(intake, Ollama(chats, embeddings)),
               status.router(intake)]
    for router in routers:
        app.include_router(router)
    app.state.routes = [route for router in routers for route in router.routes]
    app.openapi = _openapi(app)  # type: ignore[method-assign]

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return error_response(request, exc)

    @app.exception_handler(InvalidRequest)
    async def invalid(request: Request, exc: InvalidRequest) -> Response:
        return error_response(request, ApiError.of(exc))

    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, exc: GatewayError) -> Response:
        headers = {"Retry-After": retry_after_header(exc.retry_after)} if exc.retry_after is not None else None
        if exc.status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
        return error_response(request, ApiError(exc.status, exc.message, exc.type, code=exc.code), headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # 405 carries Allow, as HTTP wants
        return error_response(request, ApiError(exc.status_code, str(exc.detail)), exc.headers)

    @app.exception_handler(RequestError)
    @app.exception_handler(EngineDead)
    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception) -> Response:
        # Starlette logs an unexpected exception's traceback after this answer goes out.
        return error_response(request, failure(exc))

    return app
