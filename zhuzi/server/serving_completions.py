"""The generation endpoints' logic (/v1/chat/completions, /v1/completions), between the routes and the engine.

A request is checked (model name, sampling fields; the engine checks the rest), its prompt rendered by the
chat template or taken as given, and tokenized in a worker thread; then Server.generate runs it.

An output constraint (response_format, structured_outputs, guided_*, or the grammar of tool calls, see
tools.py) is compiled before anything is queued, so a bad schema is a 400 naming the field the client sent.
"""
from __future__ import annotations

import logging

from fastapi import Request
from fastapi.responses import Response

from zhuzi.engine.client import EngineClient
from zhuzi.sampling_params import InvalidRequest, SamplingParams
from zhuzi.server import protocol as p
from zhuzi.server import responses as r
from zhuzi.server.formats import ChatFormat, CompletionFormat
from zhuzi.server.parsers import OutputParser
from zhuzi.server.serving import ApiError, Server
from zhuzi.server.tools import chat_constraints

log = logging.getLogger("zhuzi.server")


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
    def log_user(request_id: str, body: p.SamplingRequest) -> None:
        if body.user is not None:  # OpenAI's end-user id: what an operator needs to trace abuse
            log.info("%s for user %r", request_id, body.user)

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

    async def chat(self, request: Request, key: str, body: p.ChatCompletionRequest) -> Response:
        self.server.check_model(body.model)
        constraints, forced = self.constraints(body)
        constraint = constraints[-1] if constraints else None
        params = self.sampling_params(body, constraint)
        ids, prefill = await self.server.in_worker(self.server.render_chat, body, constraint)
        await self.check_constraints(constraints)
        fmt = ChatFormat(r.new_id("chatcmpl"), self.server.model_name, body, ids,
                         self.server.ready().tokenizer.bytes_of)
        self.log_user(fmt.request_id, body)
        tools, max_calls = body.parse_tool_calls, None if body.parallel_tool_calls else 1

        def new_parser() -> OutputParser:
            return OutputParser(reasoning=self.server.reasoning, tools=tools, prefill=prefill, forced=forced,
                                max_calls=max_calls)

        return await self.server.generate(request, key, [ids], params, fmt, new_parser, body.stream,
                                          body.include_usage_chunk)

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
        self.log_user(fmt.request_id, body)

        def new_parser() -> OutputParser:
            return OutputParser(reasoning=False, tools=False)

        return await self.server.generate(request, key, prompt_ids, params, fmt, new_parser, body.stream,
                                   body.include_usage_chunk)
