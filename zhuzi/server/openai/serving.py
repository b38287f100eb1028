"""The generation endpoints' logic (/v1/chat/completions, /v1/completions), between the routes and the engine.

A request is checked (model name, sampling fields; the engine checks the rest), its prompt rendered by the
chat template or taken as given, and tokenized in a worker thread; then Server.generate runs it.

An output constraint (response_format, structured_outputs, guided_*, or the grammar of tool calls, see
common/tools.py) is compiled before anything is queued, so a bad schema is a 400 naming the field the client sent.
"""
from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pydantic
from fastapi import Request
from fastapi.responses import Response

from zhuzi.engine.front.client import EngineClient
from zhuzi.sampling_params import InvalidRequest, SamplingParams
from zhuzi.server.common.formats import Format
from zhuzi.server.common.parsers import OutputParser
from zhuzi.server.common.serving import ApiError, RenderedChat, Server, json_response
from zhuzi.server.common.tools import chat_constraints
from zhuzi.server.openai import answers as r
from zhuzi.server.openai import protocol as p
from zhuzi.server.openai.formats import ChatFormat, CompletionFormat

log = logging.getLogger("zhuzi.server")


def as_chat_request(fields: dict[str, Any], param: str) -> p.ChatCompletionRequest:
    """The chat request another API's request means (its fields built by its module); param: that API's
    field for what a chat may still refuse (an empty turn)."""
    try:
        return p.ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        raise ApiError(400, f"{param}: {first['msg'].removeprefix('Value error, ')}", param=param) from exc


@dataclass
class ChatPlan:
    """A chat request ready to run: its prompt, its sampling, and how its reply is parsed."""

    chat: RenderedChat
    params: SamplingParams
    new_parser: Callable[[], OutputParser]


class Completions:
    def __init__(self, server: Server) -> None:
        self.server = server

    @staticmethod
    def sampling_params(body: p.ChatCompletionRequest | p.CompletionRequest,
                        constraint: p.Constraint | None = None) -> SamplingParams:
        try:
            return body.to_sampling_params(constraint.params if constraint else None)
        except InvalidRequest as exc:
            raise ApiError.of(exc) from exc

    def constraints(self, body: p.ChatCompletionRequest | p.CompletionRequest) -> tuple[list[p.Constraint], bool]:
        """The output constraints to compile, the last one the reply's, and whether it is only tool calls."""
        try:
            if isinstance(body, p.ChatCompletionRequest):
                return chat_constraints(body, self.server.added_tokens)
            constraint = body.constraint()
            return [constraint] if constraint else [], False
        except InvalidRequest as exc:
            raise ApiError.of(exc) from exc

    async def check_constraints(self, constraints: list[p.Constraint]) -> None:
        for constraint in constraints:
            try:
                await self.server.ready().check_structured_output(constraint.params)
            except InvalidRequest as exc:
                raise ApiError.of(constraint.rename(exc)) from exc

    @staticmethod
    def log_user(request_id: str, user: str | None) -> None:
        if user is not None:  # OpenAI's end-user id: what an operator needs to trace abuse
            log.info("%s for user %r", request_id, user)

    @staticmethod
    def completion_prompts(engine: EngineClient, prompts: list[str | list[int]]) -> tuple[list[str], list[list[int]]]:
        """Each prompt's text and ids (echo and logprobs show the prompt's tokens)."""
        tokenizer = engine.tokenizer
        try:
            for prompt in prompts:
                if not isinstance(prompt, str):
                    engine.check_token_ids(prompt, "prompt")
        except InvalidRequest as exc:
            raise ApiError.of(exc) from exc
        texts = [x if isinstance(x, str) else tokenizer.decode(x, skip_special_tokens=False) for x in prompts]
        return texts, [tokenizer.encode_prompt(x) for x in prompts]

    async def plan_chat(self, body: p.ChatCompletionRequest, names: dict[str, str] | None = None) -> ChatPlan:
        """Everything a chat request is checked and prepared for before it runs (the render endpoint stops
        here): its constraints compiled, its prompt rendered and tokenized. names: another API's names for
        the chat request's fields, which its errors then use."""
        try:
            return await self._plan_chat(body)
        except ApiError as exc:
            raise exc.renamed(names or {}) from exc

    async def _plan_chat(self, body: p.ChatCompletionRequest) -> ChatPlan:
        self.server.check_model(body.model)
        constraints, forced = self.constraints(body)
        constraint = constraints[-1] if constraints else None
        params = self.sampling_params(body, constraint)
        chat = await self.server.in_worker(self.server.render_chat, body, constraint)
        await self.check_constraints(constraints)
        tools, max_calls = body.parse_tool_calls, None if body.parallel_tool_calls else 1

        def new_parser() -> OutputParser:
            return OutputParser(reasoning=self.server.reasoning, tools=tools, prefill=chat.prefill, forced=forced,
                                max_calls=max_calls)

        return ChatPlan(chat, params, new_parser)

    async def chat(self, request: Request, key: str, body: p.ChatCompletionRequest) -> Response:
        plan = await self.plan_chat(body)
        fmt = ChatFormat(r.new_id("chatcmpl"), self.server.model_name, body, plan.chat.ids,
                         self.server.ready().tokenizer.bytes_of)
        return await self.run_chat(request, key, body, plan, fmt)

    async def run_chat(self, request: Request, key: str, body: p.ChatCompletionRequest, plan: ChatPlan,
                       fmt: Format, on_answer: Callable[[pydantic.BaseModel], Awaitable[None]] | None = None
                       ) -> Response:
        """A planned chat request, answered in fmt (OpenAI's chat, Anthropic's messages, a Response)."""
        self.log_user(fmt.request_id, body.user or body.safety_identifier)
        return await self.server.generate(request, key, [plan.chat.ids], plan.params, fmt, plan.new_parser,
                                          body.stream, on_answer)

    async def render(self, key: str, body: p.ChatCompletionRequest) -> Response:
        """vLLM's /v1/chat/completions/render: the prompt a chat request makes, as text and token ids."""
        plan = await self.plan_chat(body)
        tokenizer = self.server.ready().tokenizer
        text = await self.server.in_worker(lambda: tokenizer.render_chat(plan.chat.messages, **plan.chat.args))
        self.server.gateway.charge_tokens(key, len(plan.chat.ids))
        return json_response(r.RenderResponse(model=self.server.model_name, prompt=text, token_ids=plan.chat.ids))

    async def completions(self, request: Request, key: str, body: p.CompletionRequest) -> Response:
        self.server.check_model(body.model)
        constraints, _ = self.constraints(body)
        params = self.sampling_params(body, constraints[-1] if constraints else None)
        await self.check_constraints(constraints)
        engine = self.server.ready()
        tokenizer = engine.tokenizer
        texts, prompt_ids = await self.server.in_worker(self.completion_prompts, engine, body.prompts())

        def decode(token_id: int) -> str:
            return tokenizer.decode([token_id], skip_special_tokens=False)

        fmt = CompletionFormat(r.new_id("cmpl"), self.server.model_name, body, texts, prompt_ids, decode)
        self.log_user(fmt.request_id, body.user or body.safety_identifier)

        def new_parser() -> OutputParser:
            return OutputParser(reasoning=False, tools=False)

        return await self.server.generate(request, key, prompt_ids, params, fmt, new_parser, body.stream)
