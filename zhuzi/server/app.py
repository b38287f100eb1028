"""The first and last steps of the request path: HTTP routes in, OpenAI's error objects out.

A request comes in -> gateway (key, rate) -> its body validated into the protocol models ->
the serving logic (serving.py) -> JSON or SSE out. Every refusal is OpenAI's error object with
a 4xx. The app starts at once and loads the model in a thread, so /health says 503 until the
model is ready.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import zhuzi
from zhuzi.config import ServerConfig
from zhuzi.engine.async_engine import AsyncEngine
from zhuzi.server import protocol as p
from zhuzi.server.gateway import GatewayError, retry_after_header
from zhuzi.server.serving import ApiError, Server
from zhuzi.server.streams import ClientGone

ModelT = TypeVar("ModelT", bound=pydantic.BaseModel)


def error_response(status: int, message: str, type: str, param: str | None = None, code: str | int | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = p.ErrorResponse(error=p.ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)

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


def create_app(engine: AsyncEngine | Callable[[], AsyncEngine], server_config: ServerConfig | None = None,
               on_load_error: Callable[[BaseException], None] | None = None) -> FastAPI:
    """The FastAPI app around an AsyncEngine, or around a callable that loads one (in a thread)."""
    server = Server(engine, server_config or ServerConfig(), on_load_error)

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
