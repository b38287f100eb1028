"""OpenAI's generation endpoints (/v1/chat/completions and its /render, /v1/completions), between the routes and
the engine: a chat body becomes the server's chat request and runs the chat path (common/chat.py), answered as
chat.completion; a completion's prompts are taken as given and answered as text_completion.
"""
from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from zhuzi.engine.front.client import EngineClient
from zhuzi.sampling_params import InvalidRequest
from zhuzi.server.common.chat import ChatPath, sampling_params
from zhuzi.server.common.errors import ApiError
from zhuzi.server.common.parsers import OutputParser
from zhuzi.server.common.request import ChatRequest
from zhuzi.server.common.serving import Server, json_response, new_id
from zhuzi.server.openai import answers as r
from zhuzi.server.openai import protocol as p
from zhuzi.server.openai.formats import ChatFormat, CompletionFormat


class Completions:
    def __init__(self, server: Server, chats: ChatPath) -> None:
        self.server, self.chats = server, chats

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

    def chat_request(self, body: p.ChatCompletionRequest) -> ChatRequest:
        """The chat request a body means. reasoning_effort sets a harmony model's level; for another model it would
        be a word-to-tokens guess of zhuzi's, not the model's: a 400 naming zhuzi's bound on a thought."""
        if body.reasoning_effort is not None and not self.server.harmony:
            raise ApiError(400, "reasoning_effort is served for models in gpt-oss's harmony format; for this one "
                           "use thinking_token_budget (and chat_template_kwargs' enable_thinking)",
                           param="reasoning_effort")
        return body.chat()

    async def chat(self, request: Request, key: str, body: p.ChatCompletionRequest) -> Response:
        chat = self.chat_request(body)
        plan = await self.chats.plan(chat)
        fmt = ChatFormat(new_id("chatcmpl"), self.server.model_name, body, plan.chat.ids,
                         self.server.ready().tokenizer.bytes_of)
        return await self.chats.run(request, key, chat, plan, fmt)

    async def render(self, key: str, body: p.ChatCompletionRequest) -> Response:
        """vLLM's /v1/chat/completions/render: the prompt a chat request makes, as text and token ids."""
        plan = await self.chats.plan(self.chat_request(body))
        tokenizer = self.server.ready().tokenizer
        if self.server.harmony:  # the document is zhuzi's own render, not the template's
            text = await self.server.in_worker(tokenizer.decode, plan.chat.ids, False)
        else:
            text = await self.server.in_worker(lambda: tokenizer.render_chat(plan.chat.messages, **plan.chat.args))
        self.server.gateway.charge_tokens(key, len(plan.chat.ids))
        return json_response(r.RenderResponse(model=self.server.model_name, prompt=text, token_ids=plan.chat.ids))

    async def completions(self, request: Request, key: str, body: p.CompletionRequest) -> Response:
        self.server.check_model(body.model)
        try:
            constraint = body.constraint()
            fields = body.sampling()
        except InvalidRequest as exc:
            raise ApiError.of(exc) from exc
        params = sampling_params(fields, constraint)
        await self.server.check_constraints([constraint] if constraint else [])
        engine = self.server.ready()
        tokenizer = engine.tokenizer
        texts, prompt_ids = await self.server.in_worker(self.completion_prompts, engine, body.prompts())

        def decode(token_id: int) -> str:
            return tokenizer.decode([token_id], skip_special_tokens=False)

        fmt = CompletionFormat(new_id("cmpl"), self.server.model_name, body, texts, prompt_ids, decode)
        self.server.log_user(fmt.request_id, body.user or body.safety_identifier)

        def new_parser() -> OutputParser:
            return OutputParser(reasoning=False, tools=False)

        return await self.server.generate(request, key, prompt_ids, params, fmt, new_parser, body.stream)
