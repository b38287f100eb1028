"""The server process's end: uvicorn with a graceful shutdown. The first SIGTERM or SIGINT drains (Server.drain),
a second ends the running requests at once; the process then exits 0 (a failed server exits non-zero).
"""
from __future__ import annotations

import asyncio
import socket
from types import FrameType

import uvicorn

from zhuzi.server.common.serving import Server


class GracefulServer(uvicorn.Server):
    draining: asyncio.Task | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: the event loop does the work. The signal is not recorded, so uvicorn does not
        # raise it again on the way out (which would end the process with its status, not 0).
        self.loop.call_soon_threadsafe(self._on_signal)

    def _on_signal(self) -> None:
        server: Server = self.config.app.state.server
        if self.draining is None:
            self.draining = asyncio.ensure_future(self._drain(server))
        else:
            server.hurry()

    async def _drain(self, server: Server) -> None:
        await server.drain(server.config.shutdown_timeout)
        self.should_exit = True
