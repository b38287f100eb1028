"""The Responses API's routes: /v1/responses, and a stored response's GET, DELETE and input_items (which need
no engine), checked by the Intake and handed to serving.py."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from zhuzi.server.common.errors import ApiError
from zhuzi.server.common.routes import BODY_ERRORS, Intake
from zhuzi.server.openai.router import OpenAIRoute, documented
from zhuzi.server.responses import protocol as rp
from zhuzi.server.responses.serving import MAX_ITEMS_PAGE, Responses

_ITEMS_QUERY = {"parameters": [
    {"name": "after", "in": "query", "required": False, "description": "list the items after this item id",
     "schema": {"type": "string"}},
    {"name": "limit", "in": "query", "required": False, "description": "how many items (1-100)",
     "schema": {"type": "integer", "minimum": 1, "maximum": MAX_ITEMS_PAGE, "default": 20}},
    {"name": "order", "in": "query", "required": False, "description": "asc: oldest first; desc: newest first",
     "schema": {"enum": ["asc", "desc"], "default": "desc"}}]}


def router(intake: Intake, responses: Responses) -> APIRouter:
    routes = APIRouter(route_class=OpenAIRoute)

    @routes.post("/v1/responses", **documented(rp.ResponsesRequest, rp.ResponseObject, (*BODY_ERRORS, 500),
                                               rp.ResponseStreamEvent, named=True, done=True))
    async def create_response(request: Request) -> Response:
        return await intake.generation(request, rp.ResponsesRequest, responses.create)

    def stored(request: Request, allowed: tuple[str, ...] = ()) -> str:
        """The caller's key, for a stored response (the engine need not be ready); no query parameter but
        the allowed ones."""
        key = intake.authenticated(request)
        intake.server.gateway.check_rate(key)
        for name in request.query_params:
            if name not in allowed:
                raise ApiError(400, f"{name} is not a parameter zhuzi knows (no parameter is accepted and "
                               "ignored)", param=name)
        return key

    @routes.get("/v1/responses/{response_id}", **documented(None, rp.ResponseObject, (400, 401, 404, 429)))
    async def retrieve_response(request: Request, response_id: str) -> Response:
        return await responses.retrieve(stored(request), response_id)

    @routes.delete("/v1/responses/{response_id}", **documented(None, rp.DeletedResponse, (400, 401, 404, 429)))
    async def delete_response(request: Request, response_id: str) -> Response:
        return await responses.delete(stored(request), response_id)

    @routes.get("/v1/responses/{response_id}/input_items", **{
        **documented(None, rp.InputItemList, (400, 401, 404, 429)), "openapi_extra": _ITEMS_QUERY})
    async def response_input_items(request: Request, response_id: str) -> Response:
        key, query = stored(request, ("after", "limit", "order")), request.query_params
        limit, order = query.get("limit", "20"), query.get("order", "desc")
        if not (limit.isascii() and limit.isdigit()) or not 1 <= int(limit) <= MAX_ITEMS_PAGE:
            raise ApiError(400, f"limit must be a whole number in [1, {MAX_ITEMS_PAGE}], got {limit!r}", param="limit")
        if order not in ("asc", "desc"):
            raise ApiError(400, f"order must be asc or desc, got {order!r}", param="order")
        return await responses.input_items(key, response_id, query.get("after"), int(limit), order)

    return routes
