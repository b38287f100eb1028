"""The first and last steps of the request path: HTTP routes in, OpenAI's error objects out.

A request comes in -> gateway (key, rate) -> its body (JSON, within the size limit) validated into
the protocol models -> the serving logic (serving.py; serving_inspect.py for /inspect, serving_cache.py for
/v1/cache/pins) -> JSON or SSE out. Every refusal is OpenAI's error object with a 4xx. /openapi.json
documents each route's body, its answer and its error statuses from the same models. The app starts at
once and loads the model in a thread, so /health says 503 until the model is ready, and again once the
engine fails or the server shuts down. The inspector page (static/) is served at /.
"""
from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pydantic
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

import zhuzi
from zhuzi.config import ServerConfig
from zhuzi.engine.client import EngineClient, EngineDead
from zhuzi.outputs import RequestError
from zhuzi.server.anthropic import protocol as a
from zhuzi.server.anthropic.serving import Messages, anthropic_status
from zhuzi.server.anthropic.serving import error_response as messages_error
from zhuzi.server.common import schema
from zhuzi.server.common.gateway import GatewayError, retry_after_header
from zhuzi.server.common.serving import ApiError, Server, failure_info
from zhuzi.server.common.store import ResponseStore
from zhuzi.server.common.streams import ClientGone
from zhuzi.server.inspect import protocol as ip
from zhuzi.server.inspect.serving import Inspector
from zhuzi.server.openai import answers as r
from zhuzi.server.openai import protocol as p
from zhuzi.server.openai.serving import Completions
from zhuzi.server.openai.tokenize import Tokenization
from zhuzi.server.pins import protocol as cp
from zhuzi.server.pins.serving import CachePins
from zhuzi.server.responses import protocol as rp
from zhuzi.server.responses.serving import MAX_ITEMS_PAGE, Responses

ModelT = TypeVar("ModelT", bound=pydantic.BaseModel)
MESSAGES = "/v1/messages"  # Anthropic's routes: its error object and status codes
STATIC = Path(__file__).parent / "inspect" / "static"
# The page loads nothing from elsewhere, and nothing else may run in it.
PAGE_POLICY = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
               "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'")


