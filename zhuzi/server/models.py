"""The set of models one server serves (ModelSet), between the routes and the engines: which models there are (a
source: id -> what to load), which are loaded, each in engine cores of its own behind the EngineClient the server
uses. A request names its model; the set loads it once (concurrent requests wait for that one load), keeps it for
its keep-alive after its last request, unloads it on demand, evicts the least recently used idle one when a model
to load does not fit the memory bound, and restarts one whose engine died on its next request.
"""
from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from zhuzi.engine.front.client import EngineClient
from zhuzi.server.common.errors import ApiError
from zhuzi.server.common.gateway import GatewayError
from zhuzi.server.common.reasoning import thought_tags
from zhuzi.server.common.schema import DURATION
from zhuzi.server.common.tool_formats import Hermes, ToolFormat, tool_format
from zhuzi.tokenizer import THOUGHT_TAGS

log = logging.getLogger("zhuzi.server")
RETRY_AFTER_S = 5.0  # what a request that found no room is told to wait


@dataclass(frozen=True)
class ModelSpec:
    """What to load for a model id: its files (a GGUF file, a split GGUF's parts in order, or a Hugging Face
    directory), and the bytes it holds once loaded (its weights and its KV pool), which --models-memory counts."""

    id: str
    paths: tuple[Path, ...]
    size: int

    @property
    def path(self) -> Path:
        """What the loader opens: the file, a split's first part, or the directory."""
        return self.paths[0]


@dataclass
class ServedModel:
    """A loaded model as the server reads it: its engine, and what its tokenizer says of its replies."""

    name: str
    engine: EngineClient
    harmony: bool  # the model speaks gpt-oss's harmony format (harmony.py renders, harmony_parser.py parses)
    reasoning: bool
    think_close: int | None  # the id that ends a thought: its close tag, harmony's <|end|>
    thought_tags: tuple[str, str]  # its tags (<think>, or its own)
    added_tokens: dict[str, int]  # the tokenizer's added tokens (a forced call's markers may be)
    tool_format: type[ToolFormat]  # how the model writes calls (a harmony model: harmony_parser)
    template: str  # the chat template's text

    @property
    def formats(self) -> str:
        """How the model writes its calls and thoughts, as the log says it."""
        if self.harmony:
            return "harmony format"
        return f"tool calls in {self.tool_format.name}'s format" + (", reasoning parser on" if self.reasoning else "")

    @classmethod
    def ready(cls, name: str, engine: EngineClient, tool_call_parser: str | None = None,
              reasoning_parser: str | None = None) -> ServedModel:
        """The model readied to serve, in the loading thread: its formats (ValueError where a parser does not fit
        it), its tokenizer's table of token strings and its helper process for long texts."""
        tokenizer = engine.tokenizer
        template = tokenizer.hf.chat_template if isinstance(tokenizer.hf.chat_template, str) else ""
        tags, ids, harmony = thought_tags(reasoning_parser, tokenizer), tokenizer.think_ids, tokenizer.harmony
        served = cls(name, engine, harmony, tags is not None or harmony,
                     tokenizer.special_id("<|end|>") if harmony else ids[1] if tags and ids else None,
                     tags or THOUGHT_TAGS[0], dict(tokenizer.hf.get_added_vocab()),
                     tool_format(tool_call_parser, template, harmony) or Hermes, template)
        tokenizer.warm()
        tokenizer.use_encoder_process()
        return served


# Starts a model's engine and readies it to serve (ServedModel.ready); blocking: the set calls it in a thread.
Starter = Callable[[ModelSpec], ServedModel]


@dataclass(eq=False)
class Model:
    """One model of the set and where it stands."""

    spec: ModelSpec
    keep_alive: float | None  # seconds it stays loaded after its last request; None: for ever
    served: ServedModel | None = None
    loading: asyncio.Future[ServedModel] | None = None
    error: str | None = None  # why its last load failed
    users: int = 0  # requests that hold it now
    last_used: float = 0.0

    @property
    def state(self) -> Literal["loaded", "loading", "unloaded"]:
        return "loaded" if self.served else "loading" if self.loading else "unloaded"

    def expires_at(self) -> float | None:
        """When it unloads if no request comes (the clock's time); None: never, or not loaded."""
        if self.served is None or self.keep_alive is None or self.users:
            return None
        return self.last_used + self.keep_alive


