"""The engine core's loop (EngineCoreProc): commands in from the front, one message of outputs out
after every step (messages.py, as msgpack on ZeroMQ), wherever it runs: a thread of the server's process
(inproc://), a local process (ipc://) or a Ray actor on any node (tcp://)."""
from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import signal
import time
from dataclasses import dataclass, field, replace

import msgspec
import zmq

from zhuzi.config import EngineConfig
from zhuzi.engine.core.engine_core import EngineCore
from zhuzi.engine.core.kv.transfer import ShipmentSockets
from zhuzi.engine.messages import (
    Abort,
    AddProbe,
    Failed,
    GiveUpHandoff,
    Outputs,
    Ready,
    Refused,
    Shutdown,
    Snapshot,
    SnapshotTaken,
    Unpin,
    Unpinned,
    decode_command,
    encode,
)
from zhuzi.outputs import RequestOutput

log = logging.getLogger("zhuzi")
BEAT_MS = 1000  # the longest an engine core with work stays silent, and waits for KV pages between looks


@dataclass
class Addresses:
    """ZeroMQ endpoints the front has bound for one replica: its commands, and everyone's outputs; and where it
    binds its own socket for KV shipments (prefill/decode pairs only; a bare tcp://HOST takes a free port)."""

    commands: str
    outputs: str
    kv: str | None = None


# ---------------------------------------------------------------- the loop

