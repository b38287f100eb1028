"""asyncio bridge for the server: the step loop runs in a thread; each request gets its own stream."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from zhuzi.config import EngineConfig
from zhuzi.engine.engine import Engine
from zhuzi.outputs import EngineStats, RequestOutput
from zhuzi.sampling_params import SamplingParams

log = logging.getLogger("zhuzi")


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # RequestOutput deltas, or an Exception


class AsyncEngine:
    """Runs the model off the event loop so the server answers while a forward pass runs."""

    engine: Engine  # set by the engine thread before __init__ returns

    def __init__(self, config: EngineConfig):
        """Loads the model in the engine's own thread and returns once it is ready."""
        self._commands: queue.SimpleQueue = queue.SimpleQueue()  # only the loop thread touches the engine
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        loaded: queue.SimpleQueue = queue.SimpleQueue()
        # The thread that first runs torch must live on: once the thread that started OpenMP's
        # first team exits, libgomp makes every later team crawl (measured: 7x slower steps).
        threading.Thread(target=self._run, args=(config, loaded), name="zhuzi-engine", daemon=True).start()
        error = loaded.get()
        if error is not None:
            raise error
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        path = self.engine.model_path
        self.model_name = path.name.split(".")[0] if path.is_file() else path.name
        self._stats = self.engine.stats()

    def _run(self, config: EngineConfig, loaded: queue.SimpleQueue) -> None:
        try:
            self.engine = Engine(config)
        except BaseException as e:  # the caller re-raises it
            loaded.put(e)
            return
        loaded.put(None)
        self._loop()

    def stats(self) -> EngineStats:
        return self._stats

    def check_token_ids(self, ids: list[int], param: str) -> None:
        self.engine.check_token_ids(ids, param)  # reads only the model's shape: safe from any thread

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Yields deltas until the request finishes; closing the iterator aborts the request."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        self._send(("add", request_id, prompt, params, time.monotonic()))
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
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
                self.engine.abort(request_id)
                continue
            try:
                self.engine.add_request(request_id, *rest)
            except Exception as e:  # refused at admission: only this request hears of it
                self._deliver(request_id, e)

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            self._apply_commands()
            while self.engine.has_unfinished():
                try:
                    outputs = self.engine.step()
                except Exception as e:  # a bug must not hang every client: fail the in-flight requests
                    log.exception("engine step failed")
                    for request_id in list(self.engine.requests):
                        self.engine.abort(request_id)
                        self._deliver(request_id, RuntimeError(f"engine error: {e}"))
                    outputs = []
                for out in outputs:
                    self._deliver(out.request_id, out)
                self._stats = self.engine.stats()
                self._apply_commands()
            self._stats = self.engine.stats()
