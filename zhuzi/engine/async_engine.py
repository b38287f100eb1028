"""asyncio bridge for the server: the step loop runs in a thread; each request gets its own stream.

Everything reaches the loop as a command of plain data (add, probe, snapshot, unpin, abort) and comes back as
plain data. The loop beats a heartbeat after every step, so health() tells a working engine from one
whose thread is gone, whose loop failed, or that has work and has stopped making progress. The server
asks only health() and fail(), so the engine can move to a process of its own behind them.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from zhuzi.config import EngineConfig
from zhuzi.engine.engine import Engine
from zhuzi.engine.sequence import PinSpec, Probe
from zhuzi.outputs import EngineSnapshot, EngineStats, PinInfo, RequestError, RequestOutput
from zhuzi.sampling_params import SamplingParams, StructuredOutputsParams

log = logging.getLogger("zhuzi")


@dataclass
class Stream:
    """Where a request's deltas wait for its reader, filled from another thread."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # RequestOutput deltas, or an Exception

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
                    raise RequestError(item.error)
                yield item
        finally:
            streams.pop(request_id, None)
            if not finished:
                abort(request_id)

    async def answer(self, request_id: str, streams: dict[str, Stream]) -> Any:
        """The one answer of a command that gets one (a snapshot)."""
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


class EngineDead(RuntimeError):
    """The engine can run nothing more (its loop failed, or it was declared stalled)."""


