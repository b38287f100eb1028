"""Ollama's API (/api/chat, /api/generate, /api/embed, /api/tags, /api/show, /api/ps, /api/version), between the
routes and the chat path: a chat or generate request becomes the server's chat request (generate's prompt one
user turn; with raw true the prompt runs as it is, untemplated), and OllamaFormat writes one JSON object or NDJSON
lines. A last assistant message is continued. Ollama's tool calls carry no ids: a tool message answers the call
its tool_call_id names, or else the first unanswered call of its tool_name (Ollama's clients send no id).
"""
from __future__ import annotations

import datetime
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import pydantic
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from zhuzi.outputs import CompletionOutput, Logprob, PromptProgress
from zhuzi.server.common.chat import ChatPath, sampling_params
from zhuzi.server.common.content_parts import new_item_id
from zhuzi.server.common.errors import ApiError
from zhuzi.server.common.formats import Choice, ResponseState
from zhuzi.server.common.parsers import OutputParser, ParsedText
from zhuzi.server.common.request import ChatRequest, Constraint, Message, Tool, ToolCall
from zhuzi.server.common.serving import Server, json_response
from zhuzi.server.models import ServedModel
from zhuzi.server.ollama import protocol as o
from zhuzi.server.openai import answers as r
from zhuzi.server.openai.embeddings import Embeddings
from zhuzi.server.openai.formats import chat_logprobs

NS = 1_000_000_000
NDJSON = "application/x-ndjson"
NEVER = "9999-12-31T23:59:59Z"  # /api/ps's expires_at: the model stays loaded for the server's life

# The chat request's fields under Ollama's names, for the errors the chat path finds (see ApiError.renamed).
CHAT_NAMES = {r"^max_tokens\b": "options.num_predict", r"^repetition_penalty\b": "options.repeat_penalty",
              r"^(temperature|top_p|top_k|min_p|seed|stop|presence_penalty|frequency_penalty)\b": r"options.\1",
              r"^tools\.(\d+)\.parameters": r"tools.\1.function.parameters",
              r"^(chat_template_kwargs|thinking_token_budget)\b.*": "think", r"^logprobs\b": "top_logprobs",
              r"^continue_final_message\b": "messages"}
GENERATE_NAMES = {**CHAT_NAMES, r"^(messages|prompt)\b.*": "prompt"}


