"""Anthropic's routes: /v1/messages and /v1/messages/count_tokens, checked by the Intake and handed to
serving.py; their errors are Anthropic's error object, with its status codes."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from zhuzi.server.anthropic import protocol as a
from zhuzi.server.anthropic.serving import Messages, anthropic_status, error_response
from zhuzi.server.common.routes import BODY_ERRORS, Intake, answering_errors_with, documented

MESSAGES = "/v1/messages"


def statuses(server_statuses: tuple[int, ...]) -> tuple[int, ...]:
    """Anthropic's statuses for the server's refusals (an overload is its 529)."""
    return tuple(sorted({anthropic_status(s) for s in server_statuses} | ({529} if 429 in server_statuses else set())))


def router(intake: Intake, anthropic: Messages) -> APIRouter:
    routes = APIRouter(route_class=answering_errors_with(error_response))

    @routes.post(MESSAGES, **documented(a.MessagesRequest, a.Message, statuses((*BODY_ERRORS, 500)),
                                        a.AnthropicError, a.MessageStreamEvent, named=True))
    async def messages(request: Request) -> Response:
        return await intake.generation(request, a.MessagesRequest, anthropic.create)

    @routes.post(f"{MESSAGES}/count_tokens", **documented(a.CountTokensRequest, a.TokenCount, statuses(BODY_ERRORS),
                                                           error=a.AnthropicError))
    async def count_tokens(request: Request) -> Response:
        return await anthropic.count_tokens(*await intake.admitted(request, a.CountTokensRequest))

    return routes
