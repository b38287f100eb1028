"""The load generators' OpenAI client: one streamed request timed event by event, a conversation replayed
turn by turn (each turn carrying the history and the server's answers), the model a server serves.

TTFT: time to the first event with content; ITL: the gaps between content events; TPOT: (end-to-end - TTFT) /
(output tokens - 1), over requests of 2+ tokens. Token counts come from the usage event where the server
sends one, else from counting content events and the messages' text.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import numpy as np

from zhuzi.bench.datasets import Conversation

ENDPOINT_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass
class Target:
    """Where and how requests are sent."""

    url: str
    endpoint: str
    model: str
    headers: dict[str, str]
    options: dict  # extra request fields: temperature, ignore_eos
    render_template: bool  # completions endpoint: send the chat rendered through the chat template


@dataclass
class RequestResult:
    conversation: int
    turn: int
    success: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass
class Stat:
    """Milliseconds."""

    mean: float
    median: float
    p99: float

    @classmethod
    def of(cls, seconds: list[float]) -> Stat:
        if not seconds:
            return cls(0.0, 0.0, 0.0)
        ms = np.asarray(seconds) * 1e3
        return cls(float(ms.mean()), float(np.median(ms)), float(np.percentile(ms, 99)))


def chunk_content(choice: dict) -> str:
    """The text a streamed choice carries; servers differ in where (and whether) they put it."""
    delta = choice.get("delta") or choice.get("message") or {}
    parts = (delta.get("content"), delta.get("reasoning_content"), delta.get("reasoning"), choice.get("text"))
    return "".join(part for part in parts if isinstance(part, str))


def sse_data(line: str) -> str | None:
    """The data of one SSE line, or None for comments, other fields and blank lines."""
    if not line.startswith("data:"):
        return None
    return line[5:].strip()


def request_body(target: Target, messages: list[dict], max_tokens: int, tokenizer) -> dict:
    body = {"model": target.model, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, **target.options}
    if target.endpoint == "chat":
        body["messages"] = messages
    elif target.render_template:
        body["prompt"] = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        body["prompt"] = messages[-1]["content"]
    return body


async def send_request(client, target: Target, body: dict, result: RequestResult) -> None:
    """Stream one request into `result`, timing every content chunk."""
    start = time.perf_counter()
    last = start
    chunks = 0
    try:
        async with client.stream("POST", target.url, json=body, headers=target.headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:200]}"
                return
            async for line in response.aiter_lines():
                data = sse_data(line.strip())
                if not data:
                    continue
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    result.error = f"stream error: {json.dumps(chunk['error'])[:200]}"
                    return
                usage = chunk.get("usage") or {}
                result.output_tokens = usage.get("completion_tokens") or result.output_tokens
                result.prompt_tokens = usage.get("prompt_tokens") or result.prompt_tokens
                text = "".join(chunk_content(choice) for choice in chunk.get("choices") or [])
                if not text:
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last, chunks = now, chunks + 1
                result.text += text
    except Exception as error:  # any failure of one request is data, not a crash of the run
        result.error = f"{type(error).__name__}: {error}"
        return
    result.latency = time.perf_counter() - start
    result.output_tokens = result.output_tokens or chunks
    result.success = chunks > 0
    if not result.success:
        result.error = "the stream carried no content"


async def run_conversation(client, target: Target, index: int, conversation: Conversation, start_at: float,
                           limit: asyncio.Semaphore, tokenizer, progress) -> list[RequestResult]:
    """Replay one conversation turn by turn, feeding back the server's own answers."""
    await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
    results = []
    messages = [{"role": "system", "content": conversation.system}] if conversation.system else []
    async with limit:
        for turn_index, turn in enumerate(conversation.turns):
            messages.append({"role": "user", "content": turn.user})
            result = RequestResult(index, turn_index)
            await send_request(client, target, request_body(target, messages, turn.max_tokens, tokenizer), result)
            if result.success and not result.prompt_tokens:
                result.prompt_tokens = count_tokens(tokenizer, messages)
            results.append(result)
            progress.update(1)
            if not result.success:
                break
            messages.append({"role": "assistant", "content": result.text})
    for turn_index in range(len(results), len(conversation.turns)):
        results.append(RequestResult(index, turn_index, error="an earlier turn of its conversation failed"))
        progress.update(1)
    return results


def count_tokens(tokenizer, messages: list[dict]) -> int:
    return sum(len(tokenizer.encode(m["content"], add_special_tokens=False)) for m in messages)


async def discover_model(client, base_url: str, headers: dict[str, str]) -> str:
    try:
        response = await client.get(f"{base_url}/v1/models", headers=headers)
        response.raise_for_status()
        models = response.json().get("data") or []
    except Exception as error:
        raise SystemExit(f"cannot list the models at {base_url}/v1/models ({error}); "
                         f"is the server up? Or pass --model") from error
    if not models:
        raise SystemExit(f"{base_url}/v1/models lists no model; pass --model")
    return models[0]["id"]
