"""What the server sees of the engine: the EngineClient interface (generate, probe, snapshot, pin, abort;
health, fail and stats to watch it), the same wherever the step loop runs, and the Streams its answers come
in: they arrive from another thread, so each call reads them from a Stream bound to the caller's event loop."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from zhuzi.config import EngineConfig
from zhuzi.engine.sequence import PinSpec, Probe, Tenant
from zhuzi.outputs import EngineSnapshot, EngineStats, PinInfo, RequestError, RequestOutput
from zhuzi.sampling_params import SamplingParams, StructuredOutputsParams
from zhuzi.tokenizer import Tokenizer


class EngineDead(RuntimeError):
    """The engine can run nothing more (its loop failed, its process died, or it was declared stalled)."""


@dataclass
class Stream:
    """Where one call's answers wait for their reader, filled from another thread."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # RequestOutput deltas (or one answer), or an Exception

    def put(self, item: Any) -> None:
        """Safe from any thread."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    async def read(self, request_id: str, streams: dict[str, Stream],
                   abort: Callable[[str], None]) -> AsyncIterator[RequestOutput]:
        """The deltas until the last; a request the engine failed raises RequestError. However the reading
        ends, the stream leaves streams; a reader that leaves before the last delta aborts the request."""
        finished = False
        try:
            while not finished:
                item = await self.queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                if item.error is not None:
                    raise RequestError(item.error, item.error_param)
                yield item
        finally:
            streams.pop(request_id, None)
            if not finished:
                abort(request_id)

    async def answer(self, request_id: str, streams: dict[str, Stream]) -> Any:
        """The one answer of a call that gets one (a snapshot)."""
        try:
            item = await self.queue.get()
        finally:
            streams.pop(request_id, None)
        if isinstance(item, Exception):
            raise item
        return item


async def final_inspection(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    """A probe's last output, whose .inspection holds the reading."""
    last = None
    async for out in outputs:
        last = out
    if last is None or last.inspection is None:
        raise RequestError("the inspection ended without a reading (aborted)")
    return last


class EngineClient(Protocol):
    """The engine as the server uses it. Every call is safe from the event loop; none blocks on a step."""

    config: EngineConfig
    tokenizer: Tokenizer  # the front's own copy
    model_name: str
    max_model_len: int
    embedding_size: int  # an embedding's length (the model's hidden size)

    def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                 tenant: Tenant = Tenant()) -> AsyncIterator[RequestOutput]:
        """Deltas until the request finishes, served for tenant (whom the scheduling policies share the engine
        between); closing the iterator aborts the request. A request the engine refused raises its
        InvalidRequest, one it failed RequestError; EngineDead once the engine is gone."""
        ...

    async def probe(self, token_ids: list[int], probe: Probe, request_id: str) -> RequestOutput:
        """An inspection (or an embedding) through the step loop: its final output, whose .inspection holds the
        reading. Cancelling the caller aborts it in the engine."""
        ...

    async def snapshot(self, num_steps: int) -> EngineSnapshot:
        """The engine's state, taken between two of its steps."""
        ...

    async def pin(self, token_ids: list[int], spec: PinSpec, request_id: str) -> PinInfo:
        """Keep token_ids' full KV pages in every replica's pool under spec.name (computed through the step
        loop first); InvalidRequest if they do not fit."""
        ...

    async def unpin(self, name: str) -> bool:
        """Release the pin called name; False if there is none."""
        ...

    async def pins(self) -> list[PinInfo]:
        ...

    def abort(self, request_id: str) -> None:
        """End a request now; if its stream is still read, its last output says finish_reason "abort"."""

    def health(self, stall_timeout: float) -> str | None:
        """None while the engine serves; otherwise what is wrong (failed, gone, or silent for stall_timeout
        seconds with work pending; 0: never counted as stalled)."""
        ...

    def fail(self, reason: str) -> None:
        """Declare the engine unusable: every open stream and every later call gets EngineDead(reason)."""

    def close(self) -> None:
        """Stop the engine (its cores exit) and release what it holds."""

    def stats(self) -> EngineStats:
        ...

    def replica_stats(self) -> dict[int, EngineStats]:
        ...

    def check_token_ids(self, ids: list[int], param: str) -> None:
        """InvalidRequest naming param when an id is outside the model's vocabulary."""

    async def check_structured_output(self, params: StructuredOutputsParams) -> None:
        """StructuredOutputError when params' grammar cannot be compiled (in a worker thread)."""
