"""Where the engine cores run, for the front: a thread of the server's process, local processes (mp) or
Ray actors (ray); this module starts each Replica, watches a Ray actor's end and stops it. Ray is imported
only here and only when the ray backend runs, so importing zhuzi never imports Ray."""
from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any

import zmq

from zhuzi.config import EngineConfig, ParallelConfig
from zhuzi.engine import messages
from zhuzi.engine.core.engine_core_proc import Addresses, CoreActor, run_process, run_thread
from zhuzi.outputs import EngineStats

log = logging.getLogger("zhuzi")
SHUTDOWN_WAIT_S = 5.0  # how long replicas told to shut down get to end, in all
EXIT_CODE_WAIT_S = 1.0  # an ended process's sentinel fires as it ends; its exit code comes a moment later


@dataclass(eq=False)
class Replica:
    """One engine core, as the front sees it: the socket its commands go to, the thread, process or actor that
    runs it, and its bookkeeping."""

    index: int
    commands: zmq.Socket  # PUSH, bound by the front
    thread: threading.Thread | None = None  # in the front's process
    process: BaseProcess | None = None  # mp
    actor: Any = None  # ray
    run_ref: Any = None  # ray: resolves when the actor's loop ends
    ready: messages.Ready | None = None
    stats: EngineStats | None = None
    failure: str | None = None  # why it is out of the rotation
    load_error: Exception | None = None  # why it never got ready
    requests: set[str] = field(default_factory=set)  # in flight there
    heartbeat: float = field(default_factory=time.monotonic)  # its last message (or the work it got when idle)
    role: str = "both"  # prefill, decode or both (ParallelConfig.kv_role)
    _sending: threading.Lock = field(default_factory=threading.Lock)  # the event loop and the reader thread send

    def send(self, payload: bytes) -> None:
        """An encoded command; never blocks: a replica gone has no peer socket (its requests already heard)."""
        try:
            with self._sending:
                self.commands.send(payload, zmq.NOBLOCK)
        except zmq.Again:
            log.warning("replica %d is not connected; a command was not sent", self.index)

    def process_end(self) -> str:
        """How its process, now ended, ended: its pid and signal or exit code."""
        assert self.process is not None
        self.process.join(EXIT_CODE_WAIT_S)
        code = self.process.exitcode
        how = f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 else \
            f"exited with code {code}"
        return f"(pid {self.process.pid}) {how}"

    def kill(self) -> None:
        """End a process or actor now (a thread cannot be ended from outside)."""
        if self.process is not None:
            self.process.kill()
        elif self.actor is not None:
            end_actor(self, 0)


def default_threads(config: EngineConfig, parallel: ParallelConfig) -> int | None:
    """The cores shared out among every engine process (None: torch's default for a single one)."""
    processes = parallel.data_parallel_size * config.tensor_parallel_size
    return config.num_threads or (max(1, len(os.sched_getaffinity(0)) // processes) if processes > 1 else None)


def start_thread(replica: Replica, config: EngineConfig, addresses: Addresses, context: zmq.Context) -> None:
    replica.thread = threading.Thread(target=run_thread, args=(config, replica.index, addresses, context),
                                      name=f"zhuzi-engine-{replica.index}", daemon=True)
    replica.thread.start()


def stop(replicas: list[Replica]) -> None:
    """Wait (SHUTDOWN_WAIT_S in all) for replicas told to shut down to end; kill the processes and actors still
    running then. A thread cannot be killed: it may still be running after."""
    deadline = time.monotonic() + SHUTDOWN_WAIT_S
    for r in replicas:
        if r.thread is not None:
            r.thread.join(max(0.0, deadline - time.monotonic()))
        elif r.process is not None:
            r.process.join(max(0.0, deadline - time.monotonic()))
            if r.process.is_alive():
                r.process.kill()
                r.process.join()
        elif r.actor is not None:
            end_actor(r, max(0.0, deadline - time.monotonic()))


def start_process(replica: Replica, config: EngineConfig, addresses: Addresses, method: str) -> None:
    """method: spawn (a fresh interpreter) or fork, where the caller knows that no thread of its own holds a lock
    the child needs and that torch has not started its OpenMP team (a forked child's would hang)."""
    context = multiprocessing.get_context(method)
    replica.process = context.Process(target=run_process, args=(config, replica.index, addresses),
                                      name=f"zhuzi-engine-{replica.index}")
    replica.process.start()


# -- Ray

def init_ray(address: str | None) -> None:
    """Connect to Ray (or start a local one) from the main thread, before any thread runs: Ray started from
    another thread leaves helper processes behind at exit."""
    import ray

    if address is None:  # a Ray of our own, for this machine only: keep it on the loopback interface
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address=address, include_dashboard=False)


def ray_node_ip() -> str:
    """The address Ray actors on other nodes reach this one at."""
    import ray

    return ray.util.get_node_ip_address()


def start_actor(replica: Replica, config: EngineConfig, addresses: Addresses) -> None:
    import ray

    cpus = (config.num_threads or 1) * config.tensor_parallel_size
    actor_class = ray.remote(num_cpus=cpus)(CoreActor)
    replica.actor = actor_class.options(name=f"zhuzi-engine-{replica.index}-{os.getpid()}").remote()
    replica.run_ref = replica.actor.run.remote(config, replica.index, addresses)


def watch_actors(replicas: list[Replica], closing: Callable[[], bool], gone: Callable[[Replica, str], None],
                 name: Callable[[Replica], str]) -> None:
    """Until closing(): tell gone(replica, why) as each actor's run() call returns (its loop ended) or fails
    (the actor died). name(replica) says which engine core it is."""
    import ray

    pending = {r.run_ref: r for r in replicas}
    while pending and not closing():
        done, _ = ray.wait(list(pending), num_returns=1)
        for ref in done:
            replica = pending.pop(ref)
            try:
                ray.get(ref)
                reason = f"{name(replica)} ended"
            except Exception as exc:  # Ray's word for how the actor died
                reason = f"{name(replica)} (Ray actor) died: {type(exc).__name__}"
            if not closing():
                gone(replica, reason)


def end_actor(replica: Replica, wait: float) -> None:
    """Give the actor's loop wait seconds to return, then kill the actor."""
    import ray

    try:
        ray.get(replica.run_ref, timeout=wait)
    except Exception:  # still running, or already dead: make sure
        ray.kill(replica.actor)
