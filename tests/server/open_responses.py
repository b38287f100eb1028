"""The Open Responses specification (data/open_responses_2026-04-24.json, data/README.md) as a check on what
/v1/responses answers: a Response (created or retrieved) against its ResponseResource, each streamed event
against the event schema its type names, [DONE] last. The httpx transports check every such answer that passes
through a client (the `openai` SDK's, sync or async) as the client reads it."""
from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import jsonschema
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SPEC = Path(__file__).parent / "data" / "open_responses_2026-04-24.json"
URI = "urn:open-responses"
STORED = re.compile(r"^/v1/responses/[^/]+$")


@cache
def _spec() -> dict[str, Any]:
    spec = json.loads(SPEC.read_text())
    # The release's erratum (data/README.md): its source lets a json_schema format carry its schema.
    spec["components"]["schemas"]["JsonSchemaResponseFormat"]["properties"]["schema"] = {
        "anyOf": [{"type": "object"}, {"type": "null"}]}
    return spec


@cache
def _validator(component: str) -> jsonschema.Draft202012Validator:
    registry = Registry().with_resource(URI, Resource.from_contents(_spec(), default_specification=DRAFT202012))
    return jsonschema.Draft202012Validator({"$ref": f"{URI}#/components/schemas/{component}"}, registry=registry)


@cache
def _event_schemas() -> dict[str, str]:
    """Each streamed event's type -> its schema (the stream's oneOf, discriminated by type)."""
    stream = _spec()["paths"]["/responses"]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
    names = [ref["$ref"].rsplit("/", 1)[-1] for ref in stream["oneOf"]]
    schemas = _spec()["components"]["schemas"]
    return {schemas[name]["properties"]["type"]["enum"][0]: name for name in names}


def check_response(response: dict[str, Any]) -> None:
    _validator("ResponseResource").validate(response)


def check_event(event: dict[str, Any]) -> None:
    schema = _event_schemas().get(event.get("type"))
    assert schema is not None, f"{event.get('type')!r} is not an event of the specification"
    _validator(schema).validate(event)


def check_stream(body: str) -> list[tuple[str, dict[str, Any]]]:
    """A whole stream's events as (SSE name, JSON data), each checked: its name its type, its sequence number
    above the one before, and [DONE] the last event."""
    blocks = [dict(line.split(": ", 1) for line in block.splitlines()) for block in body.strip().split("\n\n")]
    assert blocks and blocks[-1] == {"data": "[DONE]"}, f"the stream does not end with [DONE]: {blocks[-1:]}"
    events = [(block["event"], json.loads(block["data"])) for block in blocks[:-1]]
    for (name, event), (_, before) in zip(events, [("", {"sequence_number": -1}), *events]):
        assert name == event["type"] and event["sequence_number"] > before["sequence_number"], (name, event)
        check_event(event)
    return events


def _check(request: httpx.Request, response: httpx.Response) -> Callable[[bytes], None] | None:
    """What checks an answer's body once read: a Response's, or a stream of events."""
    method, path = request.method, request.url.path
    if response.status_code != 200 or not (method == "POST" and path == "/v1/responses"
                                           or method == "GET" and STORED.match(path)):
        return None
    if response.headers["content-type"].startswith("text/event-stream"):
        return lambda body: check_stream(body.decode())
    return lambda body: check_response(json.loads(body))


class _CheckedStream(httpx.SyncByteStream, httpx.AsyncByteStream):
    """An answer's bytes as they pass, checked when the last has."""

    def __init__(self, stream: Any, check: Callable[[bytes], None]) -> None:
        self.stream, self.check, self.body = stream, check, bytearray()

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self.stream:
            self.body += chunk
            yield chunk
        self.check(bytes(self.body))

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self.stream:
            self.body += chunk
            yield chunk
        self.check(bytes(self.body))

    def close(self) -> None:
        self.stream.close()

    async def aclose(self) -> None:
        await self.stream.aclose()


class SpecTransport(httpx.HTTPTransport):
    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if (check := _check(request, response)) is not None:
            response.stream = _CheckedStream(response.stream, check)
        return response


class AsyncSpecTransport(httpx.AsyncHTTPTransport):
    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        if (check := _check(request, response)) is not None:
            response.stream = _CheckedStream(response.stream, check)
        return response
