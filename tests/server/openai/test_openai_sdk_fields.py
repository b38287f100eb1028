"""Every parameter of the openai SDK's chat.completions.create and completions.create, sent through the SDK,
unmodified, to the session's default `zhuzi serve`: each is served by its meaning or refused with a 400 whose
message names it (docs/serving.md's table). One or two tokens each."""
from __future__ import annotations

import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
HI = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                    "properties": {"a": {"type": "string"}}}}}

# (field, value, None when served, else words of the refusal); extra fields a case needs ride in the value's
# neighbours (see EXTRA).
CHAT = [
    ("audio", {"voice": "alloy", "format": "wav"}, "zhuzi writes text only"),
    ("frequency_penalty", 0.5, None),
    ("logit_bias", {"11": 5}, None),
    ("logprobs", True, None),
    ("top_logprobs", 2, None),
    ("max_completion_tokens", 2, None),
    ("max_tokens", 2, None),
    ("metadata", {"a": "b"}, "zhuzi stores no completions"),
    ("modalities", ["text"], None),
    ("modalities", ["text", "audio"], "'text'"),
    ("n", 2, None),
    ("parallel_tool_calls", False, None),
    ("prediction", {"type": "content", "content": "Hello"}, "predicted outputs"),
    ("presence_penalty", 0.5, None),
    ("prompt_cache_key", "session-1", None),
    ("prompt_cache_retention", "in_memory", None),
    ("prompt_cache_retention", "24h", "lives in memory"),
    ("reasoning_effort", "low", "thinking_token_budget"),
    ("response_format", {"type": "json_object"}, None),
    ("safety_identifier", "user-1", None),
    ("seed", 7, None),
    ("service_tier", "default", None),  # flex and priority move the request's priority: fcfs refuses that
    ("service_tier", "scale", "'priority'"),
    ("stop", ["\n"], None),
    ("store", True, "zhuzi stores no completions"),
    ("stream_options", {"include_usage": True, "include_obfuscation": False}, None),
    ("stream_options", {"include_obfuscation": True}, "does not pad"),
    ("temperature", 0.5, None),
    ("tool_choice", "required", None),
    ("tools", [TOOL], None),
    ("top_p", 0.5, None),
    ("user", "user-1", None),
    ("verbosity", "low", "not a field zhuzi knows"),
    ("web_search_options", {}, "no web search"),
    ("function_call", "auto", "deprecated"),
    ("functions", [TOOL["function"]], "deprecated"),
]
EXTRA = {"top_logprobs": {"logprobs": True}, "stream_options": {"stream": True}, "tool_choice": {"tools": [TOOL]}}


def run(create, field: str, value, refusal: str | None, **body) -> None:
    args = {"model": MODEL, "max_tokens": 2, **body, **EXTRA.get(field, {}), field: value}
    if field == "max_completion_tokens":
        del args["max_tokens"]
    if refusal is not None:
        with pytest.raises(openai.BadRequestError) as refused:
            create(**args)
        error = refused.value.body
        assert error["param"].split(".")[0] == field and refusal in error["message"], error
        return
    answer = create(**args)
    if args.get("stream"):
        chunks = list(answer)
        assert chunks[-1].usage is not None  # include_usage: the last chunk counts the tokens
    else:
        assert len(answer.choices) == args.get("n", 1)


@pytest.mark.parametrize(("field", "value", "refusal"), CHAT, ids=[f"{f}={v}" for f, v, _ in CHAT])
def test_each_chat_parameter_is_served_or_refused_by_name(client: openai.OpenAI, field, value, refusal) -> None:
    run(client.chat.completions.create, field, value, refusal, messages=HI)


COMPLETIONS = [
    ("best_of", 2, "use n"), ("echo", True, None), ("frequency_penalty", 0.5, None), ("logit_bias", {"11": 5}, None),
    ("logprobs", 2, None), ("n", 2, None), ("presence_penalty", 0.5, None), ("seed", 7, None), ("stop", "\n", None),
    ("stream_options", {"include_usage": True}, None), ("suffix", "end", "fill in the middle"),
    ("temperature", 0.5, None), ("top_p", 0.5, None), ("user", "user-1", None),
    ("service_tier", "auto", None), ("safety_identifier", "user-1", None),
]


@pytest.mark.parametrize(("field", "value", "refusal"), COMPLETIONS, ids=[f for f, _, _ in COMPLETIONS])
def test_each_completions_parameter_is_served_or_refused_by_name(client: openai.OpenAI, field, value,
                                                                 refusal) -> None:
    create = client.completions.create
    if field in ("service_tier", "safety_identifier"):  # chat's fields, which the completions SDK sends in extra_body
        run(lambda **args: create(extra_body={field: args.pop(field)}, **args), field, value, refusal, prompt="Hi")
    else:
        run(create, field, value, refusal, prompt="Hi")