@dataclass
class ModelSet:
    source: dict[str, ModelSpec]
    start: Starter
    keep_alive: float | None = 300.0  # a model's keep-alive unless its requests say otherwise
    memory: int | None = None  # bytes all loaded models may hold together; None: no bound
    clock: Callable[[], float] = time.monotonic
    models: dict[str, Model] = field(init=False)

    def __post_init__(self) -> None:
        self.models = {spec.id: Model(spec, self.keep_alive) for spec in self.source.values()}

    def find(self, name: str) -> Model:
        """The model a request names (Ollama's name:latest is its untagged name); 404 if there is none."""
        model = self.models.get(name) or self.models.get(name.removesuffix(":latest")) \
            or self.models.get(f"{name}:latest")
        if model is None:
            raise ApiError(404, f'model "{name}" not found; GET /v1/models lists the models this server has',
                           param="model", code="model_not_found")
        return model

    async def acquire(self, name: str, keep_alive: float | None | Literal["default"] = "default") -> Model:
        """The model, loaded (the first request starts its load, the others wait for that one), held until
        release(). keep_alive: the request's (None: for ever), else the set's, as Ollama's: the latest request's
        counts."""
        model = self.find(name)
        while model.served is None or model.served.engine.health(0) is not None:
            if model.served is not None:  # its engine died: its requests have failed; a new one serves this
                log.warning("model %s: its engine died (%s); restarting it", model.spec.id,
                            model.served.engine.health(0))
                self._stop(model)
            if model.loading is None:
                self._load(model)
            assert model.loading is not None
            await asyncio.shield(model.loading)
        model.users += 1
        model.keep_alive = self.keep_alive if keep_alive == "default" else keep_alive
        return model

    def release(self, model: Model) -> None:
        """A request is done with the model: its keep-alive counts from now (0: it unloads now)."""
        model.users -= 1
        model.last_used = self.clock()
        if model.keep_alive == 0 and not model.users and model.served is not None:
            self._stop(model)

    def unload(self, name: str) -> bool:
        """Unload the model now, or as its last running request ends; False if it was not loaded."""
        model = self.find(name)
        if model.served is None:
            return False
        model.keep_alive = 0
        if not model.users:
            self._stop(model)
        return True

    def expire(self) -> None:
        """Unload each model whose keep-alive has passed."""
        now = self.clock()
        for model in self.models.values():
            if (at := model.expires_at()) is not None and at <= now:
                log.info("model %s: keep-alive passed, unloading it", model.spec.id)
                self._stop(model)

    def loaded(self) -> list[ServedModel]:
        return [m.served for m in self.models.values() if m.served is not None]

    def close(self) -> None:
        for model in self.models.values():
            if model.served is not None:
                model.served.engine.close()
                model.served = None

    # -- loading and stopping

    def _load(self, model: Model) -> None:
        self._make_room(model)
        loop = asyncio.get_running_loop()
        model.loading = loop.create_future()
        model.error = None
        log.info("model %s: loading %s", model.spec.id, model.spec.path)

        def load() -> None:
            started = time.monotonic()
            try:
                served = self.start(model.spec)
            except BaseException as exc:
                log.error("model %s failed to load: %s", model.spec.id, exc,
                          exc_info=None if isinstance(exc, (ValueError, OSError)) else exc)
                loop.call_soon_threadsafe(self._loaded, model, None, f"{exc}")
                return
            log.info("model %s loaded in %.3f s: %s", model.spec.id, time.monotonic() - started, served.formats)
            loop.call_soon_threadsafe(self._loaded, model, served, None)

        threading.Thread(target=load, name=f"zhuzi-load-{model.spec.id}", daemon=True).start()

    def _loaded(self, model: Model, served: ServedModel | None, error: str | None) -> None:
        future, model.loading = model.loading, None
        assert future is not None
        model.served, model.error, model.last_used = served, error, self.clock()
        if served is None:
            future.set_exception(ApiError(500, f"the model {model.spec.id!r} failed to load: {error}",
                                          "server_error", param="model", code="model_load_failed"))
            future.exception()  # the waiters read it; nobody must, when none waits
        else:
            future.set_result(served)

    def _make_room(self, model: Model) -> None:
        """Unload idle models, least recently used first, until model fits the memory bound."""
        if self.memory is None:
            return
        if model.spec.size > self.memory:
            model.error = f"it needs {model.spec.size} bytes; --models-memory is {self.memory}"
            raise ApiError(507, f"the model {model.spec.id!r} cannot load: {model.error}", "server_error",
                           param="model", code="model_too_large")
        held = [m for m in self.models.values() if m.served is not None or m.loading is not None]
        idle = sorted((m for m in held if m.served is not None and not m.users), key=lambda m: m.last_used)
        free = self.memory - sum(m.spec.size for m in held)
        while free < model.spec.size and idle:
            victim = idle.pop(0)
            log.info("model %s: unloading it to make room for %s", victim.spec.id, model.spec.id)
            self._stop(victim)
            free += victim.spec.size
        if free < model.spec.size:
            raise GatewayError(503, f"no room to load {model.spec.id!r}: the loaded models are all running "
                               "requests; retry later", "service_unavailable", "model_memory_full", RETRY_AFTER_S)

    @staticmethod
    def _stop(model: Model) -> None:
        """Stop the model's engine (in a thread: its cores take a moment to exit) and its tokenizer's helper."""
        served, model.served = model.served, None
        if served is None:
            return
        if (encoder := served.engine.tokenizer.encoder) is not None:
            encoder.hang_up()
        threading.Thread(target=served.engine.close, name=f"zhuzi-stop-{model.spec.id}", daemon=True).start()


def seconds(duration: str | float | int | None) -> float | None | Literal["default"]:
    """A keep-alive as Ollama's requests give it (a Go duration "5m", "1h30m" or seconds) in seconds: None for
    ever (a negative one), "default" when the request gives none."""
    if duration is None:
        return "default"
    if isinstance(duration, str):
        if not re.match(DURATION, duration):
            raise ValueError(f"{duration!r} is not a duration (30s, 5m, 1h; negative: for ever)")
        units = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "": 1.0}
        sign = -1.0 if duration.startswith("-") else 1.0
        duration = sign * sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h|)",
                                                                           duration.lstrip("-")))
    return None if duration < 0 else float(duration)
