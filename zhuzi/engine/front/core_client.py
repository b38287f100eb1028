"""The engine's front (EngineCoreClient): starts the engine cores (placement.py), sends each request to
one of them (router.py) and streams its deltas back behind the EngineClient interface (client.py), so the
server never knows where the step loop runs."""
from __future__ import annotations

import asyncio
import itertools
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

import zmq

from zhuzi.config import EngineConfig, ParallelConfig, parse_bytes
from zhuzi.engine import messages
from zhuzi.engine.core import engine_core_proc
from zhuzi.engine.core.engine_core import check_token_ids
from zhuzi.engine.front import placement
from zhuzi.engine.front.client import EngineDead, Stream, final_inspection
from zhuzi.engine.front.placement import Replica, default_threads
from zhuzi.engine.front.router import PrefixRouter
from zhuzi.engine.sequence import PinSpec, Probe, Tenant
from zhuzi.outputs import EngineSnapshot, EngineStats, PinInfo, RequestOutput
from zhuzi.sample.grammar import GrammarCompiler, shared_compiler
from zhuzi.sampling_params import SamplingParams, StructuredOutputsParams
from zhuzi.tokenizer import Tokenizer

log = logging.getLogger("zhuzi")
PREFILL_JOB = "#prefill"  # a hand-off's prefill job is its request's id and this
PREFILL_PARAMS = SamplingParams(max_tokens=1, temperature=0)  # the prompt and one token, which nobody reads
READER_POLL_MS = 100  # how often the reader thread looks up from its sockets to see whether to stop


