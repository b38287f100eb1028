"""`zhuzi serve` runs the step loop in an engine-core process of its own: when that process dies, the server
notices at once (/health 503, the streams in flight end with an error event) and exits 1 with a clear message."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
from serving import engine_pids, running_server
from test_lifecycle import stream_events


def test_killing_the_engine_process_ends_the_streams_and_stops_the_server(tmp_path):
    with running_server(tmp_path / "server.log") as server:
        (pid,) = engine_pids(server).values()
        assert pid != server.proc.pid

        async def main() -> tuple[list[list[str]], list[int], float]:
            async with httpx.AsyncClient(timeout=60) as http:
                starts = [asyncio.Event() for _ in range(2)]
                streams = [asyncio.ensure_future(stream_events(http, server.url, started, max_tokens=2000))
                           for started in starts]
                await asyncio.gather(*(started.wait() for started in starts))
                os.kill(pid, signal.SIGKILL)
                killed = time.monotonic()
                statuses = []
                while not statuses or statuses[-1] == 200:
                    statuses.append((await http.get(server.url + "/health")).status_code)
                noticed = time.monotonic() - killed
                return await asyncio.gather(*streams), statuses, noticed

        events, statuses, noticed = asyncio.run(main())
        print(f"\n/health said 503 {noticed * 1000:.0f} ms after the SIGKILL")
        assert statuses[-1] == 503 and noticed < 2.0
        for stream in events:
            assert stream[-1] == "[DONE]"
            error = json.loads(stream[-2])["error"]
            assert error["code"] == 503 and f"(pid {pid}) was killed by SIGKILL" in error["message"]
        assert server.proc.wait(timeout=30) == 1
        assert f"zhuzi: the engine core process (pid {pid}) was killed by SIGKILL" in server.log.read_text()
