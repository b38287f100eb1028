"""The tokenizer's helper process: a server's long texts are encoded there, at low priority.

A low-priority thread would hold the server's GIL while it waits for the CPU, and every other thread, the event
loop's too, would wait with it (docs/reliability.md); a process holds nothing the server needs. It runs this
file as a script that imports only the tokenizers library (zhuzi's package imports torch), so it starts in a
tenth of a second.
"""
from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
from array import array
from collections.abc import Callable, Iterable, Sequence
from multiprocessing.connection import Connection
from typing import TypeVar

from tokenizers import Tokenizer as RustTokenizer

NICENESS = 10  # the engine's threads get ~10x its CPU share when both want it
LONG_TEXT = 1 << 16  # characters from which texts go to the process (shorter ones encode faster than a pipe trip)
WATCH_PERIOD_S = 0.5  # how often a caller waiting for the answer checks that the process lives
SLICE = 1 << 16  # items one C call converts: short enough that the event loop keeps its turn
T = TypeVar("T")


def in_slices(convert: Callable[[Sequence], Iterable[T]], items: Sequence) -> list[T]:
    """convert(items) as one list, made a slice at a time: one call over a million items would hold the GIL
    long enough to stall a server's event loop; between slices it gets its turn."""
    out: list[T] = []
    for i in range(0, len(items), SLICE):
        out += convert(items[i:i + SLICE])
    return out


def _serve(conn: Connection) -> None:
    """The helper's loop: the tokenizer's JSON first, then texts in, their ids (or the library's error) out,
    until the server hangs up."""
    # Ctrl-C in a terminal, or a supervisor's SIGTERM to the whole group, is for the server, which drains
    # first (a text being encoded may belong to a request draining); the server's hanging up ends this loop.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    try:
        tokenizer = RustTokenizer.from_str(conn.recv())
    except EOFError:
        return
    tokenizer.encode_special_tokens = True
    while True:
        try:
            texts = conn.recv()
        except EOFError:
            return
        try:
            encodings = tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        except Exception as exc:  # the caller's to raise
            conn.send(exc)
            continue
        conn.send([array("I", e.ids).tobytes() for e in encodings])


class EncoderProcess:
    """Encodes texts as the given tokenizer does with special-token parsing off, one call at a time."""

    def __init__(self, tokenizer: RustTokenizer) -> None:
        self.tokenizer_json = tokenizer.to_str()
        self.lock = threading.Lock()
        self.conn, self.process = self._start()
        # The helper ignores SIGTERM and ends when its pipe closes: hang up on the way out.
        atexit.register(self.hang_up)

    def hang_up(self) -> None:
        self.conn.close()

    def _start(self) -> tuple[Connection, subprocess.Popen]:
        ours, theirs = multiprocessing.Pipe()
        # -P: no script directory on sys.path, where zhuzi's config.py, tokenizer.py... would shadow modules
        process = subprocess.Popen([sys.executable, "-P", __file__, str(theirs.fileno())], pass_fds=[theirs.fileno()])
        theirs.close()
        # Low priority from its start on; the library's threads, started at the first texts, inherit it.
        os.setpriority(os.PRIO_PROCESS, process.pid, NICENESS)
        ours.send(self.tokenizer_json)
        return ours, process

    def encode(self, texts: list[str]) -> list[list[int]]:
        with self.lock:
            # Dead (out of memory?): the last call saw it go (its pipe may close before the process is reaped,
            # so poll() alone can still say it runs), or it died since. A new one serves this call.
            if self.conn.closed or self.process.poll() is not None:
                self.conn.close()
                self.conn, self.process = self._start()
            try:
                self.conn.send(texts)
                while not self.conn.poll(WATCH_PERIOD_S):
                    if self.process.poll() is not None:
                        raise EOFError
                answer = self.conn.recv()
            except (EOFError, OSError) as exc:
                self.conn.close()
                self.process.kill()  # in case it lives on without its pipe
                raise RuntimeError("the tokenizer process died") from exc
        if isinstance(answer, Exception):
            raise answer
        return [in_slices(array.tolist, array("I", ids)) for ids in answer]


if __name__ == "__main__":  # the helper: EncoderProcess runs this file with its end of the pipe
    _serve(Connection(int(sys.argv[1])))
