"""The tokenizer endpoints' logic (/tokenize, /detokenize, vLLM's), between the routes and the engine.

Both run in worker threads and count against the caller's token budget: a /tokenize of megabytes must
neither hold up the event loop nor be free.
"""
from __future__ import annotations

import json

import pydantic
from fastapi.responses import Response

from zhuzi.sampling_params import InvalidRequest
from zhuzi.server import protocol as p
from zhuzi.server import responses as r
from zhuzi.server.serving import ApiError, Server, json_response

JSON_SLICE = 1 << 15  # list items one json.dumps call writes (a few ms)


def sliced_json(body: pydantic.BaseModel) -> str:
    """body's JSON with each list written in slices, so that no single call holds the GIL for long (a /tokenize
    answer may list a million tokens): the event loop and the engine get their turns between the slices. For
    flat models of JSON values, as TokenizeResponse is."""
    def value(item: object) -> str:
        if not isinstance(item, list):
            return json.dumps(item, ensure_ascii=False)
        slices = (json.dumps(item[i:i + JSON_SLICE], ensure_ascii=False)[1:-1] for i in range(0, len(item), JSON_SLICE))
        return "[" + ",".join(slices) + "]"

    return "{" + ",".join(f"{json.dumps(name)}:{value(item)}" for name, item in body) + "}"


class Tokenization:
    def __init__(self, server: Server) -> None:
        self.server = server

    async def tokenize(self, key: str, body: p.TokenizeRequest) -> Response:
        self.server.check_model(body.model)
        engine = self.server.ready()

        def tokenize() -> tuple[int, Response]:
            if body.messages is not None:
                ids = self.server.render_chat(body)[0]
            else:
                ids = engine.tokenizer.encode_prompt(body.prompt or "")
            answer = r.TokenizeResponse.model_construct(  # built here: no need to validate a million items
                tokens=ids, token_strs=engine.tokenizer.token_strs(ids), count=len(ids),
                max_model_len=engine.max_model_len)
            return len(ids), Response(sliced_json(answer), media_type="application/json")

        count, response = await self.server.in_worker(tokenize)
        self.server.gateway.charge_tokens(key, count)
        return response

    async def detokenize(self, key: str, body: p.DetokenizeRequest) -> Response:
        self.server.check_model(body.model)
        engine = self.server.ready()

        def detokenize() -> Response:
            try:
                engine.check_token_ids(body.tokens, "tokens")
            except InvalidRequest as exc:
                raise ApiError.of(exc) from exc
            return json_response(r.DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens,
                                                                                     skip_special_tokens=False)))

        response = await self.server.in_worker(detokenize)
        self.server.gateway.charge_tokens(key, len(body.tokens))
        return response