def error_response(request: Request, status: int, message: str, type: str, param: str | None = None,
                   code: str | int | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI's error object, or Anthropic's under its routes."""
    if request.url.path.startswith(MESSAGES):
        return messages_error(status, message, code, headers)
    body = r.ErrorResponse(error=r.ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def is_json(content_type: str) -> bool:
    media = content_type.partition(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def read_body(request: Request, limit: int) -> bytes:
    """The body, if it is JSON (or unlabelled, as curl -d sends it) and at most limit bytes."""
    content_type = request.headers.get("content-type")
    if content_type is not None and not is_json(content_type):
        raise ApiError(415, f"Content-Type must be application/json, got {content_type!r}.",
                       code="unsupported_media_type")
    too_large = ApiError(413, f"The request body is larger than this server's limit of {limit} bytes.",
                         code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    return bytes(body)


async def parse_body(request: Request, model: type[ModelT], limit: int) -> ModelT:
    raw = await read_body(request, limit)
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
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":  # a field no model declares: name it, and say why if zhuzi knows
        field = str(first["loc"][-1])
        loc = loc[:-1] + [field] if loc[-1:] == [field] else loc + [field]
        message = UNSUPPORTED.get(field, "is not a field zhuzi knows (no field is accepted and ignored)")
        return ApiError(400, f"{'.'.join(loc)} {message}", param=".".join(loc))
    param = ".".join(loc) or None
    return ApiError(400, f"{param}: {message}" if param else message, param=param)


UNSUPPORTED = {**p.UNSUPPORTED, **rp.UNSUPPORTED}
_FIELD_NAMES = {field.alias or name for module in (p, ip, a, rp, cp) for model in vars(module).values()
                if isinstance(model, type) and issubclass(model, schema.Request)
                for name, field in model.model_fields.items()}


# ---------------------------------------------------------------- the OpenAPI description

_ERROR_DESCRIPTIONS = {
    400: "Invalid request: the error's param names the field", 401: "Missing or wrong API key",
    404: "Unknown model, stored response or pin", 413: "Request body too large", 415: "Body not JSON",
    429: "Rate limit or queue full", 500: "The engine failed this request",
    503: "Loading, shutting down, or the engine failed", 529: "Overloaded: queue full, loading or shutting down",
}
_BODY_ERRORS = (400, 401, 404, 413, 415, 429, 503)


def _ref(model: type[pydantic.BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _sse_event(chunk: type[pydantic.BaseModel], error: type[pydantic.BaseModel], named: bool) -> dict[str, Any]:
    """One server-sent event (OpenAPI 3.1 describes each event): its data is a JSON chunk or an error object
    (a failure after the headers went out); OpenAI's chat and completion streams end with [DONE], Anthropic's
    and the Responses API's name each event instead."""
    json_data = {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": {"anyOf": [_ref(chunk), _ref(error)]}}
    if not named:
        return {"type": "object", "required": ["data"],
                "properties": {"data": {"anyOf": [{"const": "[DONE]"}, json_data]}}}
    return {"type": "object", "required": ["event", "data"],
            "properties": {"event": {"type": "string"}, "data": json_data}}


def _documented(body: type[pydantic.BaseModel] | None, answer: type[pydantic.BaseModel] | None,
                statuses: tuple[int, ...], chunk: type[pydantic.BaseModel] | None = None,
                error: type[pydantic.BaseModel] = r.ErrorResponse, named: bool = False) -> dict[str, Any]:
    """A route's OpenAPI description: its JSON body, its answer (and the chunks of its SSE stream, named
    events or not), its error objects (Anthropic's, with its statuses, where error says so)."""
    if error is a.AnthropicError:
        statuses = tuple(sorted({anthropic_status(s) for s in statuses} | ({529} if 429 in statuses else set())))
    responses: dict[int | str, dict[str, Any]] = {
        status: {"model": error, "description": _ERROR_DESCRIPTIONS[status]} for status in statuses}
    if answer is not None:
        ok: dict[str, Any] = {"model": answer, "description": "Success"}
        if chunk is not None:
            ok["content"] = {"text/event-stream": {"schema": _sse_event(chunk, error, named)}}
            ok["description"] = "Success: the whole answer, or its chunks as server-sent events with stream true"
        responses[200] = ok
    extra = {"requestBody": {"required": True, "content": {"application/json": {"schema": _ref(body)}}}} \
        if body is not None else None
    return {"responses": responses, "openapi_extra": extra}


_BODIES = [p.ChatCompletionRequest, p.CompletionRequest, p.TokenizeRequest, p.DetokenizeRequest,
           ip.NextTokenRequest, ip.LogitLensRequest, ip.DocumentRequest, ip.BpeRequest,
           a.MessagesRequest, a.CountTokensRequest, rp.ResponsesRequest, cp.PinRequest]


# The GET routes' parameters, which the routes read themselves (a bad value is OpenAI's 400, not 422).
def _steps_parameter(default: int) -> dict[str, Any]:
    return {"name": "steps", "in": "query", "required": False, "description": "how many recent step records to include",
            "schema": {"type": "integer", "minimum": 0, "maximum": ip.MAX_STEPS, "default": default}}


_ENGINE_QUERY = {"parameters": [_steps_parameter(64)]}
_BATCH_QUERY = {"parameters": [_steps_parameter(48), {
    "name": "request_id", "in": "query", "required": False,
    "description": "the id of the caller's own request (a chat completion's id): its rows are marked as yours",
    "schema": {"type": "string", "maxLength": ip.MAX_REQUEST_ID, "pattern": ip.REQUEST_ID_PATTERN}}]}


def _query(request: Request, defaults: dict[str, str | None]) -> dict[str, Any]:
    """A GET route's query: only the named parameters; steps a whole number in [0, MAX_STEPS]."""
    if unknown := sorted(set(request.query_params) - set(defaults)):
        raise ApiError(400, f"Unknown query parameter {unknown[0]!r}", param=unknown[0])
    query: dict[str, Any] = {name: request.query_params.get(name, default) for name, default in defaults.items()}
    raw = query["steps"]
    if not (raw.isascii() and raw.isdigit()) or int(raw) > ip.MAX_STEPS:
        raise ApiError(400, f"steps must be a whole number in [0, {ip.MAX_STEPS}], got {raw!r}", param="steps")
    query["steps"] = int(raw)
    rid = query.get("request_id")
    if rid is not None and (len(rid) > ip.MAX_REQUEST_ID or not re.fullmatch(ip.REQUEST_ID_PATTERN, rid)):
        raise ApiError(400, f"request_id must be a request's id (letters, digits, - and _), got {rid[:80]!r}",
                       param="request_id")
    return query


_ITEMS_QUERY = {"parameters": [
    {"name": "after", "in": "query", "required": False, "description": "list the items after this item id",
     "schema": {"type": "string"}},
    {"name": "limit", "in": "query", "required": False, "description": "how many items (1-100)",
     "schema": {"type": "integer", "minimum": 1, "maximum": MAX_ITEMS_PAGE, "default": 20}},
    {"name": "order", "in": "query", "required": False, "description": "asc: oldest first; desc: newest first",
     "schema": {"enum": ["asc", "desc"], "default": "desc"}}]}
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
    generations, tokenization, inspector = Completions(server), Tokenization(server), Inspector(server)
    pins = CachePins(server)
    config = server.config
    anthropic = Messages(generations)
    responses = Responses(generations, ResponseStore(server.store, config.responses_ttl))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if server.loader is not None:
            server.start_loading(asyncio.get_running_loop())
        watcher = asyncio.create_task(server.watch_engine())
        yield
        watcher.cancel()

    app = FastAPI(title="zhuzi", version=zhuzi.__version__, lifespan=lifespan)
    app.state.server = server

    def authenticated(request: Request) -> str:
        return server.gateway.authenticate(request.headers.get("authorization"), request.headers.get("x-api-key"))

    async def admitted(request: Request, body_model: type[ModelT]) -> tuple[str, ModelT]:
        """The caller's key and the parsed body, in the order that spends least on a refusal."""
        key = authenticated(request)
        server.ready()
        server.gateway.check_rate(key)
        return key, await parse_body(request, body_model, config.max_request_body_bytes)

    async def generation(request: Request, body_model: type[ModelT],
                         handler: Callable[[Request, str, ModelT], Awaitable[Response]]) -> Response:
        key, body = await admitted(request, body_model)
        try:
            return await handler(request, key, body)
        except ClientGone:
            return Response(status_code=499)

    @app.post("/v1/chat/completions", **_documented(p.ChatCompletionRequest, r.ChatCompletionResponse,
                                                     (*_BODY_ERRORS, 500), r.ChatCompletionChunk))
    async def chat_completions(request: Request) -> Response:
        return await generation(request, p.ChatCompletionRequest, generations.chat)

    @app.post("/v1/chat/completions/render", **_documented(p.ChatCompletionRequest, r.RenderResponse, _BODY_ERRORS))
    async def render(request: Request) -> Response:
        return await generations.render(*await admitted(request, p.ChatCompletionRequest))

    @app.post(MESSAGES, **_documented(a.MessagesRequest, a.Message, (*_BODY_ERRORS, 500), a.MessageStreamEvent,
                                      a.AnthropicError, named=True))
    async def messages(request: Request) -> Response:
        return await generation(request, a.MessagesRequest, anthropic.create)

    @app.post(f"{MESSAGES}/count_tokens", **_documented(a.CountTokensRequest, a.TokenCount, _BODY_ERRORS,
                                                         error=a.AnthropicError))
    async def count_tokens(request: Request) -> Response:
        return await anthropic.count_tokens(*await admitted(request, a.CountTokensRequest))

    @app.post("/v1/responses", **_documented(rp.ResponsesRequest, rp.ResponseObject, (*_BODY_ERRORS, 500),
                                             rp.ResponseStreamEvent, named=True))
    async def create_response(request: Request) -> Response:
        return await generation(request, rp.ResponsesRequest, responses.create)

    def stored(request: Request, allowed: tuple[str, ...] = ()) -> str:
        """The caller's key, for a stored response (the engine need not be ready); no query parameter but
        the allowed ones."""
        key = authenticated(request)
        server.gateway.check_rate(key)
        for name in request.query_params:
            if name not in allowed:
                raise ApiError(400, f"{name} is not a parameter zhuzi knows (no parameter is accepted and "
                               "ignored)", param=name)
        return key

    @app.get("/v1/responses/{response_id}", **_documented(None, rp.ResponseObject, (400, 401, 404, 429)))
    async def retrieve_response(request: Request, response_id: str) -> Response:
        return await responses.retrieve(stored(request), response_id)

    @app.delete("/v1/responses/{response_id}", **_documented(None, rp.DeletedResponse, (400, 401, 404, 429)))
    async def delete_response(request: Request, response_id: str) -> Response:
        return await responses.delete(stored(request), response_id)

    @app.get("/v1/responses/{response_id}/input_items", **{
        **_documented(None, rp.InputItemList, (400, 401, 404, 429)), "openapi_extra": _ITEMS_QUERY})
    async def response_input_items(request: Request, response_id: str) -> Response:
        key, query = stored(request, ("after", "limit", "order")), request.query_params
        limit, order = query.get("limit", "20"), query.get("order", "desc")
        if not (limit.isascii() and limit.isdigit()) or not 1 <= int(limit) <= MAX_ITEMS_PAGE:
            raise ApiError(400, f"limit must be a whole number in [1, {MAX_ITEMS_PAGE}], got {limit!r}", param="limit")
        if order not in ("asc", "desc"):
            raise ApiError(400, f"order must be asc or desc, got {order!r}", param="order")
        return await responses.input_items(key, response_id, query.get("after"), int(limit), order)

    @app.post("/v1/completions", **_documented(p.CompletionRequest, r.CompletionResponse, (*_BODY_ERRORS, 500),
                                               r.CompletionResponse))
    async def completions(request: Request) -> Response:
        return await generation(request, p.CompletionRequest, generations.completions)

    @app.get("/v1/models", **_documented(None, r.ModelList, (401, 503)))
    async def models(request: Request) -> Response:
        authenticated(request)
        server.ready()
        return JSONResponse(server.models().model_dump())

    @app.post("/tokenize", **_documented(p.TokenizeRequest, r.TokenizeResponse, _BODY_ERRORS))
    async def tokenize(request: Request) -> Response:
        return await tokenization.tokenize(*await admitted(request, p.TokenizeRequest))

    @app.post("/detokenize", **_documented(p.DetokenizeRequest, r.DetokenizeResponse, _BODY_ERRORS))
    async def detokenize(request: Request) -> Response:
        return await tokenization.detokenize(*await admitted(request, p.DetokenizeRequest))

    @app.get("/", include_in_schema=False)
    async def page() -> Response:
        return FileResponse(STATIC / "index.html", headers={"Content-Security-Policy": PAGE_POLICY})

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.post("/inspect/next-token", **_documented(ip.NextTokenRequest, ip.NextTokenResponse, (*_BODY_ERRORS, 500)))
    async def next_token(request: Request) -> Response:
        return await generation(request, ip.NextTokenRequest, inspector.next_token)

    @app.post("/inspect/logit-lens", **_documented(ip.LogitLensRequest, ip.LogitLensResponse, (*_BODY_ERRORS, 500)))
    async def logit_lens(request: Request) -> Response:
        return await generation(request, ip.LogitLensRequest, inspector.logit_lens)

    @app.post("/inspect/document", **_documented(ip.DocumentRequest, ip.DocumentResponse, _BODY_ERRORS))
    async def document(request: Request) -> Response:
        return await inspector.document(*await admitted(request, ip.DocumentRequest))

    @app.post("/inspect/bpe", **_documented(ip.BpeRequest, ip.BpeResponse, _BODY_ERRORS))
    async def bpe(request: Request) -> Response:
        return await inspector.bpe(*await admitted(request, ip.BpeRequest))

    @app.get("/inspect/engine", **{**_documented(None, ip.EngineResponse, (400, 401, 503)),
                                  "openapi_extra": _ENGINE_QUERY})
    async def engine_view(request: Request) -> Response:
        authenticated(request)
        server.ready()
        return await inspector.engine(_query(request, {"steps": "64"})["steps"])

    @app.get("/inspect/batch", **{**_documented(None, ip.BatchResponse, (400, 401, 503)),
                                 "openapi_extra": _BATCH_QUERY})
    async def batch_view(request: Request) -> Response:
        authenticated(request)
        server.ready()
        query = _query(request, {"steps": "48", "request_id": None})
        return await inspector.batch(query["steps"], query["request_id"])

    @app.post("/v1/cache/pins", **_documented(cp.PinRequest, cp.CachePin, (*_BODY_ERRORS, 500)))
    async def pin(request: Request) -> Response:
        return await generation(request, cp.PinRequest, pins.pin)

    @app.get("/v1/cache/pins", **_documented(None, cp.CachePinList, (401, 503)))
    async def list_pins(request: Request) -> Response:
        authenticated(request)
        server.ready()
        return await pins.list()

    @app.delete("/v1/cache/pins/{name}", **_documented(None, cp.CachePinDeleted, (401, 404, 503)))
    async def delete_pin(request: Request, name: str) -> Response:
        authenticated(request)
        server.ready()
        return await pins.delete(name)

    @app.get("/health", **_documented(None, r.HealthResponse, (503,)))
    async def health() -> Response:
        server.ready()
        return JSONResponse(r.HealthResponse().model_dump())

    @app.get("/version", **_documented(None, r.VersionResponse, ()))
    async def version() -> Response:
        return JSONResponse(r.VersionResponse(version=zhuzi.__version__).model_dump())

    @app.get("/metrics", response_class=PlainTextResponse, responses={200: {"description": "Prometheus metrics"}})
    async def metrics() -> Response:
        body, content_type = server.metrics.render()
        return Response(body, media_type=content_type)

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
        return error_response(request, int(info.code or 500), info.message, info.type, code=info.code)

    return app
