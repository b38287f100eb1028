"""Ollama's wire format in pydantic: the requests, the answers (whole, or one NDJSON line) and the error object.
Strict as everywhere; Ollama's fields that zhuzi cannot honour are Refused (a value other than "off" is a 400
naming the field and why). Also the OpenAPI spec's schemas for those routes.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field

from zhuzi.sampling_params import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY
from zhuzi.server.common.schema import KeepAlive, Request, Response, Text, _is_none
from zhuzi.server.models import seconds
from zhuzi.server.openai.answers import TokenLogprob


def refused(why: str, *off: Any) -> Any:
    """A field zhuzi cannot honour: null, or the values in off (those that ask for nothing), pass."""
    def check(value: Any) -> Any:
        if value is not None and value not in off:
            raise ValueError(why)
        return value

    return Annotated[Any, AfterValidator(check)]


LOAD_TIME = "is a load-time option of Ollama's runner: zhuzi loads its model once, with zhuzi serve's flags"


# ---------------------------------------------------------------- requests

class Options(Request):
    """Ollama's options: the sampling ones map to zhuzi's (see serving.py); unset ones keep zhuzi's defaults."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    num_predict: int | None = None  # -1 (Ollama's default) and -2: up to the context window
    stop: Text | list[Text] | None = None
    # over the whole prompt and reply, as repeat_last_n -1 asks
    repeat_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    repeat_last_n: refused("is -1 (the whole context) in zhuzi: its repeat_penalty sees every token", -1) = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    num_ctx: int | None = Field(None, ge=1)  # the context the request needs: refused above the server's
    num_keep: refused("is not supported: zhuzi never shifts the context, it stops at its end") = None
    typical_p: refused("is not supported: zhuzi has no typical sampling", 1.0) = None
    tfs_z: refused("is not supported: zhuzi has no tail-free sampling", 1.0) = None
    mirostat: refused("is not supported: zhuzi has no mirostat sampling", 0) = None
    mirostat_tau: refused("is not supported: zhuzi has no mirostat sampling") = None
    mirostat_eta: refused("is not supported: zhuzi has no mirostat sampling") = None
    penalize_newline: refused("is not supported (Ollama dropped it too)") = None
    numa: refused(LOAD_TIME) = None
    num_batch: refused(LOAD_TIME) = None
    num_gpu: refused(LOAD_TIME) = None
    main_gpu: refused(LOAD_TIME) = None
    low_vram: refused(LOAD_TIME) = None
    f16_kv: refused(LOAD_TIME) = None
    logits_all: refused(LOAD_TIME) = None
    vocab_only: refused(LOAD_TIME) = None
    use_mmap: refused(LOAD_TIME) = None
    use_mlock: refused(LOAD_TIME) = None
    embedding_only: refused(LOAD_TIME) = None
    num_thread: refused(LOAD_TIME) = None


Format = Literal["", "json"] | dict[str, Any]  # "json": any JSON object; a dict: a JSON schema
Think = bool | Literal["low", "medium", "high"]


class ToolCallFunction(Request):
    index: int | None = None
    name: str = Field(min_length=1)
    arguments: dict[str, Any] = {}


class ToolCall(Request):
    id: str | None = None
    type: Literal["function"] | None = None
    function: ToolCallFunction


class Message(Request):
    role: Literal["system", "user", "assistant", "tool"]
    content: Text | None = None
    thinking: Text | None = None  # an assistant's thought, sent back
    images: refused("are not supported: zhuzi's models read text only", []) = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None  # a tool message: the function whose result it is
    tool_call_id: str | None = None  # a tool message: the call it answers (else the first open call of its name)


class ToolFunction(Request):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(Request):
    type: Literal["function"] = "function"
    function: ToolFunction


class GenerationRequest(Request):
    """What /api/chat and /api/generate share."""

    model: str = Field(min_length=1)
    stream: bool = True
    format: Format | None = None
    options: Options | None = None
    keep_alive: KeepAlive | None = None  # how long a server of many models keeps the model loaded after
    think: Think | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @property
    def empty(self) -> bool:
        """Nothing to answer: Ollama's way to load the model (done_reason "load")."""
        raise NotImplementedError

    @property
    def unloads(self) -> bool:
        """Empty, with keep_alive 0: Ollama's way to unload the model (done_reason "unload"), never loading it."""
        return self.empty and seconds(self.keep_alive) == 0


class ChatRequest(GenerationRequest):
    messages: list[Message] = []
    tools: list[Tool] | None = None

    @property
    def empty(self) -> bool:
        return not self.messages


