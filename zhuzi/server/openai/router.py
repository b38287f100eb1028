"""OpenAI's routes (and vLLM's): /v1/chat/completions and its /render, /v1/completions, /v1/embeddings,
/v1/models, /tokenize and /detokenize, each checked by the Intake and handed to its logic (serving.py,
embeddings.py, tokenize.py)."""
from __future__ import annotations

from typing import Any

import pydantic
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from zhuzi.server.common.routes import BODY_ERRORS, Intake, answering_errors_with
from zhuzi.server.common.routes import documented as described
from zhuzi.server.openai import answers as r
from zhuzi.server.openai import protocol as p
from zhuzi.server.openai.embeddings import Embeddings
from zhuzi.server.openai.formats import error_response
from zhuzi.server.openai.serving import Completions
from zhuzi.server.openai.tokenize import Tokenization

# OpenAI's routes, and those of the APIs that answer errors as OpenAI does: OpenAI's error object.
OpenAIRoute = answering_errors_with(error_response)


def documented(body: type[pydantic.BaseModel] | None, answer: type[pydantic.BaseModel], statuses: tuple[int, ...],
               event: type[pydantic.BaseModel] | None = None, named: bool = False,
               done: bool = False) -> dict[str, Any]:
    """A route's OpenAPI description, its errors OpenAI's error object."""
    return described(body, answer, statuses, r.ErrorResponse, event, named, done)


def router(intake: Intake, generations: Completions, tokenization: Tokenization, embeddings: Embeddings) -> APIRouter:
    routes = APIRouter(route_class=OpenAIRoute)
    server = intake.server

    @routes.post("/v1/chat/completions", **documented(p.ChatCompletionRequest, r.ChatCompletionResponse,
                                                       (*BODY_ERRORS, 500), r.ChatCompletionChunk))
    async def chat_completions(request: Request) -> Response:
        return await intake.generation(request, p.ChatCompletionRequest, generations.chat)

    @routes.post("/v1/chat/completions/render", **documented(p.ChatCompletionRequest, r.RenderResponse, BODY_ERRORS))
    async def render(request: Request) -> Response:
        return await generations.render(*await intake.admitted(request, p.ChatCompletionRequest))

    @routes.post("/v1/completions", **documented(p.CompletionRequest, r.CompletionResponse, (*BODY_ERRORS, 500),
                                                 r.CompletionResponse))
    async def completions(request: Request) -> Response:
        return await intake.generation(request, p.CompletionRequest, generations.completions)

    @routes.post("/v1/embeddings", **documented(p.EmbeddingRequest, r.EmbeddingResponse, (*BODY_ERRORS, 500)))
    async def embed(request: Request) -> Response:
        return await intake.generation(request, p.EmbeddingRequest, embeddings.openai)

    @routes.get("/v1/models", **documented(None, r.ModelList, (401, 503)))
    async def models(request: Request) -> Response:
        intake.authenticated(request)
        if server.models is not None:
            cards = [r.ModelCard(id=m.spec.id, created=server.created, root=str(m.spec.path), state=m.state,
                                 max_model_len=m.served.engine.max_model_len if m.served else None,
                                 memory=m.spec.size, error=m.error) for m in server.models.models.values()]
            return JSONResponse(r.ModelList(data=cards).model_dump())
        engine = server.ready()
        card = r.ModelCard(id=server.model_name, created=server.created, root=engine.config.model or engine.model_name,
                           max_model_len=engine.max_model_len)
        return JSONResponse(r.ModelList(data=[card]).model_dump())

    @routes.post("/tokenize", **documented(p.TokenizeRequest, r.TokenizeResponse, BODY_ERRORS))
    async def tokenize(request: Request) -> Response:
        return await tokenization.tokenize(*await intake.admitted(request, p.TokenizeRequest))

    @routes.post("/detokenize", **documented(p.DetokenizeRequest, r.DetokenizeResponse, BODY_ERRORS))
    async def detokenize(request: Request) -> Response:
        return await tokenization.detokenize(*await intake.admitted(request, p.DetokenizeRequest))

    return routes
