"""/v1/cache/pins: pinned prefixes, between the routes and the engine.

A pin is computed inside the engine's step loop as an inspection is (every replica pins it, so whichever a
chat lands on holds its prefix), and counts against the caller's rate limits like a prompt: its tokens
less those found cached.
"""
from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from zhuzi.engine.sequence import PinSpec
from zhuzi.outputs import PinInfo
from zhuzi.sampling_params import InvalidRequest
from zhuzi.server.common.errors import ApiError
from zhuzi.server.common.serving import Server, json_response, new_id
from zhuzi.server.common.streams import until_disconnect
from zhuzi.server.pins import protocol as cp


def cache_pin(info: PinInfo) -> cp.CachePin:
    return cp.CachePin(name=info.name, num_tokens=info.num_tokens, num_blocks=info.num_pages, bytes=info.bytes,
                       created_at=int(info.created_at),
                       expires_at=None if info.expires_at is None else int(info.expires_at),
                       cached_tokens=info.cached_tokens)


class CachePins:
    def __init__(self, server: Server) -> None:
        self.server = server

    async def pin(self, request: Request, key: str, body: cp.PinRequest) -> Response:
        self.server.check_model(body.model)
        engine = self.server.ready()
        param = "token_ids" if body.token_ids is not None else "messages"
        if body.token_ids is not None:
            ids = body.token_ids
        else:
            ids = (await self.server.in_worker(self.server.render_chat, body.chat())).ids
        try:
            engine.check_token_ids(ids, param)
        except InvalidRequest as exc:
            raise ApiError.of(exc) from exc
        admission = self.server.gateway.admit(1, self.server.model_name)
        try:
            info = await until_disconnect(request, engine.pin(ids, PinSpec(body.name, body.ttl), new_id("pin")))
        except InvalidRequest as exc:  # too long, over the pinned-memory bound, shorter than a page
            raise ApiError(400, str(exc), param=param if exc.param == "token_ids" else exc.param,
                           code=exc.code) from exc
        finally:
            admission.release()
        self.server.charge(key, len(ids) - info.cached_tokens)
        return json_response(cache_pin(info))

    async def list(self) -> Response:
        pins = await self.server.ready().pins()
        return json_response(cp.CachePinList(data=[cache_pin(info) for info in pins]))

    async def delete(self, name: str) -> Response:
        if not await self.server.ready().unpin(name):
            raise ApiError(404, f"No pin is named {name!r}.", param="name", code="pin_not_found")
        return json_response(cp.CachePinDeleted(name=name))