def error_response(error: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    """Ollama's error object: the message alone, with the error's status."""
    return JSONResponse(o.OllamaError(error=error.message).model_dump(), status_code=error.status, headers=headers)


def rfc3339(seconds: float | None = None) -> str:
    """A Unix time (default: now) as Ollama writes times, in UTC."""
    moment = datetime.datetime.fromtimestamp(time.time() if seconds is None else seconds, datetime.UTC)
    return moment.isoformat().replace("+00:00", "Z")


def line(answer: pydantic.BaseModel) -> str:
    """One NDJSON line."""
    return answer.model_dump_json() + "\n"


def model_names(served: str) -> tuple[str, ...]:
    """The names a request may give the model: Ollama's untagged name means its :latest."""
    return (served,) if ":" in served else (served, f"{served}:latest")


# ---------------------------------------------------------------- the request, as a chat request

def _answered(calls: list[ToolCall], answered: set[str | None], name: str | None) -> str | None:
    """The id of the call a tool message without one answers: the first unanswered call of its function (of any,
    if it names none), else the last call of it (a result sent again); None if no earlier call is of it."""
    candidates = [call.id for call in calls if name is None or call.name == name]
    return next((call_id for call_id in candidates if call_id not in answered), candidates[-1] if candidates else None)


def chat_messages(messages: list[o.Message]) -> list[Message]:
    out: list[Message] = []
    calls: list[ToolCall] = []
    answered: set[str | None] = set()
    for n, message in enumerate(messages):
        chat = Message(message.role, message.content or "", reasoning=message.thinking or None)
        if message.role == "assistant" and message.tool_calls:
            chat.content = message.content or None
            chat.tool_calls = [ToolCall(c.function.name, json.dumps(c.function.arguments), c.id or f"call_{n}_{i}",
                                        f"messages.{n}.tool_calls.{i}.function")
                               for i, c in enumerate(message.tool_calls)]
            calls += chat.tool_calls
        if message.role == "tool":
            field = "tool_call_id" if message.tool_call_id else "tool_name" if message.tool_name else None
            chat.tool_call_id = message.tool_call_id or _answered(calls, answered, message.tool_name)
            chat.name, chat.source = message.tool_name, f"messages.{n}" + (f".{field}" if field else "")
            answered.add(chat.tool_call_id)
        out.append(chat)
    return out


def _format(fmt: o.Format | None) -> Constraint | None:
    if not fmt:
        return None
    if fmt == "json":
        return Constraint.build("format", {}, json_object=True)
    return Constraint.build("format", {"json": "format"}, json=fmt)


def _options(options: o.Options | None, max_model_len: int) -> dict[str, Any]:
    if options is None:
        return {}
    if options.num_ctx is not None and options.num_ctx > max_model_len:
        raise ApiError(400, f"options.num_ctx {options.num_ctx} is more than this server's context of "
                       f"{max_model_len} tokens (zhuzi serve --max-model-len)", param="options.num_ctx")
    predict = options.num_predict
    fields = {"temperature": options.temperature, "top_k": options.top_k, "top_p": options.top_p,
              "min_p": options.min_p, "seed": options.seed, "stop": options.stop,
              "presence_penalty": options.presence_penalty, "frequency_penalty": options.frequency_penalty,
              "repetition_penalty": options.repeat_penalty, "max_tokens": None if predict in (-1, -2) else predict}
    return {name: value for name, value in fields.items() if value is not None}


def _logprobs(body: o.GenerationRequest) -> dict[str, Any]:
    if not body.logprobs:
        if body.top_logprobs:
            raise ApiError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        return {}
    return {"logprobs": body.top_logprobs or 0}


class OllamaFormat:
    """Ollama's answer to /api/chat (a message) or /api/generate (a response), whole or as NDJSON lines."""

    def __init__(self, model: str, chat: bool, top_logprobs: int | None, token_bytes: Any,
                 load_time: float = 0.0) -> None:
        self.request_id = new_item_id("ollama")
        self.model, self.chat, self.top_logprobs, self.token_bytes = model, chat, top_logprobs, token_bytes
        self.started = time.monotonic() - load_time  # the model's load, when the request waited for it, counts
        self.calls = 0  # tool calls written so far

    def _call(self, call_id: str, name: str, arguments: str) -> o.ToolCallOut:
        value = json.loads(arguments or "{}")  # a call is kept only once its arguments are whole JSON
        self.calls += 1
        return o.ToolCallOut(id=call_id, function=o.FunctionOut(
            index=self.calls - 1, name=name, arguments=value if isinstance(value, dict) else {}))

    def _logprobs(self, token_ids: list[int], entries: list[dict[int, Logprob]] | None) -> list[r.TokenLogprob] | None:
        if self.top_logprobs is None or not token_ids:
            return None
        return chat_logprobs(token_ids, entries or [], self.top_logprobs, self.token_bytes).content

    def _answer(self, text: str, thinking: str, calls: list[o.ToolCallOut], done: bool,
                **fields: Any) -> o.Answer:
        common = {"model": self.model, "created_at": rfc3339(), "done": done, **fields}
        if self.chat:
            return o.ChatResponse(message=o.MessageOut(content=text, thinking=thinking or None,
                                                       tool_calls=calls or None), **common)
        return o.GenerateResponse(response=text, thinking=thinking or None, **common)

    def _timings(self, gen: ResponseState) -> dict[str, Any]:
        """The last answer's: done_reason, and the counts and durations (nanoseconds) of the engine's timings
        (load_duration: what is not the prompt's or the reply's, the model's load included)."""
        choice = gen.choices.get(0)
        reason = choice.finish_reason if choice else None
        metrics = gen.prompts[0].metrics
        prompt_s = (metrics.prefill_time or 0.0) if metrics else 0.0
        eval_s = (metrics.decode_time or 0.0) if metrics else 0.0
        total = int((time.monotonic() - self.started) * NS)
        return {"done_reason": reason, "total_duration": total,
                "load_duration": max(0, total - int(prompt_s * NS) - int(eval_s * NS)),
                "prompt_eval_count": gen.prompt_tokens, "prompt_eval_duration": int(prompt_s * NS),
                "eval_count": gen.completion_tokens, "eval_duration": int(eval_s * NS)}

    def progress(self, progress: PromptProgress) -> list[str]:
        return []  # the API has no progress lines

    def events(self, gen: ResponseState, choice: Choice, delta: CompletionOutput, piece: ParsedText,
               prompt_index: int) -> list[str]:
        calls = [self._call(e.part.call_id or "", e.part.name or "", e.part.text) for e in choice.events
                 if e.kind == "stop" and e.part.kind == "tool_use" and not e.part.dropped]
        logprobs = self._logprobs(delta.token_ids, delta.logprobs)
        if not (piece.content or piece.reasoning_content or calls or logprobs):
            return []
        return [line(self._answer(piece.content, piece.reasoning_content, calls, False, logprobs=logprobs))]

    def end(self, gen: ResponseState) -> list[str]:
        return [line(self._answer("", "", [], True, **self._timings(gen)))]

    def failure(self, gen: ResponseState, error: ApiError) -> list[str]:
        return [line(o.OllamaError(error=error.message))]

    def response(self, gen: ResponseState) -> o.Answer:
        choice = gen.choices.get(0)
        parsed = choice.parsed if choice else ParsedText()
        calls = [self._call(c.id or "", c.name or "", c.arguments) for c in parsed.tool_calls]
        logprobs = self._logprobs(choice.token_ids, choice.logprobs) if choice else None
        return self._answer(parsed.content, parsed.reasoning_content, calls, True, logprobs=logprobs,
                            **self._timings(gen))


class Ollama:
    def __init__(self, chats: ChatPath, embeddings: Embeddings) -> None:
        self.chats, self.embeddings = chats, embeddings
        self.server: Server = chats.server

    def _model(self, name: str) -> str:
        """The served model's name for the one a request gives (:latest or not); 404 for another."""
        if name in model_names(self.server.model_name):
            return self.server.model_name
        self.server.check_model(name)
        return name

    def _think(self, think: o.Think | None) -> dict[str, Any] | None:
        """The chat template's switch for a thought (a level is the reasoning effort of a harmony model)."""
        if isinstance(think, str):
            if not self.server.harmony:
                raise ApiError(400, f"think: levels ({think!r}) are gpt-oss's; {self.server.model_name!r} takes "
                               "true or false", param="think")
            return None
        if think and not self.server.reasoning:
            raise ApiError(400, f"think: {self.server.model_name!r} does not support thinking", param="think")
        return None if think is None else {"enable_thinking": think}

    def _sampling(self, body: o.GenerationRequest) -> dict[str, Any]:
        """The sampling fields chat and generate share: options and logprobs."""
        return {**_options(body.options, self.server.ready().max_model_len), **_logprobs(body)}

    def _request(self, body: o.GenerationRequest, messages: list[Message], names: dict[str, str],
                 **fields: Any) -> ChatRequest:
        return ChatRequest(messages, model=self._model(body.model), constraint=_format(body.format),
                           sampling=self._sampling(body), chat_template_kwargs=self._think(body.think),
                           reasoning_effort=body.think if isinstance(body.think, str) else None,
                           stream=body.stream, names=names, **fields)

    def _fmt(self, body: o.GenerationRequest, chat: bool) -> OllamaFormat:
        return OllamaFormat(body.model, chat, body.top_logprobs or 0 if body.logprobs else None,
                            self.server.ready().tokenizer.bytes_of, self.server.load_time())

    def _loaded(self, body: o.GenerationRequest, chat: bool) -> Response:
        """An empty request is Ollama's way to load a model: it is loaded; with keep_alive 0, to unload it: a
        server of many models unloads it (and never loads it for this)."""
        if body.unloads and self.server.models is not None:
            self.server.models.unload(body.model)
            reason = "unload"
        else:
            self._model(body.model)
            reason = "load"
        return json_response(OllamaFormat(body.model, chat, None, None)._answer("", "", [], True, done_reason=reason))

    async def chat(self, request: Request, key: str, body: o.ChatRequest) -> Response:
        if body.empty:
            return self._loaded(body, chat=True)
        continued = body.messages[-1].role == "assistant"  # as Ollama: the reply continues it
        tools = [Tool(t.function.name, t.function.description, t.function.parameters) for t in body.tools or []]
        chat = self._request(body, chat_messages(body.messages), CHAT_NAMES, tools=tools,
                             add_generation_prompt=not continued, continue_final_message=continued)
        return await self._run_chat(request, key, chat, self._fmt(body, chat=True))

    async def generate(self, request: Request, key: str, body: o.GenerateRequest) -> Response:
        if body.empty:
            return self._loaded(body, chat=False)
        if body.raw:
            return await self._raw(request, key, body)
        system = [Message("system", body.system)] if body.system else []
        chat = self._request(body, [*system, Message("user", body.prompt or "")], GENERATE_NAMES)
        return await self._run_chat(request, key, chat, self._fmt(body, chat=False))

    async def _run_chat(self, request: Request, key: str, chat: ChatRequest, fmt: OllamaFormat) -> Response:
        plan = await self.chats.plan(chat)
        return ndjson(await self.chats.run(request, key, chat, plan, fmt))

    async def _raw(self, request: Request, key: str, body: o.GenerateRequest) -> Response:
        """The prompt as it is, as /v1/completions runs it (no template, so no thought and no system)."""
        if body.system or body.think:
            wrong = "system" if body.system else "think"
            raise ApiError(400, f"{wrong} needs the chat template, which raw true skips", param=wrong)
        fmt = self._fmt(body, chat=False)
        try:
            self._model(body.model)
            constraint = _format(body.format)
            params = sampling_params({"max_tokens": None, **self._sampling(body)}, constraint)
            await self.server.check_constraints([constraint] if constraint else [])
        except ApiError as exc:
            raise exc.renamed(GENERATE_NAMES) from exc
        tokenizer = self.server.ready().tokenizer
        ids = await self.server.in_worker(tokenizer.encode_prompt, body.prompt)

        def new_parser() -> OutputParser:
            return OutputParser(reasoning=False, tools=False)

        return ndjson(await self.server.generate(request, key, [ids], params, fmt, new_parser, body.stream))

    # -- the model

    def _path(self) -> Path:
        return self.server.ready().config.model_path

    async def _entry(self) -> tuple[o.ModelEntry, Any]:
        """The request's model as /api/tags lists it, and the engine's snapshot it was read from."""
        engine = self.server.ready()
        snapshot = await engine.snapshot(0)
        return model_entry(self.server.model_name, (self._path(),), engine.config.quantization, snapshot), snapshot

    @staticmethod
    async def _running(served: ServedModel, paths: tuple[Path, ...], expires_at: str) -> o.RunningModel:
        """A loaded model as /api/ps lists it."""
        snapshot = await served.engine.snapshot(0)
        config = served.engine.config
        entry = model_entry(served.name, paths, config.quantization, snapshot)
        return o.RunningModel(**entry.model_dump(), expires_at=expires_at,
                              size_vram=entry.size if config.device != "cpu" else 0,
                              context_length=snapshot.max_model_len)

    async def embed(self, request: Request, key: str, body: o.EmbedRequest) -> Response:
        load_time = self.server.load_time()
        start = time.monotonic() - load_time
        model = self._model(body.model)
        inputs: list[str | list[int]] = [body.input] if isinstance(body.input, str) else list(body.input)
        vectors, tokens = await self.embeddings.embed(request, key, inputs, "input", body.dimensions, body.truncate)
        return json_response(o.EmbedResponse(model=model, embeddings=[v.tolist() for v in vectors],
                                             total_duration=int((time.monotonic() - start) * NS),
                                             load_duration=int(load_time * NS), prompt_eval_count=tokens))

    async def embeddings_legacy(self, request: Request, key: str, body: o.EmbeddingsRequest) -> Response:
        self._model(body.model)
        (vector,), _ = await self.embeddings.embed(request, key, [body.prompt], "prompt")
        return json_response(o.EmbeddingsResponse(embedding=vector.tolist()))

    async def tags(self) -> Response:
        if (models := self.server.models) is not None:  # all of them, loaded or not
            return json_response(o.TagsResponse(models=[
                model_entry(m.spec.id, m.spec.paths, m.served.engine.config.quantization if m.served else None,
                            await m.served.engine.snapshot(0) if m.served else None)
                for m in models.models.values()]))
        entry, _ = await self._entry()
        return json_response(o.TagsResponse(models=[entry]))

    async def ps(self) -> Response:
        if (models := self.server.models) is not None:  # the loaded ones, each until its keep-alive ends
            now = models.clock()
            return json_response(o.PsResponse(models=[
                await self._running(m.served, m.spec.paths, NEVER if (at := m.expires_at()) is None
                                    else rfc3339(time.time() + at - now))
                for m in models.models.values() if m.served is not None]))
        self.server.ready()
        assert self.server.default is not None
        return json_response(o.PsResponse(models=[await self._running(self.server.default, (self._path(),), NEVER)]))

    async def show(self, body: o.ShowRequest) -> Response:
        if body.model not in model_names(self.server.model_name):
            raise ApiError(404, f"model {body.model!r} not found; this server serves {self.server.model_name!r}",
                           param="model")
        entry, snapshot = await self._entry()
        m, arch = snapshot.model, snapshot.model.architecture
        info = {"general.architecture": arch, "general.parameter_count": m.num_parameters,
                f"{arch}.context_length": snapshot.max_model_len, f"{arch}.embedding_length": m.hidden_size,
                f"{arch}.feed_forward_length": m.intermediate_size, f"{arch}.block_count": m.num_layers,
                f"{arch}.attention.head_count": m.num_heads, f"{arch}.attention.head_count_kv": m.num_kv_heads,
                f"{arch}.attention.key_length": m.head_dim, f"{arch}.rope.freq_base": m.rope_theta,
                f"{arch}.vocab_size": m.vocab_size}
        template = self.server.ready().tokenizer.hf.chat_template
        capabilities = ["completion", "tools"] + (["thinking"] if self.server.reasoning else [])
        return json_response(o.ShowResponse(
            modelfile=f"# zhuzi serves this model as {self.server.model_name!r}\nFROM {self._path()}\n",
            parameters="", template=template if isinstance(template, str) else "", details=entry.details,
            model_info=info, capabilities=capabilities, modified_at=entry.modified_at))


def model_entry(name: str, paths: tuple[Path, ...], quantization: str | None, snapshot: Any) -> o.ModelEntry:
    """A model as /api/tags lists it: its files (a GGUF file, a split's parts, or a directory's files), and what
    its engine's snapshot says of it once loaded."""
    files = [f for path in paths for f in ([path] if path.is_file() else path.iterdir()) if f.is_file()]
    size = sum(f.stat().st_size for f in files)
    stamp = max(f.stat().st_mtime for f in files)
    path = paths[0]
    gguf = path.is_file()
    quantization = quantization or ("gguf" if gguf else "none")
    family, parameters, level = "", "", quantization
    if snapshot is not None:
        m = snapshot.model
        family, parameters = m.architecture, f"{m.num_parameters / 1e6:.1f}M"
        level = snapshot.dtype if quantization == "none" else quantization
    details = o.ModelDetails(format="gguf" if gguf else "safetensors", family=family,
                             families=[family] if family else [], parameter_size=parameters, quantization_level=level)
    tagged = model_names(name)[-1]
    digest = hashlib.sha256(f"{path.resolve()}:{size}:{stamp}".encode()).hexdigest()
    return o.ModelEntry(name=tagged, model=tagged, modified_at=rfc3339(stamp), size=size, digest=digest,
                        details=details)


def ndjson(response: Response) -> Response:
    """A stream's lines as NDJSON (Server.generate labels a stream as SSE)."""
    if response.media_type == "text/event-stream":
        response.headers["content-type"] = NDJSON
    return response

