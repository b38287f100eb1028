"""The server's assembly, the first and last steps of the request path: each API's routes in, error objects out.

create_app builds what every API shares (common/serving.py's Server: the gateway, the store, the metrics, the
engine's loading and health) and mounts each API's router: OpenAI's (openai/), Anthropic's Messages
(anthropic/), the Responses API (responses/), the inspector and its page at / (inspect/), the prefix-cache pins
(pins/), Ollama's (ollama/), and the server's own /health, /version and /metrics (status.py). A request comes
in -> gateway (key, rate) -> its body (JSON, within the size limit) validated into its API's words
(common/routes.py) -> the API's serving logic -> JSON, SSE or NDJSON out. Every refusal is OpenAI's error
object with a 4xx (Anthropic's or Ollama's under their routes). /openapi.json documents each route's body, its
answer and its error statuses from the same models.
The app starts at once and loads the model in a thread, so /health says 503 until the model is ready, and
again once the engine fails or the server shuts down.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

import zhuzi
from zhuzi.config import ServerConfig
from zhuzi.engine.front.client import EngineClient, EngineDead
from zhuzi.outputs import RequestError
from zhuzi.server import status
from zhuzi.server.anthropic import protocol as a
from zhuzi.server.anthropic import router as anthropic_router
from zhuzi.server.anthropic.serving import Messages
from zhuzi.server.anthropic.serving import error_response as messages_error
from zhuzi.server.common import schema
from zhuzi.server.common.gateway import GatewayError, retry_after_header
from zhuzi.server.common.routes import Intake
from zhuzi.server.common.serving import ApiError, Server, failure_info
from zhuzi.server.inspect import protocol as ip
from zhuzi.server.inspect import router as inspect_router
from zhuzi.server.inspect.serving import Inspector
from zhuzi.server.ollama import protocol as o
from zhuzi.server.ollama import router as ollama_router
from zhuzi.server.ollama.serving import Ollama
from zhuzi.server.ollama.serving import error_response as ollama_error
from zhuzi.server.openai import answers as r
from zhuzi.server.openai import protocol as p
from zhuzi.server.openai import router as openai_router
from zhuzi.server.openai.embeddings import Embeddings
from zhuzi.server.openai.serving import Completions
from zhuzi.server.openai.tokenize import Tokenization
from zhuzi.server.pins import protocol as cp
from zhuzi.server.pins import router as pins_router
from zhuzi.server.pins.serving import CachePins
from zhuzi.server.responses import protocol as rp
from zhuzi.server.responses import router as responses_router
from zhuzi.server.responses.serving import Responses
from zhuzi.server.responses.store import ResponseStore


def error_response(request: Request, status: int, message: str, type: str, param: str | None = None,
                   code: str | int | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI's error object, or Anthropic's or Ollama's under their routes."""
    if request.url.path.startswith(anthropic_router.MESSAGES):
        return messages_error(status, message, code, headers)
    if request.url.path.startswith(ollama_router.API):
        return ollama_error(status, message, headers)
    body = r.ErrorResponse(error=r.ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


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
# A completion's chunks are CompletionResponse objects, as OpenAI's are.
_CHUNKS = [r.ChatCompletionChunk, a.MessageStreamEvent, a.AnthropicError, rp.ResponseStreamEvent]


def _openapi(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """FastAPI's spec plus the request bodies, which the routes parse themselves (to check the key, the
    size and the content type first), and the SSE chunks."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, routes=app.routes,
                               description="An OpenAI-compatible API; every error is OpenAI's error object.")
            models = [(model, "validation") for model in _BODIES] + [(model, "serialization") for model in _CHUNKS]
            _, defs = models_json_schema(models, ref_template="#/components/schemas/{model}")
            spec.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
            app.openapi_schema = spec
        return app.openapi_schema
    return openapi


def create_app(engine: EngineClient | Callable[[], EngineClient], server_config: ServerConfig | None = None,
               on_failure: Callable[[str], None] | None = None) -> FastAPI:
    """The FastAPI app around an engine client, or around a callable that starts one (in a thread).
    on_failure hears why the server cannot go on (the model failed to load, the engine failed)."""
    server = Server(engine, server_config or ServerConfig(), on_failure)
    intake = Intake(server, _FIELD_NAMES, UNSUPPORTED)
    generations = Completions(server)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if server.loader is not None:
            server.start_loading(asyncio.get_running_loop())
        watcher = asyncio.create_task(server.watch_engine())
        yield
        watcher.cancel()

    app = FastAPI(title="zhuzi", version=zhuzi.__version__, lifespan=lifespan)
    app.state.server = server
    embeddings = Embeddings(server)
    app.include_router(openai_router.router(intake, generations, Tokenization(server), embeddings))
    app.include_router(anthropic_router.router(intake, Messages(generations)))
    store = ResponseStore(server.store, server.config.responses_ttl)
    app.include_router(responses_router.router(intake, Responses(generations, store)))
    app.include_router(inspect_router.router(intake, Inspector(server)))
    app.include_router(pins_router.router(intake, CachePins(server)))
    app.include_router(ollama_router.router(intake, Ollama(generations, embeddings)))
    app.include_router(status.router(server))
    app.openapi = _openapi(app)  # type: ignore[method-assign]

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return error_response(request, exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, exc: GatewayError) -> Response:
        headers = {"Retry-After": retry_after_header(exc.retry_after)} if exc.retry_after is not None else None
        if exc.status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
        return error_response(request, exc.status, exc.message, exc.type, None, exc.code, headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # 405 carries Allow, as HTTP wants
        return error_response(request, exc.status_code, str(exc.detail), "invalid_request_error",
                              headers=exc.headers)

    @app.exception_handler(RequestError)
    @app.exception_handler(EngineDead)
    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception) -> Response:
        # Starlette logs an unexpected exception's traceback after this answer goes out.
        info = failure_info(exc)
        return error_response(request, int(info.code or 500), info.message, info.type, info.param, code=info.code)

    return app
