"""The tokenizer endpoints' logic (/tokenize, /detokenize, vLLM's), between the routes and the engine.

Both tokenize in worker threads and count against the caller's token budget: a /tokenize of megabytes must
neither hold up the event loop nor be free.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pydantic
from fastapi.responses import Response, StreamingResponse

from zhuzi.sampling_params import InvalidRequest
from zhuzi.server.common.errors import ApiError
from zhuzi.server.common.serving import Server, json_response
from zhuzi.server.openai import answers as r
from zhuzi.server.openai import protocol as p

JSON_SLICE = 1 << 13  # list items one json.dumps call writes (about a millisecond)


async def json_slices(body: pydantic.BaseModel) -> AsyncIterator[str]:
    """body's JSON, written on the event loop a slice at a time: a /tokenize answer may list a million tokens
    (25 MB, a third of a second of json.dumps), and built in a worker thread it would fight the event loop for
    the GIL all that time. Here other requests get their turn between slices. For flat models of JSON values,
    as TokenizeResponse is."""
    yield "{"
    for n, (name, item) in enumerate(body):
        yield ("," if n else "") + json.dumps(name) + ":"
        if isinstance(item, list):
            yield "["
            for i in range(0, len(item), JSON_SLICE):
                yield ("," if i else "") + json.dumps(item[i:i + JSON_SLICE], ensure_ascii=False)[1:-1]
                await asyncio.sleep(0)
            yield "]"
        else:
            yield json.dumps(item, ensure_ascii=False)
    yield "}"


class Tokenization:
    def __init__(self, server: Server) -> None:
        self.server = server

    async def tokenize(self, key: str, body: p.TokenizeRequest) -> Response:
        self.server.check_model(body.model)
        engine = self.server.ready()

        def tokenize() -> r.TokenizeResponse:
            if body.messages is not None:
                ids = self.server.render_chat(body.chat()).ids
            else:
                ids = engine.tokenizer.encode_prompt(body.prompt or "")
            return r.TokenizeResponse.model_construct(  # no need to validate a million items
                tokens=ids, token_strs=engine.tokenizer.token_strs(ids), count=len(ids),
                max_model_len=engine.max_model_len)

        answer = await self.server.in_worker(tokenize)
        self.server.gateway.charge_tokens(key, answer.count)
        return StreamingResponse(json_slices(answer), media_type="application/json")

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