class EngineCoreClient:
    """Engine cores in a thread or in processes of their own, behind the EngineClient interface.

    The cores run in a thread of this process on inproc:// sockets (--no-engine-process), or as
    data_parallel_size processes of their own: local (mp, ipc://) or Ray actors on a local or existing Ray
    cluster (ray, tcp://). One reader thread receives every replica's messages and notices a replica's end at
    once (a local process's sentinel, a Ray actor's run() call returning, an engine thread's last word): its
    requests end with EngineDead, it leaves the rotation, the others keep serving; so does one silent for the
    stall timeout with work pending. health() reports a problem when none is left, or when the last one
    stalls."""

    tokenizer: Tokenizer  # these once started
    model_name: str
    max_model_len: int
    vocab_size: int
    embedding_size: int
    grammars: GrammarCompiler  # the front's own, to check constraints: errors then name the request's field

    def __init__(self, config: EngineConfig, parallel: ParallelConfig, fork: bool = False,
                 clock: Callable[[], float] = time.monotonic):
        """Nothing runs until launch() or start(); close() stops whatever they began, even while start() waits.
        fork: local engine-core processes are forked from this process, not spawned, and skip importing the
        engine again (seconds each): only for a caller that has run no torch operation and started no thread
        of its own yet (`zhuzi serve`, which launches before it loads anything). clock: what the replicas'
        heartbeats, and so their stalls, are measured by."""
        parallel.check(config)
        self.config = config
        self.parallel = parallel
        self.fork = fork
        self.clock = clock
        self.router = PrefixRouter(config.page_size)
        self._lock = threading.Lock()  # replicas' bookkeeping: the event loop and the reader thread share it
        self._ready = threading.Condition(self._lock)
        self._streams: dict[str, Stream] = {}
        self._prompts: dict[str, list[int]] = {}  # the prompt of each request in flight (not sent back)
        self._where: dict[str, Replica] = {}
        self._handoffs: dict[str, tuple[str, Replica]] = {}  # prefill job -> (its request, the decode replica)
        self._snapshot_ids = itertools.count()
        self._failure: str | None = None  # why the whole engine can run nothing more
        self._closing = False
        self._context = zmq.Context()
        self._outputs = self._context.socket(zmq.PULL)
        self._directory = tempfile.mkdtemp(prefix="zhuzi-")  # short: ipc paths must stay under 107 bytes
        self._inproc = f"inproc://{Path(self._directory).name}"
        self._reader = threading.Thread(target=self._read, name="zhuzi-engine-client", daemon=True)
        self.replicas: list[Replica] = []

    def launch(self) -> None:
        """Start the replicas, which load the model while the caller goes on; start() waits for them."""
        try:
            # The replicas share one disk tier folder: each keeps its share of the bound.
            disk = parse_bytes(self.config.kv_offload_disk) // self.parallel.data_parallel_size
            self._launch(replace(self.config, num_threads=default_threads(self.config, self.parallel),
                                 kv_offload_disk=disk))
        except BaseException:
            self.close()
            raise

    def start(self) -> EngineCoreClient:
        """Start the replicas (unless launch() has); returns once all have loaded the model (raises if any
        could not)."""
        if not self.replicas:
            self.launch()
        try:
            self._await_ready()
        except BaseException:
            self.close()
            raise
        info = self.replicas[0].ready
        assert info is not None
        self.tokenizer = Tokenizer.load(Path(info.model_path))
        self.model_name, self.max_model_len, self.vocab_size = info.model_name, info.max_model_len, info.vocab_size
        self.embedding_size = info.embedding_size
        self.grammars = shared_compiler(self.tokenizer.hf, info.vocab_size, info.eos_token_ids)
        # The grammar library's view of the tokenizer takes a second or so: built before a request needs it.
        threading.Thread(target=self.grammars.warm, name="zhuzi-grammar-warmup", daemon=True).start()
        return self

    # -- starting and stopping

    def _launch(self, config: EngineConfig) -> None:
        in_thread = not self.parallel.engine_process
        ray_backend = self.parallel.data_parallel_backend == "ray" and not in_thread
        host = placement.ray_node_ip() if ray_backend else None
        outputs = self._bind(self._outputs, host, "outputs")
        roles = self.parallel.kv_roles
        for index in range(self.parallel.data_parallel_size):
            commands = self._context.socket(zmq.PUSH)
            commands.setsockopt(zmq.SNDHWM, 0)  # a replica reads its commands every step: never drop one
            self.replicas.append(Replica(index, commands, role=roles[index]))
            kv = (f"ipc://{self._directory}/kv-{index}" if host is None else "tcp://") if self.parallel.handoffs \
                else None  # a Ray actor binds on its own node
            addresses = engine_core_proc.Addresses(self._bind(commands, host, f"commands-{index}"), outputs, kv)
            if in_thread:
                placement.start_thread(self.replicas[-1], config, addresses, self._context)
            elif ray_backend:
                placement.start_actor(self.replicas[-1], config, addresses)
            else:
                placement.start_process(self.replicas[-1], config, addresses, "fork" if self.fork else "spawn")
        self._reader.start()
        if ray_backend:
            threading.Thread(target=placement.watch_actors, args=(self.replicas, lambda: self._closing, self._gone,
                                                         lambda r: f"the engine core{self._which(r)}"),
                             name="zhuzi-ray-watch", daemon=True).start()

    def _await_ready(self) -> None:
        with self._ready:
            self._ready.wait_for(lambda: self._closing or all(r.ready or r.failure for r in self.replicas))
        if self._closing:
            raise RuntimeError("the engine client was closed while starting")
        if failed := [r.load_error or RuntimeError(r.failure) for r in self.replicas if r.failure]:
            raise failed[0]
        for r in self.replicas:
            assert r.ready is not None
            log.info("engine core %d ready: pid %d, %d KV pages (%s)", r.index, r.ready.pid, r.ready.stats.num_pages,
                     "thread" if r.thread else "Ray actor" if r.actor else "local process")

    def _bind(self, socket: zmq.Socket, host: str | None, name: str) -> str:
        if not self.parallel.engine_process:
            address = f"{self._inproc}/{name}"
            socket.bind(address)
            return address
        if host is None:
            address = f"ipc://{self._directory}/{name}"
            socket.bind(address)
            return address
        return f"tcp://{host}:{socket.bind_to_random_port(f'tcp://{host}')}"

    def close(self) -> None:
        """Stop every replica (asking first) and release the sockets."""
        if self._closing:
            return
        with self._ready:
            self._closing = True
            self._ready.notify_all()
        live = [r for r in self.replicas if r.failure is None]
        for r in live:
            r.send(messages.encode(messages.Shutdown()))
        placement.stop(self.replicas)
        if self._reader.is_alive():
            self._reader.join()
        # An engine thread still in a step (or loading) uses its own sockets of this context: destroying it would
        # close them from this thread, which is not thread-safe (the engine thread then failed on them). term()
        # ends that thread at its next socket call instead, in a thread of its own: close() does not wait.
        if any(r.thread is not None and r.thread.is_alive() for r in self.replicas):
            for socket in [self._outputs, *(r.commands for r in self.replicas)]:
                socket.close(linger=0)
            threading.Thread(target=self._context.term, name="zhuzi-engine-context", daemon=True).start()
        else:
            self._context.destroy(linger=0)
        shutil.rmtree(self._directory, ignore_errors=True)

    # -- the reader thread

    def _read(self) -> None:
        poller = zmq.Poller()
        poller.register(self._outputs, zmq.POLLIN)
        sentinels = {r.process.sentinel: r for r in self.replicas if r.process is not None}
        for fd in sentinels:
            poller.register(fd, zmq.POLLIN)
        threads = [r for r in self.replicas if r.thread is not None]
        while not self._closing:
            # An engine thread's last word is out before it ends: a thread seen ended here said it, or nothing.
            ended = [r for r in threads if not r.thread.is_alive()]
            try:
                events = dict(poller.poll(READER_POLL_MS))
                if self._outputs in events:
                    while True:
                        self._handle(messages.decode_message(self._outputs.recv(zmq.NOBLOCK)))
            except zmq.Again:
                pass
            for fd in [fd for fd in sentinels if fd in events]:
                poller.unregister(fd)
                replica = sentinels.pop(fd)
                if not self._closing:
                    self._gone(replica, f"the engine core process{self._which(replica)} {replica.process_end()}")
            for replica in ended:
                threads.remove(replica)
                if not self._closing:
                    self._gone(replica, f"the engine thread{self._which(replica)} has stopped")

    def _which(self, replica: Replica) -> str:
        return f" of replica {replica.index}" if len(self.replicas) > 1 else ""

    def _handle(self, message: messages.Message) -> None:
        replica = self.replicas[message.replica]
        if isinstance(message, (messages.SnapshotTaken, messages.Unpinned)):
            with self._lock:
                self._where.pop(message.request_id, None)
                if isinstance(message, messages.Unpinned):
                    replica.stats = message.stats
            answer = message.snapshot if isinstance(message, messages.SnapshotTaken) else message.removed
            self._deliver(message.request_id, answer)
            return
        if isinstance(message, messages.Failed):
            if replica.ready is None:  # it never loaded: the whole start fails
                replica.load_error = (ValueError if message.user_error else RuntimeError)(message.reason)
            self._gone(replica, f"{message.reason}{self._which(replica)}" if replica.ready else message.reason)
            return
        with self._lock:
            replica.heartbeat = self.clock()
            replica.stats = message.stats
            if isinstance(message, messages.Ready):
                replica.ready = message
                self._ready.notify_all()
                return
            self.router.update(replica.index, message.stored, message.removed)
            for out in message.outputs:
                out.prompt_token_ids = self._prompts.get(out.request_id, [])
                if out.finished:
                    self._forget(out.request_id)
                    self._end_handoff(out.request_id, give_up=out.error is not None)
            for refused in message.refused:
                self._forget(refused.request_id)
                self._end_handoff(refused.request_id, give_up=True)
        for out in message.outputs:
            self._deliver(out.request_id, out)
        for refused in message.refused:
            self._deliver(refused.request_id, refused.error())

    def _end_handoff(self, prefill_id: str, give_up: bool) -> None:
        """A prefill job has ended (under the lock); give_up: its pages will not come, so its decode replica
        computes the prompt itself."""
        request_id, decode = self._handoffs.pop(prefill_id, (None, None))
        if give_up and decode is not None and decode.failure is None:
            decode.send(messages.encode(messages.GiveUpHandoff(request_id)))

    def _forget(self, request_id: str) -> None:
        """The request has ended (under the lock)."""
        self._prompts.pop(request_id, None)
        if (replica := self._where.pop(request_id, None)) is not None:
            replica.requests.discard(request_id)

    def _deliver(self, request_id: str, item: RequestOutput | EngineSnapshot | Exception) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(item)

    def _gone(self, replica: Replica, reason: str) -> None:
        """Take a replica out of the rotation: its requests end with EngineDead(reason)."""
        with self._lock:
            if replica.failure is not None:
                return
            replica.failure = reason
            lost = [request_id for request_id, where in self._where.items() if where is replica]
            for request_id in lost:
                self._forget(request_id)
                self._end_handoff(request_id, give_up=True)
            for prefill_id in [p for p, (_, decode) in self._handoffs.items() if decode is replica]:
                self._handoffs.pop(prefill_id)  # its decode replica is gone: no one waits for the prompt
                if (prefill := self._where.get(prefill_id)) is not None:
                    prefill.send(messages.encode(messages.Abort(prefill_id)))
            lost = [request_id for request_id in lost if not request_id.endswith(PREFILL_JOB)]
            self.router.forget(replica.index)
            self._ready.notify_all()
            left = sum(r.failure is None for r in self.replicas)
        if self._closing or replica.ready is None:
            return
        log.error("%s; %d requests there end with an error, %d of %d replicas left", reason, len(lost), left,
                  len(self.replicas))
        for request_id in lost:
            self._deliver(request_id, EngineDead(reason))

    # -- the EngineClient interface

    def stats(self) -> EngineStats:
        """The live replicas' stats added up."""
        return EngineStats.total(list(self.replica_stats().values()))

    def replica_stats(self) -> dict[int, EngineStats]:
        return {r.index: r.stats for r in self.replicas if r.failure is None and r.stats is not None}

    def health(self, stall_timeout: float) -> str | None:
        """None while a replica serves; otherwise what is wrong. A replica with work that has been silent for
        stall_timeout seconds (0: never) is taken out of the rotation while others serve; the last one's stall
        is reported (and ends once it moves again, unless the caller fails the engine)."""
        if self._failure is not None:
            return self._failure
        now = self.clock()
        for r in self.replicas:
            silent = now - r.heartbeat
            if stall_timeout and r.failure is None and r.requests and silent > stall_timeout:
                stall = f"the engine{self._which(r)} has made no progress for {silent:.0f} s with requests pending"
                if sum(other.failure is None for other in self.replicas) == 1:
                    return stall
                self._gone(r, stall)
                r.kill()
        if all(r.failure is not None for r in self.replicas):
            return self.replicas[-1].failure if len(self.replicas) == 1 else \
                f"every replica has failed (the last: {self._last_failure()})"
        return None

    def _last_failure(self) -> str:
        return next(r.failure for r in reversed(self.replicas) if r.failure)  # type: ignore[misc]

    def fail(self, reason: str) -> None:
        """Declare the engine unusable: every open stream and every later request gets EngineDead(reason)."""
        if self._failure is None:
            self._failure = reason
        for request_id in list(self._streams):
            self._deliver(request_id, EngineDead(reason))

    def check_token_ids(self, ids: list[int], param: str) -> None:
        check_token_ids(ids, self.vocab_size, param)

    async def check_structured_output(self, params: StructuredOutputsParams) -> None:
        """Compile params' grammar here, in a worker thread (StructuredOutputError if it cannot be), as vLLM's
        front validates: the engine core compiles it again for its own use, from its own cache."""
        await asyncio.to_thread(self.grammars.matcher, params)

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       tenant: Tenant = Tenant()) -> AsyncIterator[RequestOutput]:
        """Yields deltas until the request finishes; closing the iterator aborts the request. A request the
        engine failed raises RequestError; EngineDead once its replica (or the whole engine) is gone."""
        ids = prompt if isinstance(prompt, list) else self.tokenizer.encode_prompt(prompt)
        prefill, decode = self._pair(ids, params)
        if prefill is None:
            command = messages.AddRequest.of(request_id, ids, params, tenant)
            stream = self._submit(request_id, ids, messages.encode(command), replica=decode)
        else:  # the decode replica waits for the pages the prefill replica computes and sends it
            stream = self._submit(request_id, ids, messages.encode(messages.AddRequest.of(
                request_id, ids, params, tenant, messages.Handoff(request_id))), replica=decode)
            address, prefill_id = self.replicas[decode].ready.kv_address, request_id + PREFILL_JOB
            with self._lock:
                self._handoffs[prefill_id] = (request_id, self.replicas[decode])
            self._submit(prefill_id, ids, messages.encode(messages.AddRequest.of(
                prefill_id, ids, PREFILL_PARAMS, tenant, messages.Handoff(request_id, address))), replica=prefill,
                listen=False)
        async for out in stream.read(request_id, self._streams, self.abort):
            yield out

    def _pair(self, ids: list[int], params: SamplingParams) -> tuple[int | None, int | None]:
        """The replica to run a request on, and the prefill replica to compute its prompt first (None: it runs
        alone, as samples of n > 1 and prompt logprobs do)."""
        with self._lock:
            live = {r.index: len(r.requests) for r in self.replicas if r.failure is None}
            serving = {i: n for i, n in live.items() if self.replicas[i].role != "prefill"}
            if not serving:
                return None, None  # _submit picks among what is left, or says the engine is dead
            alone = params.n > 1 or params.prompt_logprobs is not None
            prefill = {i: n for i, n in live.items() if self.replicas[i].role == "prefill" and not alone}
            return self.router.pick_pair(ids, prefill, serving, self.parallel.max_local_prefill_tokens)

    async def probe(self, token_ids: list[int], probe: Probe, request_id: str) -> RequestOutput:
        """An inspection through a replica's step loop (the one caching most of the context): its final
        output, whose .inspection holds the reading. Cancelling the caller aborts it in the engine."""
        stream = self._submit(request_id, token_ids, messages.encode(messages.AddProbe(request_id, token_ids, probe)))
        return await final_inspection(stream.read(request_id, self._streams, self.abort))

    async def snapshot(self, num_steps: int) -> EngineSnapshot:
        """The first live replica's state, taken between two of its steps."""
        request_id = f"snapshot-{next(self._snapshot_ids)}"
        stream = self._submit(request_id, [], messages.encode(messages.Snapshot(request_id, num_steps)), track=False)
        return await stream.answer(request_id, self._streams)

    async def pin(self, token_ids: list[int], spec: PinSpec, request_id: str) -> PinInfo:
        """Every live replica pins token_ids' full pages, so a chat finds them wherever it lands; if one cannot,
        none keeps the pin and its error is raised."""
        live = [r.index for r in self.replicas if r.failure is None]
        probes = [self._submit(f"{request_id}-{i}", token_ids, messages.encode(messages.AddProbe(
            f"{request_id}-{i}", token_ids, Probe(pin=spec))), replica=i) for i in live]
        outs = await asyncio.gather(*(final_inspection(stream.read(f"{request_id}-{i}", self._streams, self.abort))
                                      for i, stream in zip(live, probes)), return_exceptions=True)
        if errors := [out for out in outs if isinstance(out, BaseException)]:
            if len(errors) < len(outs):
                await self.unpin(spec.name)
            raise errors[0]
        assert outs[0].pin is not None
        return outs[0].pin

    async def unpin(self, name: str) -> bool:
        """Release the pin called name on every live replica; False if none had it."""
        answers = []
        for i in [r.index for r in self.replicas if r.failure is None]:
            request_id = f"unpin-{next(self._snapshot_ids)}"
            answers.append(self._submit(request_id, [], messages.encode(messages.Unpin(request_id, name)), track=False,
                                        replica=i).answer(request_id, self._streams))
        return any(await asyncio.gather(*answers))

    async def pins(self) -> list[PinInfo]:
        return (await self.snapshot(0)).pins

    def _submit(self, request_id: str, ids: list[int], command: bytes, track: bool = True,
                replica: int | None = None, listen: bool = True) -> Stream:
        """Send an encoded command to the replica given, or else to the one the router picks for ids; the stream
        its answers go to. track: the replica counts it as a request in flight (a snapshot is answered at once);
        listen: its answers are read (a prefill job's are not)."""
        if self._failure is not None:
            raise EngineDead(self._failure)
        stream = Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            load = {r.index: len(r.requests) for r in self.replicas if r.failure is None}
            if not load:
                raise EngineDead(self._last_failure())
            if replica is None or replica not in load:
                replica = self.router.pick(ids, load)
            replica = self.replicas[replica]
            if track:
                if not replica.requests:
                    replica.heartbeat = self.clock()  # it was idle: its silence so far is no stall
                replica.requests.add(request_id)
                self._prompts[request_id] = ids
            self._where[request_id] = replica
            if listen:
                self._streams[request_id] = stream
        replica.send(command)
        return stream

    def abort(self, request_id: str) -> None:
        """End a request now (and its prefill job); if its stream is still read, its last output says
        finish_reason "abort". A closed client's engine cores are gone or going: nothing to tell them."""
        for job in (request_id, request_id + PREFILL_JOB):
            replica = self._where.get(job)
            if replica is not None and replica.failure is None and not self._closing:
                replica.send(messages.encode(messages.Abort(job)))