@dataclass
class EngineCoreProc:
    """Drains the commands, runs a step while there is work, sends the news; blocks only while idle.

    The news of a step: every request it touched, the engine's stats, and the prefix-cache pages it stored
    and evicted (the front routes a conversation's next turn to the replica that holds its history).
    Prefill/decode replicas also ship KV pages to each other on sockets of their own (kv/transfer.py). The
    engine core knows nothing of HTTP; the front knows nothing of pages beyond their hashes."""

    engine: EngineCore
    replica: int
    commands: zmq.Socket
    outputs: zmq.Socket
    watched: list[tuple[int, str]] = field(default_factory=list)  # (fd, what its end means): stop when readable
    shipments: ShipmentSockets | None = None  # prefill/decode hand-offs
    _last_sent: float = 0.0
    _news: list[RequestOutput] = field(default_factory=list)
    _refused: list[Refused] = field(default_factory=list)
    _logprobs_sent: set[str] = field(default_factory=set)  # requests whose prompt logprobs went out
    _tiers_sent: dict = field(default_factory=dict)  # the KV tiers' counts in the last stats sent

    def run(self) -> str | None:
        """None once told to shut down; otherwise why it stopped (a watched process ended)."""
        poller = zmq.Poller()
        poller.register(self.commands, zmq.POLLIN)
        for fd, _ in self.watched:
            poller.register(fd, zmq.POLLIN)
        if self.shipments is not None:
            poller.register(self.shipments.inbox, zmq.POLLIN)
        ends = dict(self.watched)
        while True:
            # A request awaiting its KV pages is work, but none a step can do: wait for them, a beat at a time.
            # The disk tier's writer runs on after the last step: look again each beat until it is done, so that
            # the counts it moves reach the front (and /metrics) without waiting for the next request.
            waiting = self.engine.has_unfinished() or self._writing()
            idle = None if not waiting else 0 if self.engine.has_work() else BEAT_MS
            ready = dict(poller.poll(idle))
            if gone := [ends[fd] for fd in ends if fd in ready]:
                return gone[0]
            if not self._apply_commands():
                return None
            if self.shipments is not None:
                for header, frames in self.shipments.receive():
                    self.engine.kv.handoffs.receive(header, frames)
            if self.engine.has_unfinished():
                self._news += self.engine.step()
            if self.shipments is not None:
                for shipment in self.engine.kv.handoffs.take_outbox():
                    self.shipments.send(shipment)
            self._send_news()

    def _apply_commands(self) -> bool:
        """Every command waiting; False once told to shut down."""
        while True:
            try:
                payload = self.commands.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            try:
                command = decode_command(payload)
            except msgspec.ValidationError as exc:  # a front of another version: refuse what it sent, go on
                self._refuse_undecodable(payload, exc)
                continue
            if isinstance(command, Shutdown):
                return False
            if isinstance(command, Abort):
                if (out := self.engine.abort(command.request_id)) is not None:
                    self._news.append(out)
                continue
            if isinstance(command, Snapshot):
                taken = SnapshotTaken(self.replica, command.request_id, self.engine.snapshot(command.num_steps))
                self.outputs.send(encode(taken))
                continue
            if isinstance(command, GiveUpHandoff):
                if self.engine.kv.handoffs is not None:
                    self.engine.kv.handoffs.give_up(command.transfer_id)
                continue
            if isinstance(command, Unpin):
                removed = self.engine.kv.pins.remove(command.name)
                self.outputs.send(encode(Unpinned(self.replica, command.request_id, removed, self.engine.stats())))
                continue
            try:
                if isinstance(command, AddProbe):
                    self.engine.add_probe(command.request_id, command.token_ids, command.probe)
                else:
                    self.engine.add_request(command.request_id, command.prompt_token_ids, command.params,
                                            tenant=command.tenant, handoff=command.handoff)
            except ValueError as exc:  # InvalidRequest among them
                self._refused.append(Refused.of(command.request_id, exc))

    def _refuse_undecodable(self, payload: bytes, exc: msgspec.ValidationError) -> None:
        log.error("replica %d: a command it cannot read: %s", self.replica, exc)
        command = msgspec.msgpack.decode(payload)
        if isinstance(command, dict) and isinstance(command.get("request_id"), str):
            self._refused.append(Refused(command["request_id"], f"the engine core could not read the request: {exc}",
                                         invalid=False))

    def _send_news(self) -> None:
        events = self.engine.pages.events
        # While it holds work it says so at least every beat, so that the front never takes it for stalled.
        beat = self.engine.has_unfinished() and time.monotonic() - self._last_sent > BEAT_MS / 1000
        if not (self._news or self._refused or events.stored or events.removed or beat or self._tiers_moved()):
            return
        self._last_sent = time.monotonic()
        outputs = [self._lean(out) for out in self._news]
        stored, removed = events.take()
        stats = self.engine.stats()
        self._tiers_sent = stats.kv_tiers
        self.outputs.send(encode(Outputs(self.replica, outputs, self._refused, stats, stored, removed)))
        self._news, self._refused = [], []

    def _writing(self) -> bool:
        connector = self.engine.kv.connector
        return connector is not None and connector.writing

    def _tiers_moved(self) -> bool:
        """The KV tiers' counts differ from those last sent (the disk writer moves them between steps)."""
        connector = self.engine.kv.connector
        return connector is not None and connector.stats() != self._tiers_sent

    def _lean(self, out: RequestOutput) -> RequestOutput:
        """What the front does not have yet: it knows the prompt it sent, needs the timings once (at the end)
        and the prompt logprobs once (they grow no more), so no message repeats a growing list."""
        logprobs = out.prompt_logprobs if out.request_id not in self._logprobs_sent else None
        if logprobs is not None:
            self._logprobs_sent.add(out.request_id)
        if out.finished:
            self._logprobs_sent.discard(out.request_id)
        return replace(out, prompt=None, prompt_token_ids=[], prompt_logprobs=logprobs,
                       metrics=out.metrics if out.finished else None)


