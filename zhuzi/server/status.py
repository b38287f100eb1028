"""The server's own routes, no API's: /health (200 while the model is loaded and the engine works, else 503
saying why), /version, and /metrics (Prometheus, common/metrics.py)."""
from __future__ import annotations

from typing import Literal

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse, Response

import zhuzi
from zhuzi.server.common import schema
from zhuzi.server.common.serving import Server
from zhuzi.server.openai.router import OpenAIRoute, documented


class HealthResponse(schema.Response):
    status: Literal["ok"] = "ok"


class VersionResponse(schema.Response):
    version: str


def router(server: Server) -> APIRouter:
    routes = APIRouter(route_class=OpenAIRoute)

    @routes.get("/health", **documented(None, HealthResponse, (503,)))
    async def health() -> Response:
        server.ready()
        return JSONResponse(HealthResponse().model_dump())

    @routes.get("/version", **documented(None, VersionResponse, ()))
    async def version() -> Response:
        return JSONResponse(VersionResponse(version=zhuzi.__version__).model_dump())

    @routes.get("/metrics", response_class=PlainTextResponse, responses={200: {"description": "Prometheus metrics"}})
    async def metrics() -> Response:
        body, content_type = server.metrics.render()
        return Response(body, media_type=content_type)

    return routes
