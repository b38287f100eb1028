"""Ollama's routes: /api/chat, /api/generate, /api/embed (and the deprecated /api/embeddings), /api/tags,
/api/show, /api/ps and /api/version, checked by the Intake and handed to serving.py; their errors are Ollama's
{"error": ...}."""
from __future__ import annotations

from typing import Any

import pydantic
from fastapi import APIRouter, Request
from fastapi.responses import Response

import zhuzi
from zhuzi.server.common.routes import BODY_ERRORS, Intake, answering_errors_with, documented
from zhuzi.server.common.serving import json_response
from zhuzi.server.ollama import protocol as o
from zhuzi.server.ollama.serving import NDJSON, Ollama, error_response


def streamed(body: type[pydantic.BaseModel], answer: type[pydantic.BaseModel]) -> dict[str, Any]:
    """A generation route's description: its answer whole, or its lines as NDJSON (stream true, the default)."""
    description = documented(body, answer, (*BODY_ERRORS, 500), error=o.OllamaError)
    ok = description["responses"][200]
    ok["content"] = {NDJSON: {"schema": {"anyOf": [{"$ref": f"#/components/schemas/{answer.__name__}"},
                                                    {"$ref": "#/components/schemas/OllamaError"}]}}}
    ok["description"] = "Success: the whole answer, or one JSON object a line (NDJSON) while stream is true"
    return description


def router(intake: Intake, ollama: Ollama) -> APIRouter:
    routes = APIRouter(route_class=answering_errors_with(error_response))

    @routes.post("/api/chat", **streamed(o.ChatRequest, o.ChatResponse))
    async def chat(request: Request) -> Response:
        return await intake.generation(request, o.ChatRequest, ollama.chat)

    @routes.post("/api/generate", **streamed(o.GenerateRequest, o.GenerateResponse))
    async def generate(request: Request) -> Response:
        return await intake.generation(request, o.GenerateRequest, ollama.generate)

    @routes.post("/api/embed", **documented(o.EmbedRequest, o.EmbedResponse, (*BODY_ERRORS, 500), error=o.OllamaError))
    async def embed(request: Request) -> Response:
        return await intake.generation(request, o.EmbedRequest, ollama.embed)

    @routes.post("/api/embeddings", **documented(o.EmbeddingsRequest, o.EmbeddingsResponse, (*BODY_ERRORS, 500),
                                                 error=o.OllamaError))
    async def embeddings(request: Request) -> Response:
        return await intake.generation(request, o.EmbeddingsRequest, ollama.embeddings_legacy)

    @routes.get("/api/tags", **documented(None, o.TagsResponse, (401, 503), error=o.OllamaError))
    async def tags(request: Request) -> Response:
        intake.authenticated(request)
        return await ollama.tags()

    @routes.get("/api/ps", **documented(None, o.PsResponse, (401, 503), error=o.OllamaError))
    async def ps(request: Request) -> Response:
        intake.authenticated(request)
        return await ollama.ps()

    @routes.post("/api/show", **documented(o.ShowRequest, o.ShowResponse, BODY_ERRORS, error=o.OllamaError))
    async def show(request: Request) -> Response:
        _, body = await intake.admitted(request, o.ShowRequest)
        return await ollama.show(body)

    @routes.get("/api/version", **documented(None, o.VersionResponse, (), error=o.OllamaError))
    async def version() -> Response:
        return json_response(o.VersionResponse(version=zhuzi.__version__))

    return routes
