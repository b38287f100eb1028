"""The inspector's routes: its page at / (and its files under /static), and /inspect/... (the probes, checked by
the Intake like any generation, and the engine's and the batch's views, whose query the routes read)."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles

from zhuzi.server.common.errors import ApiError
from zhuzi.server.common.routes import BODY_ERRORS, Intake
from zhuzi.server.inspect import protocol as ip
from zhuzi.server.inspect.serving import Inspector
from zhuzi.server.openai.router import OpenAIRoute, documented

STATIC = Path(__file__).parent / "static"
# The page loads nothing from elsewhere, and nothing else may run in it.
PAGE_POLICY = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
               "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'")


# The GET routes' parameters, which the routes read themselves (a bad value is OpenAI's 400, not 422).
def _steps_parameter(default: int) -> dict[str, Any]:
    return {"name": "steps", "in": "query", "required": False, "description": "how many recent step records to include",
            "schema": {"type": "integer", "minimum": 0, "maximum": ip.MAX_STEPS, "default": default}}


_MODEL_PARAMETER = {"name": "model", "in": "query", "required": False,
                    "description": "the model to look at (a server of many models: one loaded; a look loads none)",
                    "schema": {"type": "string"}}
_ENGINE_QUERY = {"parameters": [_steps_parameter(64), _MODEL_PARAMETER]}
_BATCH_QUERY = {"parameters": [_steps_parameter(48), _MODEL_PARAMETER, {
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


def router(intake: Intake, inspector: Inspector) -> APIRouter:
    routes = APIRouter(route_class=OpenAIRoute)
    server = intake.server

    @routes.get("/", include_in_schema=False)
    async def page() -> Response:
        return FileResponse(STATIC / "index.html", headers={"Content-Security-Policy": PAGE_POLICY})

    routes.mount("/static", StaticFiles(directory=STATIC), name="static")

    @routes.post("/inspect/next-token", **documented(ip.NextTokenRequest, ip.NextTokenResponse, (*BODY_ERRORS, 500)))
    async def next_token(request: Request) -> Response:
        return await intake.generation(request, ip.NextTokenRequest, inspector.next_token)

    @routes.post("/inspect/logit-lens", **documented(ip.LogitLensRequest, ip.LogitLensResponse, (*BODY_ERRORS, 500)))
    async def logit_lens(request: Request) -> Response:
        return await intake.generation(request, ip.LogitLensRequest, inspector.logit_lens)

    @routes.post("/inspect/document", **documented(ip.DocumentRequest, ip.DocumentResponse, BODY_ERRORS))
    async def document(request: Request) -> Response:
        return await inspector.document(*await intake.admitted(request, ip.DocumentRequest))

    @routes.post("/inspect/bpe", **documented(ip.BpeRequest, ip.BpeResponse, BODY_ERRORS))
    async def bpe(request: Request) -> Response:
        return await inspector.bpe(*await intake.admitted(request, ip.BpeRequest))

    @routes.get("/inspect/engine", **{**documented(None, ip.EngineResponse, (400, 401, 404, 503)),
                                     "openapi_extra": _ENGINE_QUERY})
    async def engine_view(request: Request) -> Response:
        intake.authenticated(request)
        query = _query(request, {"steps": "64", "model": None})
        server.view(query["model"])
        server.ready()
        return await inspector.engine(query["steps"])

    @routes.get("/inspect/batch", **{**documented(None, ip.BatchResponse, (400, 401, 404, 503)),
                                    "openapi_extra": _BATCH_QUERY})
    async def batch_view(request: Request) -> Response:
        intake.authenticated(request)
        query = _query(request, {"steps": "48", "request_id": None, "model": None})
        server.view(query["model"])
        server.ready()
        return await inspector.batch(query["steps"], query["request_id"])

    return routes
