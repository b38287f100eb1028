"""The server's own routes, no API's: /health (200 while the model is loaded and the engine works, else 503
saying why; a server of many models: 200, naming those loaded), /version, /metrics (Prometheus,
common/metrics.py), and llama-server's /models/load and /models/unload for a server of many models."""
from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

import zhuzi
from zhuzi.server.common import schema
from zhuzi.server.common.errors import ApiError
from zhuzi.server.common.routes import Intake
from zhuzi.server.openai.router import OpenAIRoute, documented


class HealthResponse(schema.Response):
    status: Literal["ok"] = "ok"
    models: list[str]  # those loaded


class VersionResponse(schema.Response):
    version: str


class ModelRequest(schema.Request):
    model: str


class ModelAnswer(schema.Response):
    success: bool = True


def router(intake: Intake) -> APIRouter:
    routes = APIRouter(route_class=OpenAIRoute)
    server = intake.server

    @routes.get("/health", **documented(None, HealthResponse, (503,)))
    async def health() -> Response:
        server.available()
        if server.models is None:
            server.ready()
        loaded = server.models.loaded() if server.models is not None else [server.default] if server.default else []
        return JSONResponse(HealthResponse(models=[served.name for served in loaded]).model_dump())

    @routes.get("/version", **documented(None, VersionResponse, ()))
    async def version() -> Response:
        return JSONResponse(VersionResponse(version=zhuzi.__version__).model_dump())

    @routes.get("/metrics", response_class=PlainTextResponse, responses={200: {"description": "Prometheus metrics"}})
    async def metrics() -> Response:
        body, content_type = server.metrics.render()
        return Response(body, media_type=content_type)

    @routes.post("/models/load", **documented(ModelRequest, ModelAnswer, (400, 401, 404, 500, 503)))
    async def load(request: Request) -> Response:
        """Load the model now (the request holds it until this answer: its keep-alive counts from then)."""
        _, body = await intake.admitted(request, ModelRequest)
        server.check_model(body.model)
        return JSONResponse(ModelAnswer().model_dump())

    @routes.post("/models/unload", **documented(ModelRequest, ModelAnswer, (400, 401, 404)))
    async def unload(request: Request) -> Response:
        """Unload the model now, or as its running requests end."""
        intake.authenticated(request)
        body = await intake.parse_body(request, ModelRequest)
        if server.models is None:
            raise ApiError(400, "This server serves one model, loaded for its life: there is nothing to unload.",
                           param="model")
        return JSONResponse(ModelAnswer(success=server.models.unload(body.model)).model_dump())

    return routes
