"""Stream plumbing between the engine and the HTTP response: merging a request's engine streams,
and noticing a client that hangs up (which aborts its generation)."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from zhuzi.outputs import RequestOutput

T = TypeVar("T")


async def first_outputs(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """The first output of every stream, concurrently; a refusal (ValueError) surfaces here."""
    return await gather_or_cancel([anext(s) for s in streams])


async def gather_or_cancel(work: list[Awaitable[T]]) -> list[T]:
    """Every result, concurrently; the first failure (or a cancellation) cancels the rest."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def merge_streams(firsts: list[RequestOutput],
                        streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from all streams as they come, each stream's first output first."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, first: RequestOutput, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            await queue.put((index, first, None))
            if not first.finished:
                async for out in stream:
                    await queue.put((index, out, None))
            await queue.put((index, None, done))
        except Exception as exc:  # handed to the consumer, who raises it
            await queue.put((index, None, exc))

    tasks = [asyncio.create_task(pump(i, f, s)) for i, (f, s) in enumerate(zip(firsts, streams))]
    try:
        remaining = len(tasks)
        while remaining:
            index, out, end = await queue.get()
            if end is done:
                remaining -= 1
            elif end is not None:
                raise end
            else:
                yield index, out
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run work, cancelling it if the client hangs up first (which aborts its generation)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


class ClientGone(Exception):
    pass


class ClosingStreamingResponse(StreamingResponse):
    """An SSE response that always runs its cleanup, even if the client left before the first byte."""

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.on_close()
