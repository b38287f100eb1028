"""Start a real `zhuzi serve` process on a free localhost port for the HTTP tests."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

START_TIMEOUT_S = 180.0


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
def running_server(log: Path, *args: str, inject: str = "") -> Iterator[ServerProcess]:
    """The embedded SmolLM2 in bf16 with a small KV pool (fast start), plus the given flags. inject: Python
    code the server process runs before it starts (a fault to plant in it)."""
    port = free_port()
    launch = ["-c", f"{inject}\nimport sys\nfrom zhuzi.cli import main\nmain(sys.argv[1:])"] if inject else [
        "-m", "zhuzi.cli"]
    command = [sys.executable, *launch, "serve", "--port", str(port), "--kv-cache-memory", "64MiB", *args]
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    server = ServerProcess(f"http://127.0.0.1:{port}", log, proc)
    try:
        _wait_healthy(server, proc)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


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
