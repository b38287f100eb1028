"""Start a real `zhuzi serve` process on a free localhost port for the HTTP tests."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

START_TIMEOUT_S = 180.0
# Where a test does not need the engine's own process: its engine in a thread of the server process, one interpreter
# start fewer (seconds)
IN_THREAD = ("--no-engine-process",)


@dataclass
class ServerProcess:
    url: str  # http://127.0.0.1:PORT
    log: Path
    proc: subprocess.Popen
    health_statuses: list[int] = field(default_factory=list)  # what /health said while starting

    @property
    def api(self) -> str:
        return self.url + "/v1"

    def get(self, path: str) -> dict:
        response = httpx.get(self.url + path, timeout=120)
        response.raise_for_status()
        return response.json()

    def post(self, path: str, body: dict) -> dict:
        response = httpx.post(self.url + path, json=body, timeout=120)
        response.raise_for_status()
        return response.json()

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(log: Path, *args: str, inject: str = "", env: dict[str, str] | None = None,
                   wait: bool = True) -> Iterator[ServerProcess]:
    """The embedded SmolLM2 in bf16 with a small KV pool (fast start) and its responses store beside the log,
    plus the given flags. inject: Python code that every process of the server runs as it starts, the engine
    cores' too (a fault to plant); env: variables to add to the server's environment; wait: for /health to
    say 200 first."""
    port = free_port()
    command = [sys.executable, "-m", "zhuzi.cli", "serve", "--port", str(port), "--kv-cache-memory", "64MiB", *args]
    if "--responses-store" not in args:  # beside the log, never in the user's cache directory
        command += ["--responses-store", str(log.with_suffix(".sqlite3"))]
    environment = {**os.environ, **(env or {})}
    with tempfile.TemporaryDirectory(prefix="zhuzi-inject-") as site:
        if inject:  # Python imports sitecustomize at start-up, in spawned processes too
            Path(site, "sitecustomize.py").write_text(inject)
            environment["PYTHONPATH"] = os.pathsep.join(filter(None, [site, environment.get("PYTHONPATH")]))
        with open(log, "w") as out:
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=environment)
        server = ServerProcess(f"http://127.0.0.1:{port}", log, proc)
        try:
            if wait:
                _wait_healthy(server, proc)
            yield server
        finally:
            stop(proc, 15)


def stop(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM, and SIGKILL if it has not exited within grace_s."""
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def engine_pids(server: ServerProcess) -> dict[int, int]:
    """replica -> pid of its engine core, as the server logged them."""
    pattern = re.compile(r"engine core (\d+) ready: pid (\d+)")
    return {int(m[1]): int(m[2]) for m in pattern.finditer(server.log.read_text())}


def _wait_healthy(server: ServerProcess, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"zhuzi serve exited with {proc.returncode}:\n{server.log_tail()}")
        try:
            status = httpx.get(server.url + "/health", timeout=2).status_code
        except httpx.TransportError:
            status = None  # not listening yet
        if status is not None:
            server.health_statuses.append(status)
            if status == 200:
                return
        time.sleep(0.05)
    raise RuntimeError(f"zhuzi serve not healthy after {START_TIMEOUT_S} s:\n{server.log_tail()}")
