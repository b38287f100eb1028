"""A server for a benchmark to load: `zhuzi serve` or a peer's (llama-server), started in a process group of its
own on a free port, given to the benchmark once /health answers, and stopped at the end; its log is shown if the
benchmark fails."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

START_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, server: subprocess.Popen, name: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1):
                return
        except OSError:  # not listening yet, or 503 while it loads
            if server.poll() is not None:
                raise SystemExit(f"{name} exited with code {server.returncode} before it was healthy") from None
            time.sleep(0.2)
    raise SystemExit(f"{name} was not healthy within {START_TIMEOUT_S:.0f} s")


@contextmanager
def serving(command: list[str], port: int, crash: bool = False) -> Iterator[str]:
    """The server `command` starts (listening on `port`); its URL once healthy. At the end it is asked to stop,
    or with crash killed (SIGKILL to the group: zhuzi's engine cores too)."""
    url = f"http://127.0.0.1:{port}"
    name = os.path.basename(command[0]) if command[0] != sys.executable else "zhuzi serve"
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_healthy(url, server, name)
            yield url
        except BaseException:
            log.seek(0)
            sys.stderr.write(log.read().decode(errors="replace")[-4000:])
            raise
        finally:
            if crash and server.poll() is None:
                os.killpg(server.pid, signal.SIGKILL)
            server.terminate()
            server.wait()


@contextmanager
def zhuzi_serve(flags: list[str], crash: bool = False) -> Iterator[str]:
    """`zhuzi serve` with these flags, from this interpreter; its URL once healthy."""
    port = free_port()
    with serving([sys.executable, "-m", "zhuzi.cli", "serve", "--port", str(port), *flags], port, crash) as url:
        yield url
