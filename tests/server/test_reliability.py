"""One request can never hurt another, against a real `zhuzi serve` (conftest.py's: SmolLM2, bf16): a 1 MB
prompt to tokenize leaves /health and a running stream alone, and 200 streams, 30 % of them cut mid-stream,
leave no KV page, running or waiting sequence behind."""
from __future__ import annotations

import asyncio
import gc
import json
import statistics
import time

import httpx
from server_process import ServerProcess

BIG_PROMPT = "Hello world, this is a test. " * (1_000_000 // 29)  # 1 MB, 276 k tokens


def metrics(server: ServerProcess) -> dict[str, float]:
    out = {}
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("zhuzi:") and "{" in line:
            name, labels = line.split("{", 1)
            reason = labels.split('finished_reason="')[1].split('"')[0] if "finished_reason" in labels else ""
            out[name + (f"{{{reason}}}" if reason else "")] = float(line.split()[-1])
    return out


def wait_for_idle(server: ServerProcess, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        now = metrics(server)
        idle = (now["zhuzi:num_requests_running"], now["zhuzi:num_requests_waiting"], now["zhuzi:kv_cache_usage_perc"])
        if idle == (0, 0, 0) or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


async def tokenize_beside_a_stream(url: str) -> dict:
    """Stream a long answer; once it is under way, tokenize BIG_PROMPT while probing /health every 50 ms.
    This process must not stall its own probes: it reads the 6 MB answer once they have stopped, and
    collects no garbage meanwhile (either holds its event loop 0.05-0.3 s, which the probes would count)."""
    chat = {"messages": [{"role": "user", "content": "Tell me a long story"}], "max_tokens": 2000,
            "ignore_eos": True, "temperature": 0, "stream": True}
    stamps: list[float] = []
    health: list[float] = []
    found: dict = {}
    async with httpx.AsyncClient(timeout=300) as http:
        async def tokenize() -> None:
            found["start"] = time.monotonic()
            response = await http.post(url + "/tokenize", json={"prompt": BIG_PROMPT})
            found["end"], found["status"], found["body"] = time.monotonic(), response.status_code, response.content

        async def probe() -> None:
            while "end" not in found:
                sent = time.monotonic()
                assert (await http.get(url + "/health")).status_code == 200
                health.append(time.monotonic() - sent)
                await asyncio.sleep(0.05)

        gc.disable()
        try:
            async with http.stream("POST", url + "/v1/chat/completions", json=chat) as stream:
                assert stream.status_code == 200
                work = None
                async for line in stream.aiter_lines():
                    if line.startswith("data: {"):
                        stamps.append(time.monotonic())
                    if len(stamps) == 30 and work is None:
                        work = asyncio.gather(tokenize(), probe())
                    if "end" in found:
                        break
            await work
        finally:
            gc.enable()
    gaps = [(a, b - a) for a, b in zip(stamps, stamps[1:])]
    return {"before": [g for t, g in gaps if t < found["start"]],
            "during": [g for t, g in gaps if found["start"] <= t < found["end"]],
            "health": health, "seconds": found["end"] - found["start"], "status": found["status"],
            "count": json.loads(found["body"])["count"]}


def test_a_1mb_tokenize_leaves_health_and_a_running_stream_alone(server: ServerProcess) -> None:
    """4 MB stalled /health for 10 s and froze running streams: tokenizing ran on the event loop, holding the GIL."""
    seen = asyncio.run(tokenize_beside_a_stream(server.url))
    assert (seen["status"], seen["count"]) == (200, 275857)
    before, during = statistics.median(seen["before"]), statistics.median(seen["during"])
    print(f"\n1 MB tokenize: {seen['seconds']:.1f} s; /health max {max(seen['health']) * 1e3:.0f} ms over "
          f"{len(seen['health'])} probes; stream gap median {before * 1e3:.0f} ms before, {during * 1e3:.0f} ms "
          f"during (max {max(seen['during']) * 1e3:.0f} ms, {len(seen['during'])} tokens)")
    # Against the stream's own pace before the tokenize (a loaded machine's steps are many times a quiet one's):
    # /health answers within a few steps, and the stream's tokens keep their pace, no gap near a stall.
    assert max(seen["health"]) < 10 * before
    assert len(seen["during"]) >= 10
    assert during < 2 * before and max(seen["during"]) < 50 * before


async def soak(url: str, streams: int, cut_share: float) -> list[str]:
    """streams concurrent chat streams; the first cut_share of them hang up after their first token.
    Returns how each ended: "cut", or the finish_reason of its last chunk (after [DONE])."""
    cut = int(streams * cut_share)
    limits = httpx.Limits(max_connections=streams + 10)

    async def one(i: int, http: httpx.AsyncClient) -> str:
        body = {"messages": [{"role": "user", "content": f"Count to {i}"}], "temperature": 0, "ignore_eos": True,
                "max_tokens": 64 if i < cut else 8, "stream": True}
        events = []
        async with http.stream("POST", url + "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line.removeprefix("data: "))
                if i < cut and '"content":"' in line and len(events) > 1:
                    return "cut"  # leaving the block closes the connection mid-stream
        assert events[-1] == "[DONE]"
        return json.loads(events[-2])["choices"][0]["finish_reason"]

    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        return await asyncio.gather(*(one(i, http) for i in range(streams)))


def test_200_streams_with_30_percent_cut_mid_stream_leave_every_page_free(server: ServerProcess) -> None:
    before = metrics(server)
    started = time.monotonic()
    endings = asyncio.run(soak(server.url, 200, 0.3))
    seconds = time.monotonic() - started
    after = wait_for_idle(server)
    assert endings.count("cut") == 60 and endings.count("length") == 140
    assert (after["zhuzi:num_requests_running"], after["zhuzi:num_requests_waiting"]) == (0, 0)
    assert after["zhuzi:kv_cache_usage_perc"] == 0  # every KV page is free again
    ended = {reason: after.get(f"zhuzi:request_success_total{{{reason}}}", 0) - before.get(
        f"zhuzi:request_success_total{{{reason}}}", 0) for reason in ("length", "abort")}
    print(f"\nsoak: 200 streams in {seconds:.1f} s; ended {ended}")
    assert ended["length"] + ended["abort"] == 200 and ended["abort"] > 0
    assert "Traceback" not in server.log.read_text()
