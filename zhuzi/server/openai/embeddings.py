"""The embeddings logic (OpenAI's /v1/embeddings, and Ollama's /api/embed through embed()), between the routes
and the engine: a probe through the step loop, the final hidden states pooled (--pooling) and L2-normalized.
"""
from __future__ import annotations

import base64

import torch
from fastapi import Request
from fastapi.responses import Response

from zhuzi.engine.sequence import Probe
from zhuzi.server.common.errors import ApiError
from zhuzi.server.common.serving import Server, json_response, new_id
from zhuzi.server.openai import answers as r
from zhuzi.server.openai import protocol as p


class Embeddings:
    def __init__(self, server: Server) -> None:
        self.server = server

    async def embed(self, request: Request, key: str, inputs: list[str | list[int]], param: str,
                    dimensions: int | None = None, truncate: bool = False) -> tuple[list[torch.Tensor], int]:
        """Each input's embedding ([hidden] float32) and the tokens they took. param: the request's field of
        the inputs, for errors; truncate: an input too long for the context window keeps its first tokens
        (Ollama's default), else it is refused (OpenAI's)."""
        engine = self.server.ready()
        if dimensions is not None and dimensions != engine.embedding_size:
            raise ApiError(400, f"dimensions {dimensions} is not supported: this model's embeddings have "
                                f"{engine.embedding_size} dimensions, and it was not trained to shorten them",
                           param="dimensions")
        if not inputs:
            raise ApiError(400, f"{param} must not be empty", param=param)
        for k, item in enumerate(inputs):
            if not item:
                where = f"{param}.{k}" if len(inputs) > 1 else param
                raise ApiError(400, f"{where} must not be empty", param=where)
        ids = await self.server.in_worker(lambda: [engine.tokenizer.encode_prompt(x) for x in inputs])
        if truncate:  # to what fits the context window and the KV pool, less the probe's one position beyond
            room = min(engine.max_model_len, engine.stats().num_pages * engine.config.page_size) - 1
            ids = [x[:room] for x in ids]
        outs = await self.server.probe(request, key, ids, Probe(embed=True), param)
        return [out.inspection.embedding for out in outs], sum(len(x) for x in ids)

    async def openai(self, request: Request, key: str, body: p.EmbeddingRequest) -> Response:
        self.server.check_model(body.model)
        request_id = new_id("embd")
        self.server.log_user(request_id, body.user)
        vectors, tokens = await self.embed(request, key, body.inputs(), "input", body.dimensions)

        def encoded(vector: torch.Tensor) -> list[float] | str:
            if body.encoding_format == "base64":  # what the openai SDK asks for by default
                return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()
            return vector.tolist()

        return json_response(r.EmbeddingResponse(
            data=[r.Embedding(index=i, embedding=encoded(v)) for i, v in enumerate(vectors)],
            model=self.server.model_name, usage=r.EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)))
