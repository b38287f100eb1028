"""The first step of every API's routes: who asks (the gateway's key and rate), the body (JSON, within the size
limit, validated into the API's words, a refusal naming the field the client sent), the shape a route's errors
take (its router's), and how a route is described in the OpenAPI spec.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import pydantic
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute

from zhuzi.server.common.errors import ApiError
from zhuzi.server.common.serving import Server
from zhuzi.server.common.streams import ClientGone

ModelT = TypeVar("ModelT", bound=pydantic.BaseModel)
# An API's error object for an error, with the headers it carries (Retry-After, Allow, ...).
ErrorRenderer = Callable[[ApiError, dict[str, str] | None], JSONResponse]


def answering_errors_with(render: ErrorRenderer) -> type[APIRoute]:
    """The route class of an API's router: its routes carry the API's error renderer, which the app's error
    handlers use for whatever the route raises (the router that received a request chooses its error's shape)."""
    class ApiRoute(APIRoute):
        render_error = staticmethod(render)

    return ApiRoute


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
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise too_large
    return bytes(body)


@dataclass
class Intake:
    """What a route checks before its API's logic runs, for every API's routes alike."""

    server: Server
    field_names: frozenset[str]  # every API's request fields, which a validation error's loc may name
    unsupported: dict[str, str]  # a field no model declares -> why zhuzi refuses it

    def authenticated(self, request: Request) -> str:
        return self.server.gateway.authenticate(request.headers.get("authorization"),
                                                request.headers.get("x-api-key"))

    async def admitted(self, request: Request, body_model: type[ModelT]) -> tuple[str, ModelT]:
        """The caller's key and the parsed body, in the order that spends least on a refusal; the model the body
        names is loaded and held for the request."""
        key = self.authenticated(request)
        self.server.available()
        self.server.gateway.check_rate(key)
        body = await self.parse_body(request, body_model)
        await self.server.hold(body, key)
        return key, body

    async def generation(self, request: Request, body_model: type[ModelT],
                         handler: Callable[[Request, str, ModelT], Awaitable[Response]]) -> Response:
        key, body = await self.admitted(request, body_model)
        try:
            return await handler(request, key, body)
        except ClientGone:
            return Response(status_code=499)

    async def parse_body(self, request: Request, model: type[ModelT]) -> ModelT:
        raw = await read_body(request, self.server.config.max_request_body_bytes)
        try:
            return model.model_validate_json(raw)
        except pydantic.ValidationError as exc:
            raise self.validation_error(exc) from exc

    def validation_error(self, exc: pydantic.ValidationError) -> ApiError:
        first = exc.errors()[0]
        if first["type"] == "json_invalid":
            return ApiError(400, f"The body is not valid JSON: {first['msg']}")
        # A union's alternatives add their type names to loc; keep the list indexes and field names.
        loc = [str(x) for x in first["loc"] if isinstance(x, int) or x in self.field_names]
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":  # a field no model declares: name it, and say why if zhuzi knows
            field = str(first["loc"][-1])
            loc = loc[:-1] + [field] if loc[-1:] == [field] else loc + [field]
            message = self.unsupported.get(field, "is not a field zhuzi knows (no field is accepted and ignored)")
            return ApiError(400, f"{'.'.join(loc)} {message}", param=".".join(loc))
        param = ".".join(loc) or None
        return ApiError(400, f"{param}: {message}" if param else message, param=param)


# ---------------------------------------------------------------- a route's OpenAPI description

ERROR_DESCRIPTIONS = {
    400: "Invalid request: the error's param names the field", 401: "Missing or wrong API key",
    404: "Unknown model, stored response or pin", 413: "Request body too large", 415: "Body not JSON",
    429: "Rate limit or queue full", 500: "The engine failed this request",
    503: "Loading, shutting down, or the engine failed", 529: "Overloaded: queue full, loading or shutting down",
}
BODY_ERRORS = (400, 401, 404, 413, 415, 429, 503)


def _ref(model: type[pydantic.BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _sse_event(event: type[pydantic.BaseModel], error: type[pydantic.BaseModel], named: bool,
               done: bool) -> dict[str, Any]:
    """One server-sent event (OpenAPI 3.1 describes each event): its data is the event as JSON or an error object
    (a failure after the headers went out); OpenAI's chat and completion streams end with [DONE], Anthropic's
    and the Responses API's name each event instead, and the Responses API's ends with an unnamed [DONE] too
    (done: the Open Responses specification's end of a stream)."""
    json_data = {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": {"anyOf": [_ref(event), _ref(error)]}}
    if not named:
        return {"type": "object", "required": ["data"],
                "properties": {"data": {"anyOf": [{"const": "[DONE]"}, json_data]}}}
    each = {"type": "object", "required": ["event", "data"],
            "properties": {"event": {"type": "string"}, "data": json_data}}
    last = {"type": "object", "required": ["data"], "properties": {"data": {"const": "[DONE]"}}}
    return {"anyOf": [each, last]} if done else each


def documented(body: type[pydantic.BaseModel] | None, answer: type[pydantic.BaseModel] | None,
               statuses: tuple[int, ...], error: type[pydantic.BaseModel],
               event: type[pydantic.BaseModel] | None = None, named: bool = False,
               done: bool = False) -> dict[str, Any]:
    """A route's OpenAPI description: its JSON body (which the route parses itself), its answer (and the
    events of its SSE stream, named or not, a named stream ending with [DONE] or not), its API's error object."""
    responses: dict[int | str, dict[str, Any]] = {
        status: {"model": error, "description": ERROR_DESCRIPTIONS[status]} for status in statuses}
    if answer is not None:
        ok: dict[str, Any] = {"model": answer, "description": "Success"}
        if event is not None:
            ok["content"] = {"text/event-stream": {"schema": _sse_event(event, error, named, done)}}
            ok["description"] = "Success: the whole answer, or with stream true its server-sent events"
        responses[200] = ok
    extra = {"requestBody": {"required": True, "content": {"application/json": {"schema": _ref(body)}}}} \
        if body is not None else None
    return {"responses": responses, "openapi_extra": extra}
