"""OpenAI's wire format (and vLLM's extensions): the requests in pydantic, strict as OpenAI's schema is (a field
no model declares is a 400 naming it; UNSUPPORTED says why for OpenAI's and vLLM's fields that zhuzi does not
implement), and what a chat body means as the server's chat request (common/request.py). Also the OpenAPI
spec's request schemas; the answers are in answers.py.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, ValidationInfo, field_validator, model_validator

from zhuzi.sampling_params import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY, InvalidRequest
from zhuzi.server.common.request import ChatRequest, Constraint, Message, NamedTool, Tool, ToolCall
from zhuzi.server.common.schema import KeepAlive, Request, Text

# Fields of OpenAI's or vLLM's requests that zhuzi refuses, and why (any other unknown field is refused too).
UNSUPPORTED = {
    "functions": "is deprecated by OpenAI and not supported: use tools",
    "function_call": "is deprecated by OpenAI and not supported: use tool_choice",
    "audio": "is not supported: zhuzi writes text only",
    "prediction": "(predicted outputs) is not supported",
    "store": "is not supported: zhuzi stores no completions",
    "metadata": "is not supported: zhuzi stores no completions",
    "web_search_options": "is not supported: zhuzi has no web search",
    "suffix": "is not supported: zhuzi does not fill in the middle",
    "best_of": "is not supported: use n",
    "use_beam_search": "is not supported: zhuzi does not search beams",
    "guided_decoding_backend": "is not supported: zhuzi's one grammar backend is llguidance",
    "structural_tag": "is not supported: use tools with tool_choice, or a grammar",
}


# The chat request's names for its fields, as OpenAI's (ChatRequest's errors name them so).
NAMES = {r"^tools\.(\d+)\.parameters": r"tools.\1.function.parameters"}
# service_tier -> the scheduler's priority offset (lower is served first, with --scheduling-policy priority).
TIER_PRIORITY = {"auto": 0, "default": 0, "flex": 1, "priority": -1}


def _in_memory(retention: str | None) -> str | None:
    if retention == "24h":
        raise ValueError("24h is not supported: zhuzi's prefix cache lives in memory (in_memory) until evicted")
    return retention


# prompt_cache_retention, as chat and the Responses API take it
CacheRetention = Annotated[Literal["in_memory", "24h"] | None, AfterValidator(_in_memory)]


# ---------------------------------------------------------------- requests

class TextPart(Request):
    type: Literal["text"]
    text: Text


class FunctionCall(Request):
    name: str
    arguments: str = "{}"


class ToolCallIn(Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def chat(self, source: str) -> ToolCall:
        return ToolCall(self.function.name, self.function.arguments, self.id, f"{source}.function")


class ChatMessage(Request):
    """OpenAI's rules per role: only an assistant message that calls tools may go without content, and a
    tool message names the call it answers."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = Field(None, validate_default=True)
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = Field(None, validate_default=True)
    reasoning_content: Text | None = None

    @field_validator("content")
    @classmethod
    def _content_by_role(cls, content: str | list[TextPart] | None, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        if content is None and role not in (None, "assistant"):
            raise ValueError(f"a {role} message needs content: a string or a list of text parts")
        return content

    @field_validator("tool_call_id")
    @classmethod
    def _tool_call_id_by_role(cls, tool_call_id: str | None, info: ValidationInfo) -> str | None:
        if tool_call_id is None and info.data.get("role") == "tool":
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return tool_call_id

    @model_validator(mode="after")
    def _assistant_says_something(self) -> ChatMessage:
        if self.role == "assistant" and self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        return self

    def chat(self, source: str) -> Message:
        """The message as the chat request's; source: its path in the request (messages.N)."""
        content = self.content if not isinstance(self.content, list) else [part.text for part in self.content]
        calls = None if self.tool_calls is None else [
            call.chat(f"{source}.tool_calls.{i}") for i, call in enumerate(self.tool_calls)]
        return Message(self.role, content, self.name, calls, self.tool_call_id, self.reasoning_content,
                       f"{source}.tool_call_id" if self.role == "tool" else None)


class FunctionDef(Request):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # true: its calls always match parameters (held to it by a grammar)

    def chat(self) -> Tool:
        return Tool(self.name, self.description, self.parameters, self.strict)


class ToolDef(Request):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(Request):
    name: str


class NamedToolChoice(Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class StreamOptions(Request):
    include_usage: bool = False
    include_obfuscation: bool = False  # true is refused: zhuzi pads no chunk (its streams are not obfuscated)

    @field_validator("include_obfuscation")
    @classmethod
    def _no_obfuscation(cls, value: bool) -> bool:
        if value:
            raise ValueError("true is not supported: zhuzi does not pad its chunks against size side channels")
        return value


class JsonSchemaFormat(Request):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for the name
    description: str | None = None  # for the reader: zhuzi enforces the schema and tells the model nothing
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # None: any JSON object
    strict: bool | None = None  # true: objects take no properties beyond their schema's


class ResponseFormat(Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and allowed only with it")
        return self


class StructuredOutputsRequest(Request):
    """vLLM's structured_outputs: exactly one of json, regex, choice, grammar, json_object."""

    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class SamplingRequest(Request):
    """Fields that chat and completions share."""

    model: str | None = None
    keep_alive: KeepAlive | None = None  # as Ollama's: how long the model stays loaded after this request
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None  # sample i of n uses seed + i
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    user: str | None = None  # logged with the request, for tracing abuse to an end user
    safety_identifier: str | None = Field(None, max_length=64)  # logged with the request, as user
    # The prefix cache matches a prompt by its tokens, whatever the key: what the key asks for happens anyway.
    prompt_cache_key: str | None = None
    prompt_cache_retention: CacheRetention = None
    priority: int = 0  # vLLM's: lower is served first (--scheduling-policy priority, or fair within a key)
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None  # an offset to priority (TIER_PRIORITY)
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_progress: bool = False  # llama.cpp's: chunks of prompt progress before the first token
    # Structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    bad_words: list[Text] | None = None  # vLLM's: never written
    allowed_token_ids: list[int] | None = None  # vLLM's: the only tokens that may be drawn

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.return_progress and not self.stream:
            raise ValueError("return_progress is only allowed when stream is true")
        return self

    def constraint_fields(self) -> list[str]:
        """The fields of this request that constrain its output."""
        given = [name for name in ("structured_outputs", *_GUIDED) if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            given.insert(0, "response_format")
        return given

    def constraint(self) -> Constraint | None:
        """The output constraint the request asks for; InvalidRequest names the field that is wrong."""
        given = self.constraint_fields()
        if len(given) > 1:
            raise InvalidRequest(given[1], f"{given[0]} and {given[1]} both constrain the output: give one of them")
        if self.guided_whitespace_pattern is not None and self.guided_json is None:
            raise InvalidRequest("guided_whitespace_pattern", "guided_whitespace_pattern needs guided_json")
        if not given:
            return None
        source = given[0]
        if source == "response_format":
            assert self.response_format is not None
            spec = self.response_format.json_schema
            if spec is None or spec.schema_ is None:
                return Constraint.build(source, {}, json_object=True)
            return Constraint.build(source, {"json": "response_format.json_schema.schema"}, json=spec.schema_,
                                    disable_additional_properties=bool(spec.strict))
        if source == "structured_outputs":
            assert self.structured_outputs is not None
            fields = self.structured_outputs.model_dump(exclude_defaults=True)
            fields["json"] = fields.pop("json_", None)
            names = {name: f"structured_outputs.{name}" for name in fields}
            return Constraint.build(source, names, **fields)
        names = {_GUIDED[source]: source, "whitespace_pattern": "guided_whitespace_pattern"}
        return Constraint.build(source, names, **{_GUIDED[source]: getattr(self, source)},
                                whitespace_pattern=self.guided_whitespace_pattern)

    @property
    def include_usage_chunk(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def logit_bias_ids(self) -> dict[int, float] | None:
        """logit_bias with its JSON-string keys read as token ids."""
        if not self.logit_bias:
            return None
        try:
            return {int(key): value for key, value in self.logit_bias.items()}
        except ValueError as exc:
            why = f"logit_bias keys must be token ids, got {list(self.logit_bias)!r}"
            raise InvalidRequest("logit_bias", why) from exc

    def sampling_fields(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None,
                        thinking_budget: int | None = None) -> dict[str, Any]:
        """SamplingParams' fields (unset ones keep its defaults); InvalidRequest names a field."""
        given = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "repetition_penalty": self.repetition_penalty,
        }
        return dict(
            n=self.n, max_tokens=max_tokens, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, logit_bias=self.logit_bias_ids(),
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, bad_words=self.bad_words,
            allowed_token_ids=self.allowed_token_ids, thinking_token_budget=thinking_budget,
            priority=self.priority + TIER_PRIORITY[self.service_tier or "auto"],
            **{name: value for name, value in given.items() if value is not None},
        )


class ChatTemplateRequest(Request):
    """What the chat template needs: shared by /v1/chat/completions and /tokenize."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _check_template_options(self) -> ChatTemplateRequest:
        if self.continue_final_message and self.messages:
            if self.add_generation_prompt:
                raise ValueError("continue_final_message needs add_generation_prompt set to false")
            if self.messages[-1].role != "assistant":
                raise ValueError("continue_final_message needs an assistant message last")
        return self

    def chat(self, **fields: Any) -> ChatRequest:
        """The chat request these messages, tools and template options mean; fields: the rest of it."""
        choice = self.tool_choice
        return ChatRequest(
            [message.chat(f"messages.{i}") for i, message in enumerate(self.messages)],
            tools=[tool.function.chat() for tool in self.tools or []],
            tool_choice=NamedTool(choice.function.name) if isinstance(choice, NamedToolChoice) else choice,
            chat_template_kwargs=self.chat_template_kwargs, add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message, names=NAMES, **fields)


class ChatCompletionRequest(ChatTemplateRequest, SamplingRequest):
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    parallel_tool_calls: bool = True  # false: at most one tool call a reply
    modalities: list[Literal["text"]] | None = None  # text is what zhuzi writes; audio is refused
    # vLLM's extensions: the prompt's and each choice's token ids; logprobs' tokens written "token_id:N".
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    thinking_token_budget: int | None = None  # a thinking model's thought ends after this many tokens
    # gpt-oss's (a harmony model's) reasoning level; another model refuses it (Completions.chat_request)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    def chat(self, **fields: Any) -> ChatRequest:
        """The server's chat request for this body; InvalidRequest names a field."""
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        sampling = self.sampling_fields(max_tokens, logprobs, thinking_budget=self.thinking_token_budget)
        return super().chat(model=self.model, parallel_tool_calls=self.parallel_tool_calls,
                            constraint=self.constraint(), sampling=sampling, stream=self.stream,
                            user=self.user or self.safety_identifier, reasoning_effort=self.reasoning_effort,
                            **fields)


Prompt = Text | list[Text] | list[int] | list[list[int]]


def as_batch(prompt: Prompt) -> list[str | list[int]]:
    """A prompt (or an embedding's input) as a batch: each item a string or a list of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


class CompletionRequest(SamplingRequest):
    prompt: Prompt
    max_tokens: int | None = 16  # OpenAI's default here (chat's is the rest of the context); null: the rest
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # vLLM's: each prompt token's, on each choice

    @model_validator(mode="after")
    def _prompt_batch_not_empty(self) -> CompletionRequest:
        if not self.prompts():  # each prompt's own emptiness is the engine's to refuse
            raise ValueError("prompt must not be an empty list")
        if self.return_progress and len(self.prompts()) > 1:
            raise ValueError("return_progress takes one prompt (a progress chunk does not say whose it is)")
        return self

    def prompts(self) -> list[str | list[int]]:
        return as_batch(self.prompt)

    def sampling(self) -> dict[str, Any]:
        wanted = [n for n in (self.prompt_logprobs, self.logprobs if self.echo else None) if n is not None]
        return self.sampling_fields(self.max_tokens, self.logprobs, max(wanted, default=None))


class EmbeddingRequest(Request):
    """OpenAI's /v1/embeddings: input is one text, a list of texts, one list of token ids or a list of them."""

    input: Prompt
    model: str | None = None
    keep_alive: KeepAlive | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)  # served only as the model's own width (see embeddings.py)
    user: str | None = None  # logged with the request, as chat's

    def inputs(self) -> list[str | list[int]]:
        return as_batch(self.input)


class TokenizeRequest(ChatTemplateRequest):
    """vLLM's /tokenize: either a raw prompt or chat messages rendered by the template."""

    model: str | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None  # type: ignore[assignment]

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(Request):
    model: str | None = None
    tokens: list[int]