class GenerateRequest(GenerationRequest):
    prompt: Text | None = None
    system: Text | None = None
    raw: bool = False  # true: the prompt as it is, without the chat template
    suffix: refused("is not supported: zhuzi does not fill in the middle", "") = None
    template: refused("is not supported: zhuzi renders the model's own chat template (raw true skips it)", "") = None
    context: refused("(Ollama's deprecated token history) is not supported: send the history to /api/chat") = None
    images: refused("are not supported: zhuzi's models read text only", []) = None
    width: refused("is for image generation, which zhuzi does not do") = None
    height: refused("is for image generation, which zhuzi does not do") = None
    steps: refused("is for image generation, which zhuzi does not do") = None

    @property
    def empty(self) -> bool:
        return not self.prompt and not self.system


NO_OPTIONS = "has nothing to set for an embedding: sampling options do not apply, load-time ones are zhuzi serve's"


class EmbedRequest(Request):
    model: str = Field(min_length=1)
    input: Text | list[Text]
    truncate: bool = True  # an input longer than the context window is cut to fit (false: refused)
    dimensions: int | None = Field(None, ge=1)  # served only as the model's own width, as on /v1/embeddings
    keep_alive: KeepAlive | None = None  # how long a server of many models keeps the model loaded after
    options: refused(NO_OPTIONS, {}) = None


class EmbeddingsRequest(Request):
    """The deprecated /api/embeddings: one prompt."""

    model: str = Field(min_length=1)
    prompt: Text
    keep_alive: KeepAlive | None = None
    options: refused(NO_OPTIONS, {}) = None


class ShowRequest(Request):
    model: str = Field(min_length=1)
    verbose: refused("(the tokenizer's arrays in model_info) is not supported", False) = None


# ---------------------------------------------------------------- answers

class FunctionOut(Response):
    index: int
    name: str
    arguments: dict[str, Any]


class ToolCallOut(Response):
    id: str
    function: FunctionOut


class MessageOut(Response):
    role: Literal["assistant"] = "assistant"
    content: str
    thinking: str | None = Field(None, exclude_if=_is_none)
    tool_calls: list[ToolCallOut] | None = Field(None, exclude_if=_is_none)


class Answer(Response):
    """One NDJSON line of a stream (done false, then the last with done true and the timings), or the whole
    answer. Durations are in nanoseconds (see docs/serving.md for what each measures)."""

    model: str
    created_at: str  # RFC 3339, UTC
    done: bool
    done_reason: Literal["stop", "length", "load", "unload", "abort", "error"] | None = Field(None, exclude_if=_is_none)
    total_duration: int | None = Field(None, exclude_if=_is_none)
    load_duration: int | None = Field(None, exclude_if=_is_none)
    prompt_eval_count: int | None = Field(None, exclude_if=_is_none)
    prompt_eval_duration: int | None = Field(None, exclude_if=_is_none)
    eval_count: int | None = Field(None, exclude_if=_is_none)
    eval_duration: int | None = Field(None, exclude_if=_is_none)
    logprobs: list[TokenLogprob] | None = Field(None, exclude_if=_is_none)


class ChatResponse(Answer):
    message: MessageOut


class GenerateResponse(Answer):
    response: str
    thinking: str | None = Field(None, exclude_if=_is_none)


class ModelDetails(Response):
    parent_model: str = ""
    format: Literal["gguf", "safetensors"]
    family: str
    families: list[str]
    parameter_size: str  # "134.5M"
    quantization_level: str  # zhuzi's precision: "q4_1", "bfloat16", ...


class ModelEntry(Response):
    name: str
    model: str
    modified_at: str
    size: int  # bytes of the checkpoint on disk
    digest: str
    details: ModelDetails


class TagsResponse(Response):
    models: list[ModelEntry]


class RunningModel(ModelEntry):
    expires_at: str  # never, in effect: the model stays loaded for the server's life
    size_vram: int  # bytes of the checkpoint on an accelerator (0 on the CPU)
    context_length: int


class PsResponse(Response):
    models: list[RunningModel]


class ShowResponse(Response):
    modelfile: str
    parameters: str
    template: str  # the model's chat template (Jinja, not Ollama's Go templates)
    details: ModelDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class EmbedResponse(Response):
    model: str
    embeddings: list[list[float]]
    total_duration: int  # nanoseconds, as the other answers' durations
    load_duration: int = 0  # the model's load, when the request waited for it
    prompt_eval_count: int


class EmbeddingsResponse(Response):
    embedding: list[float]


class VersionResponse(Response):
    version: str


class OllamaError(Response):
    error: str
