"""The pins' routes: POST, GET and DELETE /v1/cache/pins, checked by the Intake and handed to serving.py."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from zhuzi.server.common.routes import BODY_ERRORS, Intake
from zhuzi.server.openai.router import OpenAIRoute, documented
from zhuzi.server.pins import protocol as cp
from zhuzi.server.pins.serving import CachePins


def router(intake: Intake, pins: CachePins) -> APIRouter:
    routes = APIRouter(route_class=OpenAIRoute)
    server = intake.server

    @routes.post("/v1/cache/pins", **documented(cp.PinRequest, cp.CachePin, (*BODY_ERRORS, 500)))
    async def pin(request: Request) -> Response:
        return await intake.generation(request, cp.PinRequest, pins.pin)

    @routes.get("/v1/cache/pins", **documented(None, cp.CachePinList, (401, 503)))
    async def list_pins(request: Request) -> Response:
        intake.authenticated(request)
        server.ready()
        return await pins.list()

    @routes.delete("/v1/cache/pins/{name}", **documented(None, cp.CachePinDeleted, (401, 404, 503)))
    async def delete_pin(request: Request, name: str) -> Response:
        intake.authenticated(request)
        server.ready()
        return await pins.delete(name)

    return routes