def serve(config: EngineConfig, replica: int, addresses: Addresses, watched: list[tuple[int, str]],
          context: zmq.Context | None = None) -> None:
    """Load the model and run the loop; the front hears Ready, then the news, then Failed if it ends badly.
    context: the front's own, when the engine core runs in a thread of its process (inproc:// addresses)."""
    own = context is None
    context = context or zmq.Context()
    commands = context.socket(zmq.PULL)
    commands.connect(addresses.commands)
    outputs = context.socket(zmq.PUSH)
    outputs.connect(addresses.outputs)
    shipments = None
    try:
        try:
            engine = EngineCore(config, kv_events=True, kv_transfers=addresses.kv is not None)
        except (ValueError, OSError) as exc:
            outputs.send(encode(Failed(replica, str(exc), user_error=True)))
            return
        except BaseException as exc:
            log.exception("replica %d failed to load the model", replica)
            outputs.send(encode(Failed(replica, f"{type(exc).__name__}: {exc}")))
            return
        gc.collect()
        gc.freeze()  # the loaded engine is here to stay: no collection walks it again (a pause between steps)
        shipments = ShipmentSockets(context, addresses.kv) if addresses.kv is not None else None
        outputs.send(encode(Ready(replica, os.getpid(), str(engine.model_path), engine.model_name,
                                  engine.model_config.vocab_size, engine.max_model_len, engine.eos_ids,
                                  engine.stats(), shipments.address if shipments else None,
                                  engine.model_config.hidden_size)))
        try:
            core = EngineCoreProc(engine, replica, commands, outputs,
                              watched + [(p.sentinel, f"{p.name} has exited") for p in engine.workers], shipments)
            if (reason := core.run()) is not None:
                log.error("replica %d: %s; the engine core stops", replica, reason)
                outputs.send(encode(Failed(replica, reason)))
        except BaseException as exc:  # the engine's state may be broken: nothing more may run on it
            if isinstance(exc, zmq.ContextTerminated):
                raise
            log.critical("replica %d: the engine loop failed", replica, exc_info=exc)
            outputs.send(encode(Failed(replica, f"the engine failed: {type(exc).__name__}: {exc}")))
        finally:
            engine.shutdown()
    except zmq.ContextTerminated:
        pass  # an engine thread's front closed while it loaded or stepped (EngineCoreClient.close): nobody to tell
    finally:
        if shipments is not None:
            shipments.close()
        commands.close(linger=0)
        outputs.close(linger=1000)  # the last message still goes out
        if own:
            context.term()


def run_thread(config: EngineConfig, replica: int, addresses: Addresses, context: zmq.Context) -> None:
    """The entry point of an engine core in a thread of the server's process (--no-engine-process).

    The thread loads the model and runs the loop for the life of the server: the thread that first runs
    torch must live on, since once the thread that started OpenMP's first team exits, libgomp makes every
    later team much slower (docs/benchmarks.md)."""
    serve(config, replica, addresses, [], context)


def run_process(config: EngineConfig, replica: int, addresses: Addresses) -> None:
    """The entry point of a local engine-core process (spawned or forked by the front)."""
    # force: a forked engine core has the front's handlers, whose lines would not say which replica wrote them
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s zhuzi.engine[{replica}]: %(message)s",
                        force=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Ctrl-C in a terminal (or a supervisor's SIGTERM to the whole group) is for the server, which drains and
    # then stops its engine cores: an engine core that died of it first would fail the requests draining.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    # The front's end makes its sentinel readable: an orphaned engine core exits rather than linger.
    watched = [(parent.sentinel, "the server process has exited")] if parent is not None else []
    serve(config, replica, addresses, watched)


class CoreActor:
    """The engine core as a Ray actor (placement.py wraps it with ray.remote, so that importing zhuzi never
    imports Ray): Ray places it and watches it, the same loop and sockets carry its work."""

    def run(self, config: EngineConfig, replica: int, addresses: Addresses) -> None:
        """Returns only when the loop ends; the front awaits it to learn that the replica is gone."""
        import ray

        logging.basicConfig(level=logging.INFO)
        if addresses.kv is not None:  # shipments come to this actor's node
            addresses = replace(addresses, kv=f"tcp://{ray.util.get_node_ip_address()}")
        serve(config, replica, addresses, [])
