"""A hybrid model (Qwen3.5's shape: DeltaNet layers with a state per sequence beside an attention layer) served
through the real openai client: a chat's second turn reuses the first turn's pages and state, also after other
chats pushed them out of the pool into the host tier, and out of that into the disk tier, and its reply is the one
computed from scratch."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import tiny
from prometheus_client.parser import text_string_to_metric_families
from server_process import IN_THREAD, ServerProcess, running_server

from zhuzi import LLM, SamplingParams
from zhuzi.model.loader import load_model_config

TURN_1 = [{"role": "user", "content": "Name three rivers in Europe and say one thing about each of them."}]
FOLLOW_UP = {"role": "user", "content": "Which of them is the longest?"}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("qwen3_5")
    tiny.build("qwen3_5", directory, vocab_size=49152)
    return directory


@pytest.fixture(scope="module")
def server(model: Path) -> Iterator[ServerProcess]:
    state_bytes = load_model_config(model).state_bytes
    budget = 9 * state_bytes  # 4 state slots, the rest pages: other chats evict turn 1
    host = 20 * state_bytes  # 10 states, the rest pages: more chats evict turn 1 from host memory too
    with running_server(model / "server.log", str(model), "--dtype", "float32", "--num-threads", "1",
                        "--served-model-name", "hybrid", "--kv-cache-memory", str(budget),
                        "--kv-offload-memory", str(host), "--kv-offload-dir", str(model / "kv"), *IN_THREAD) as running:
        yield running


def state_tier_hits(server: ServerProcess) -> dict[str, float]:
    """Prompt tokens whose state came back from each tier."""
    text = httpx.get(server.url + "/metrics", timeout=60).text
    return {s.labels["tier"]: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == "zhuzi:kv_offload_hits_total" and s.labels["tier"].endswith("_states")}


def chat(client: openai.OpenAI, messages: list[dict]):
    return client.chat.completions.create(model="hybrid", messages=messages, temperature=0, max_tokens=16)


def other_chats(client: openai.OpenAI, numbers: range) -> None:
    """Chats that take every page and state slot of the pool, pushing what was there into the tiers."""
    for i in numbers:
        chat(client, [{"role": "user", "content": f"Tell me about the number {i} in a few words."}])


def test_turn_two_computes_only_its_new_tokens_from_the_pool_the_host_and_the_disk_tier(server, model):
    client = openai.OpenAI(base_url=server.api, api_key="none", max_retries=0, timeout=300)
    first = chat(client, TURN_1)
    turn_2 = TURN_1 + [{"role": "assistant", "content": first.choices[0].message.content}, FOLLOW_UP]
    warm = chat(client, turn_2)
    cached = warm.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens // 16 * 16 > 0
    other_chats(client, range(4))
    evicted = chat(client, turn_2)
    assert evicted.usage.prompt_tokens_details.cached_tokens == cached
    # the state after the last cached page came back from host memory
    assert state_tier_hits(server) == {"host_states": 16, "disk_states": 0}
    other_chats(client, range(4, 12))
    from_disk = chat(client, turn_2)
    assert from_disk.usage.prompt_tokens_details.cached_tokens == cached
    assert state_tier_hits(server) == {"host_states": 16, "disk_states": 16}
    cold = LLM(str(model), dtype="float32", enable_prefix_caching=False).chat(
        turn_2, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text
    replies = {c.choices[0].message.content for c in (warm, evicted, from_disk)}
    assert replies == {cold}
