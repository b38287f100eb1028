"""OpenAI's Responses API (/v1/responses and its GET, DELETE and input_items), between the routes and the chat
path: a request's input items, after the stored items of every earlier turn (previous_response_id), become the
server's chat request; ResponsesFormat writes the reply's parts as output items, whole or as OpenAI's numbered
events. With store (the default) the Response and its input items are kept, under the caller's key, before the
client sees the answer.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from zhuzi.outputs import CompletionOutput, PromptProgress
from zhuzi.sampling_params import SamplingParams
from zhuzi.server.common.chat import ChatPath
from zhuzi.server.common.content_parts import Part, PartEvent, new_item_id
from zhuzi.server.common.errors import ApiError
from zhuzi.server.common.formats import Choice, ResponseState, sse_event
from zhuzi.server.common.parsers import ParsedText
from zhuzi.server.common.request import ChatRequest, Constraint, Message, NamedTool, Tool, ToolCall
from zhuzi.server.common.serving import json_response
from zhuzi.server.common.store import owner_of
from zhuzi.server.openai import answers as r
from zhuzi.server.openai import protocol as p
from zhuzi.server.openai.formats import DONE, chat_logprobs
from zhuzi.server.responses import protocol as rp
from zhuzi.server.responses.store import MissingResponse, ResponseStore, StoredResponse

log = logging.getLogger("zhuzi.server")
MAX_ITEMS_PAGE = 100
# The chat request's fields under their Responses names, for the errors the chat path finds (see ApiError.renamed).
NAMES = {r"^max_tokens\b": "max_output_tokens", r"^messages\b.*": "input",
         r"^(chat_template_kwargs|thinking_token_budget)\b.*": "reasoning"}


def not_found(response_id: str, param: str | None = None) -> ApiError:
    what = "Previous response" if param else "Response"
    return ApiError(404, f"{what} with id {response_id!r} not found (or it expired, was deleted, or belongs to "
                    "another API key).", param=param, code="previous_response_not_found" if param else None)


# ---------------------------------------------------------------- items, as chat messages

def input_items(body: rp.ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as the items it is stored as: each with an id, a message's content as parts."""
    items = [rp.MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    out = []
    for item in items:
        stored = item.model_dump(exclude_none=True, by_alias=True)
        if isinstance(item, rp.MessageItem) and isinstance(item.content, str):
            part = "output_text" if item.role == "assistant" else "input_text"
            stored["content"] = [{"type": part, "text": item.content}]
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
        stored.setdefault("id", new_item_id(prefix[stored["type"]]))
        stored.setdefault("status", "completed")
        out.append(stored)
    return out


def chat_messages(items: list[dict[str, Any]], first_input: int) -> list[Message]:
    """Input and output items (stored form) as chat messages: function calls join the assistant turn they
    follow, a reasoning item goes with the assistant turn after it. Items from first_input on are this request's
    input (input.0, ...), the earlier ones stored turns."""
    out: list[Message] = []
    thought = ""
    for k, item in enumerate(items):
        kind = item["type"]
        source = f"input.{k - first_input}" if k >= first_input else None
        if kind == "reasoning":
            parts = item.get("content") or item.get("summary") or [{"text": item.get("encrypted_content", "")}]
            thought += "\n".join(part["text"] for part in parts)
        elif kind == "function_call_output":
            out.append(Message("tool", item["output"], tool_call_id=item["call_id"],
                               source=source and f"{source}.call_id"))
        elif kind == "function_call":
            call = ToolCall(item["name"], item["arguments"], item["call_id"], source)
            if out and out[-1].role == "assistant" and out[-1].tool_call_id is None:
                out[-1].tool_calls = (out[-1].tool_calls or []) + [call]
                continue
            out.append(Message("assistant", tool_calls=[call]))
        else:
            out.append(Message(item["role"], [part["text"] for part in item["content"]]))
        if thought and out and out[-1].role == "assistant":
            out[-1].reasoning, thought = thought, ""
    return out


def _constraint(fmt: rp.TextFormat | None) -> Constraint | None:
    """text.format's constraint on the reply (none for plain text)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object" or fmt.schema_ is None:
        return Constraint.build("text.format", {}, json_object=True)
    return Constraint.build("text.format", {"json": "text.format.schema"}, json=fmt.schema_,
                            disable_additional_properties=bool(fmt.strict))


def chat_request(body: rp.ResponsesRequest, history: list[dict[str, Any]],
                 items: list[dict[str, Any]]) -> ChatRequest:
    """The chat request a Responses request means (history: the earlier turns' items, oldest first)."""
    system = [Message("system", body.instructions)] if body.instructions else []
    priority = body.priority + p.TIER_PRIORITY[body.service_tier or "auto"]
    sampling: dict[str, Any] = {"max_tokens": body.max_output_tokens, "temperature": body.temperature,
                                "top_p": body.top_p, "presence_penalty": body.presence_penalty,
                                "frequency_penalty": body.frequency_penalty, "priority": priority}
    if body.logprobs:
        sampling["logprobs"] = body.top_logprobs or 0
    template_kwargs = None
    if body.reasoning is not None and body.reasoning.effort is not None:
        template_kwargs = {"enable_thinking": body.reasoning.effort != "none"}
        sampling["thinking_token_budget"] = rp.EFFORT_BUDGETS.get(body.reasoning.effort)
    choice = body.tool_choice
    return ChatRequest(
        system + chat_messages(history + items, len(history)), model=body.model,
        tools=[Tool(t.name, t.description, t.parameters, t.strict) for t in body.tools or []],
        tool_choice=NamedTool(choice.name) if isinstance(choice, rp.NamedFunctionTool) else choice,
        parallel_tool_calls=body.parallel_tool_calls, constraint=_constraint(body.text.format if body.text else None),
        sampling={name: value for name, value in sampling.items() if value is not None},
        chat_template_kwargs=template_kwargs, reasoning_effort=body.reasoning.effort if body.reasoning else None,
        stream=body.stream, user=body.user, names=NAMES)


# ---------------------------------------------------------------- the answer

def _tier(tier: str | None) -> str:
    """The tier a request is served in: auto picks the default."""
    return "default" if tier in (None, "auto") else tier


def text_used(text: rp.TextConfig | None) -> rp.TextUsed:
    """The text format a reply was held to: a json_schema's strict says whether its objects were closed."""
    fmt = text.format if text else None
    if fmt is None or fmt.type != "json_schema":
        return rp.TextUsed(format=rp.PlainFormat(type=fmt.type if fmt else "text"))
    return rp.TextUsed(format=rp.SchemaFormat(name=fmt.name, description=fmt.description,
                                              schema=fmt.schema_, strict=bool(fmt.strict)))


class ResponsesFormat:
    """A Response, whole or as a stream: response.created and .in_progress, each output item's added / deltas /
    done events, then response.completed (or .incomplete, or .failed); every event numbered, and [DONE] last
    (the Open Responses specification's end of a stream)."""

    def __init__(self, body: rp.ResponsesRequest, request_id: str, model: str, params: SamplingParams,
                 token_bytes: Callable[[int], bytes], cache_page: int) -> None:
        self.body, self.request_id, self.model, self.token_bytes = body, request_id, model, token_bytes
        self.params = params  # the engine's sampling, which the Response reports
        self.cache_page = cache_page  # the prefix cache's unit (0: no prefix cache)
        self.created = int(time.time())
        self.sequence = 0
        self.logprobs_sent: dict[int, int] = {}  # per text part, how many of its tokens' logprobs went out

    def _logprobs(self, choice: Choice | None, index: int, since: int = 0) -> list[r.TokenLogprob] | None:
        """A text part's tokens' logprobs (from the since-th), if the request included them."""
        if not self.body.logprobs:
            return None
        if choice is None:
            return []
        token_ids, entries = choice.part_tokens(index)
        return chat_logprobs(token_ids[since:], entries[since:], self.body.top_logprobs or 0,
                             self.token_bytes).content or []

    def _item(self, gen: ResponseState, index: int, part: Part, status: rp.ItemStatus,
              text: str | None = None) -> rp.OutputItem:
        """A part as its output item; text: instead of the part's (an item just added is empty)."""
        text = part.text if text is None else text
        if part.kind == "thinking":
            secret = text if self.body.encrypted_reasoning and text else None
            return rp.ReasoningOutput(id=part.id, status=status, content=[rp.ReasoningContent(text=text)],
                                      encrypted_content=secret)
        if part.kind == "text":
            return rp.OutputMessage(id=part.id, status=status, content=[self._content(gen, index, part, text)])
        return rp.FunctionCallOutput(id=part.id, status=status, call_id=part.call_id or "",
                                     name=part.name or "", arguments=text)

    def _content(self, gen: ResponseState, index: int, part: Part, text: str) -> rp.OutputText | rp.ReasoningContent:
        if part.kind == "thinking":
            return rp.ReasoningContent(text=text)
        return rp.OutputText(text=text, logprobs=self._logprobs(gen.choices.get(0) if text else None, index))

    def _status(self, gen: ResponseState) -> rp.ResponseStatus:
        choice = gen.choices.get(0)
        if choice is None or choice.finish_reason is None:
            return "in_progress"
        return "completed" if choice.finish_reason == "stop" else "incomplete"

    def _item_status(self, gen: ResponseState, index: int) -> rp.ItemStatus:
        choice = gen.choices.get(0)
        last = choice is not None and index == len(choice.parts.parts) - 1
        if choice is not None and choice.parts.parts[index].dropped:  # a call that turned out to be text
            return "incomplete"
        if last and choice.finish_reason is None:
            return "in_progress"
        return "incomplete" if last and choice.finish_reason != "stop" else "completed"

    def _response(self, gen: ResponseState, status: rp.ResponseStatus, error: rp.ResponseError | None = None
                  ) -> rp.ResponseObject:
        body, choice = self.body, gen.choices.get(0)
        parts = choice.parts.kept() if choice and status != "in_progress" else []
        incomplete = None
        if status == "incomplete":
            reason = choice.finish_reason if choice and choice.finish_reason else "abort"
            incomplete = rp.IncompleteDetails(reason="max_output_tokens" if reason == "length" else reason)
        usage = None if status == "in_progress" else rp.ResponseUsage(
            input_tokens=gen.prompt_tokens, input_tokens_details=rp.InputTokensDetails(
                cached_tokens=gen.cached_tokens, cache_write_tokens=self._cache_writes(gen)),
            output_tokens=gen.completion_tokens,
            output_tokens_details=rp.ReasoningTokensDetails(reasoning_tokens=gen.reasoning_tokens or 0),
            total_tokens=gen.prompt_tokens + gen.completion_tokens)
        params = self.params
        return rp.ResponseObject(
            id=self.request_id, created_at=self.created, completed_at=int(time.time()) if status == "completed"
            else None, status=status, error=error, incomplete_details=incomplete, instructions=body.instructions,
            max_output_tokens=body.max_output_tokens, metadata=body.metadata or {}, model=self.model,
            output=[self._item(gen, i, p, self._item_status(gen, i)) for i, p in parts],
            parallel_tool_calls=body.parallel_tool_calls, previous_response_id=body.previous_response_id,
            reasoning=body.reasoning, store=body.store, temperature=params.temperature, top_p=params.top_p,
            presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
            top_logprobs=params.logprobs or 0, text=text_used(body.text), tool_choice=body.tool_choice or "auto",
            tools=body.tools or [], usage=usage, user=body.user, service_tier=_tier(body.service_tier),
            prompt_cache_key=body.prompt_cache_key, prompt_cache_retention=body.prompt_cache_retention,
            safety_identifier=body.safety_identifier)

    def _cache_writes(self, gen: ResponseState) -> int:
        """The prompt's whole KV pages that were not cached yet: the prefix cache keeps them now."""
        if not self.cache_page:
            return 0
        return max(0, gen.prompt_tokens // self.cache_page * self.cache_page - gen.cached_tokens)

    def _event(self, event: rp.Event) -> str:
        event.sequence_number, self.sequence = self.sequence, self.sequence + 1
        return sse_event(event.type, event)  # type: ignore[attr-defined]

    def _part_events(self, gen: ResponseState, e: PartEvent) -> list[rp.Event]:
        part, index = e.part, e.index
        where = {"item_id": part.id, "output_index": index}
        if e.kind == "start":
            events: list[rp.Event] = [rp.ItemEvent(type="response.output_item.added", output_index=index,
                                                   item=self._item(gen, index, part, "in_progress", ""))]
            if part.kind != "tool_use":
                events.append(rp.ContentPartEvent(type="response.content_part.added",
                                                  part=self._content(gen, index, part, ""), **where))
            return events
        if part.kind == "tool_use":
            if e.kind == "delta":
                return [rp.ArgumentsDeltaEvent(delta=e.text, **where)]
            done: list[rp.Event] = [rp.ArgumentsDoneEvent(arguments=part.text, **where)]
        else:
            kind = "reasoning" if part.kind == "thinking" else "output_text"
            if e.kind == "delta":
                return [rp.TextDeltaEvent(type=f"response.{kind}.delta", delta=e.text,
                                          logprobs=self._delta_logprobs(gen, index, kind), **where)]
            content = self._content(gen, index, part, part.text)
            logprobs = (content.logprobs or []) if isinstance(content, rp.OutputText) else None
            done = [rp.TextDoneEvent(type=f"response.{kind}.done", text=part.text, logprobs=logprobs, **where),
                    rp.ContentPartEvent(type="response.content_part.done", part=content, **where)]
        return done + [rp.ItemEvent(type="response.output_item.done", output_index=index,
                                    item=self._item(gen, index, part, self._item_status(gen, index)))]

    def _delta_logprobs(self, gen: ResponseState, index: int, kind: str) -> list[r.TokenLogprob] | None:
        """An output_text delta's: [] (OpenAI's field is required), or its new tokens' logprobs if included."""
        if kind != "output_text":
            return None
        sent = self.logprobs_sent.get(index, 0)
        news = self._logprobs(gen.choices.get(0), index, sent) or []
        self.logprobs_sent[index] = sent + len(news)
        return news

    def progress(self, progress: PromptProgress) -> list[str]:
        return []  # the API has no progress events

    def events(self, gen: ResponseState, choice: Choice, delta: CompletionOutput, piece: ParsedText,
               prompt_index: int) -> list[str]:
        out = self._start(gen)
        for e in choice.events:
            out += [self._event(event) for event in self._part_events(gen, e)]
        return out

    def _start(self, gen: ResponseState) -> list[str]:
        if self.sequence:
            return []
        started = self._response(gen, "in_progress")
        return [self._event(rp.ResponseEvent(type=kind, response=started))
                for kind in ("response.created", "response.in_progress")]

    def end(self, gen: ResponseState) -> list[str]:
        response = self.response(gen)
        kind = "response.completed" if response.status == "completed" else "response.incomplete"
        return self._start(gen) + [self._event(rp.ResponseEvent(type=kind, response=response)), DONE]

    def failure(self, gen: ResponseState, error: ApiError) -> list[str]:
        failed = self._response(gen, "failed", rp.ResponseError(code="server_error", message=error.message))
        return self._start(gen) + [self._event(rp.ResponseEvent(type="response.failed", response=failed)), DONE]

    def response(self, gen: ResponseState) -> rp.ResponseObject:
        return self._response(gen, self._status(gen))


# ---------------------------------------------------------------- the endpoints

class Responses:
    def __init__(self, chats: ChatPath, store: ResponseStore) -> None:
        self.chats, self.store = chats, store
        self.server = chats.server

    async def create(self, request: Request, key: str, body: rp.ResponsesRequest) -> Response:
        owner = owner_of(key)
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            try:
                turns = await self.server.in_worker(self.store.conversation, body.previous_response_id, owner)
            except MissingResponse as exc:
                raise not_found(str(exc), "previous_response_id") from exc
            for turn in turns:
                history += turn.input_items + turn.response["output"]
        items = input_items(body)
        chat = chat_request(body, history, items)
        plan = await self.chats.plan(chat)
        engine = self.server.ready()
        fmt = ResponsesFormat(body, new_item_id("resp"), self.server.model_name, plan.params, engine.tokenizer.bytes_of,
                              engine.config.page_size if engine.config.enable_prefix_caching else 0)
        if body.safety_identifier is not None:  # OpenAI's end-user id, logged as user is
            log.info("%s for safety_identifier %r", fmt.request_id, body.safety_identifier)

        async def keep(answer: Any) -> None:
            if body.store:
                stored = StoredResponse(fmt.request_id, owner, body.previous_response_id, fmt.created,
                                        json.loads(answer.model_dump_json()), items)
                await self.server.in_worker(self.store.put, stored)

        return await self.chats.run(request, key, chat, plan, fmt, keep)

    async def _stored(self, key: str, response_id: str) -> StoredResponse:
        try:
            return await self.server.in_worker(self.store.get, response_id, owner_of(key))
        except MissingResponse as exc:
            raise not_found(response_id) from exc

    async def retrieve(self, key: str, response_id: str) -> Response:
        return JSONResponse((await self._stored(key, response_id)).response)

    async def delete(self, key: str, response_id: str) -> Response:
        try:
            await self.server.in_worker(self.store.delete, response_id, owner_of(key))
        except MissingResponse as exc:
            raise not_found(response_id) from exc
        return json_response(rp.DeletedResponse(id=response_id))

    async def input_items(self, key: str, response_id: str, after: str | None, limit: int,
                          order: str) -> Response:
        items = (await self._stored(key, response_id)).input_items
        if order == "desc":
            items = items[::-1]
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise ApiError(400, f"after: no input item {after!r} in this response", param="after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return json_response(rp.InputItemList(data=page, first_id=page[0]["id"] if page else None,
                                              last_id=page[-1]["id"] if page else None, has_more=len(items) > limit))