class AsyncEngine:
    """Runs the model off the event loop so the server answers while a forward pass runs."""

    engine: Engine  # set by the engine thread before __init__ returns

    def __init__(self, config: EngineConfig):
        """Loads the model in the engine's own thread and returns once it is ready."""
        self._commands: queue.SimpleQueue = queue.SimpleQueue()  # only the loop thread touches the engine
        self._streams: dict[str, Stream] = {}
        self._snapshot_ids = itertools.count()
        self._wake = threading.Event()
        self._failure: str | None = None  # why the engine can run nothing more
        self._idle = True  # the loop waits for work (an old heartbeat then means nothing)
        self._heartbeat = time.monotonic()
        loaded: queue.SimpleQueue = queue.SimpleQueue()
        # The thread that first runs torch must live on: once the thread that started OpenMP's
        # first team exits, libgomp makes every later team crawl (measured: 7x slower steps).
        self._thread = threading.Thread(target=self._run, args=(config, loaded), name="zhuzi-engine", daemon=True)
        self._thread.start()
        error = loaded.get()
        if error is not None:
            raise error
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.model_name = self.engine.model_name
        self._stats = self.engine.stats()
        # The grammar library's view of the tokenizer takes a second or so: build it before a request needs it.
        threading.Thread(target=self.engine.grammars.warm, name="zhuzi-grammar-warmup", daemon=True).start()

    def _run(self, config: EngineConfig, loaded: queue.SimpleQueue) -> None:
        try:
            self.engine = Engine(config)
        except BaseException as e:  # the caller re-raises it
            loaded.put(e)
            return
        loaded.put(None)
        try:
            self._loop()
        except BaseException as exc:  # the engine's own state may be broken: nothing more may run on it
            log.critical("the engine loop failed; every request ends with an error", exc_info=exc)
            self.fail(f"the engine failed: {type(exc).__name__}: {exc}")

    def stats(self) -> EngineStats:
        return self._stats

    def replica_stats(self) -> dict[int, EngineStats]:
        return {0: self._stats}

    def health(self, stall_timeout: float) -> str | None:
        """None while the engine works; otherwise what is wrong: it failed, its thread is gone, or it has
        work and has not finished a step for stall_timeout seconds (0: never counted as stalled)."""
        if self._failure is not None:
            return self._failure
        if not self._thread.is_alive():
            return "the engine thread has stopped"
        silent = time.monotonic() - self._heartbeat
        if stall_timeout and not self._idle and silent > stall_timeout:
            return f"the engine has made no progress for {silent:.0f} s with requests pending"
        return None

    def fail(self, reason: str) -> None:
        """Declare the engine unusable: every open stream and every later request gets EngineDead(reason).
        Safe from any thread."""
        if self._failure is None:
            self._failure = reason
        for request_id in list(self._streams):
            self._deliver(request_id, EngineDead(reason))

    def check_token_ids(self, ids: list[int], param: str) -> None:
        self.engine.check_token_ids(ids, param)  # reads only the model's shape: safe from any thread

    async def check_structured_output(self, params: StructuredOutputsParams) -> None:
        """Compile params' grammar in a worker thread (InvalidRequest if it cannot be), so that the engine
        thread finds it cached and the streams it runs never wait for a compile."""
        await asyncio.to_thread(self.engine.grammars.matcher, params)  # the compiler is thread-safe

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Yields deltas until the request finishes; closing the iterator aborts the request. A request the
        engine failed raises RequestError; all of them raise EngineDead once the engine is gone."""
        async for out in self._outputs(("add", request_id, prompt, params, time.monotonic())):
            yield out

    async def probe(self, token_ids: list[int], probe: Probe, request_id: str) -> RequestOutput:
        """An inspection through the step loop: its final output, whose .inspection holds the reading.
        Cancelling the caller aborts it in the engine."""
        return await final_inspection(self._outputs(("probe", request_id, token_ids, probe)))

    async def snapshot(self, num_steps: int) -> EngineSnapshot:
        """The engine's state, taken on the step loop's thread between two steps."""
        return await self._ask("snapshot", num_steps)

    async def pin(self, token_ids: list[int], spec: PinSpec, request_id: str) -> PinInfo:
        """Pin token_ids' full KV blocks (computed through the step loop first); InvalidRequest if they do not fit."""
        out = await self.probe(token_ids, Probe(pin=spec), request_id)
        assert out.pin is not None
        return out.pin

    async def unpin(self, name: str) -> bool:
        """Release the pin called name; False if there is none."""
        return await self._ask("unpin", name)

    async def pins(self) -> list[PinInfo]:
        return (await self.snapshot(0)).pins

    async def _ask(self, kind: str, *args: object) -> Any:
        """A command answered at once, between two steps."""
        request_id = f"{kind}-{next(self._snapshot_ids)}"
        stream = self._open(request_id)
        self._send((kind, request_id, *args))
        return await stream.answer(request_id, self._streams)

    def _open(self, request_id: str) -> Stream:
        if self._failure is not None:
            raise EngineDead(self._failure)
        stream = Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        if self._failure is not None:  # failed between the check and the line above: fail() missed this stream
            self._streams.pop(request_id)
            raise EngineDead(self._failure)
        return stream

    def _outputs(self, command: tuple) -> AsyncIterator[RequestOutput]:
        """Sends a request's command; yields its outputs until the last; leaving early aborts it."""
        request_id = command[1]
        stream = self._open(request_id)
        self._send(command)
        return stream.read(request_id, self._streams, self.abort)

    def abort(self, request_id: str) -> None:
        """End a request now; if its stream is still read, its last output says finish_reason "abort"."""
        self._send(("abort", request_id))

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    def _deliver(self, request_id: str, item: RequestOutput | Exception) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _apply_commands(self) -> None:
        while not self._commands.empty():
            kind, request_id, *rest = self._commands.get()
            if kind == "abort":
                if (out := self.engine.abort(request_id)) is not None:
                    self._deliver(request_id, out)
                continue
            try:
                if kind == "snapshot":
                    self._deliver(request_id, self.engine.snapshot(*rest))
                elif kind == "unpin":
                    self._deliver(request_id, self.engine.kv.pins.remove(*rest))
                else:
                    (self.engine.add_probe if kind == "probe" else self.engine.add_request)(request_id, *rest)
            except Exception as e:  # refused at admission: only this request hears of it
                self._deliver(request_id, e)

    def _loop(self) -> None:
        while True:
            self._idle = True
            self._wake.wait()
            self._wake.clear()
            self._heartbeat = time.monotonic()  # before leaving idle: health never sees a stale beat as busy
            self._idle = False
            self._apply_commands()
            while self.engine.has_unfinished():
                for out in self.engine.step():  # a request's own failure comes back as its output's error
                    self._deliver(out.request_id, out)
                self._heartbeat = time.monotonic()
                self._stats = self.engine.stats()
                self._apply_commands()
            self._stats = self.engine.stats()
