"""Prefill/decode hand-offs (vLLM's disaggregated prefill, pushed rather than pulled): a prefill replica
computes a prompt and ships its KV pages, known by their prefix hashes (and a hybrid model's state after the
last of them), to the decode replica that streams the reply. Handoffs is an engine's side of it;
ShipmentSockets carry the shipments between engine cores over ZeroMQ, ipc:// on one host, tcp:// across hosts."""
from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import torch
import zmq

from zhuzi.engine.core.kv.connector import STATE_DTYPE, KVConnector
from zhuzi.engine.core.kv.page_manager import PageManager
from zhuzi.engine.messages import Handoff, ShipmentHeader
from zhuzi.engine.sequence import Sequence

log = logging.getLogger("zhuzi")
PAGES_PER_SHIPMENT = 32  # a prefill replica that dies mid-transfer leaves the shipments sent so far usable
WAIT_S = 600.0  # a decode replica computes the prompt itself when nothing has come for this long (the front
# says so at once when the prefill replica dies or refuses; this is for what nobody saw: a busy prefill
# replica may take minutes to reach a long prompt)
SEND_QUEUE = 8  # shipments queued for one decode replica before more are dropped


@dataclass
class Shipment:
    """Pages (and with the last of them, the states after it: header.state) on their way from this (prefill)
    replica to a decode replica's address."""

    address: str
    header: ShipmentHeader
    pages: list[torch.Tensor]

    def frames(self) -> list[bytes | memoryview]:
        return [msgspec.msgpack.encode(self.header),
                *(memoryview(b.contiguous().view(torch.uint8).reshape(-1).numpy()) for b in self.pages)]


@dataclass
class Awaited:
    seqs: list[Sequence]
    deadline: float
    pages: int = 0  # adopted so far


@dataclass
class Handoffs:
    """Both ends of the hand-offs one engine takes part in, and their counts.

    The front sends the request to both replicas at once. The decode replica holds it back
    (Sequence.awaiting_kv) until the pages have come or the hand-off is given up; the prefill replica runs
    the prompt as a request of one greedy token, then its full pages before the last prompt token leave as
    shipments of at most PAGES_PER_SHIPMENT pages. A hybrid model's last shipment carries the state after its
    last page too (the prefill job keeps that state: Sequence.state_boundary). The decode replica adopts each
    page (and state) into its prefix cache as it arrives, so when the request is let go its prompt is found
    there and only the last few tokens are computed. A hand-off given up (the prefill replica died or refused,
    its pages were for another model, or nothing came within WAIT_S) lets the request go as it is: whatever
    pages arrived are used, the rest is computed there. Either way the decode replica alone emits the reply:
    nothing is lost or sent twice."""

    pages: PageManager
    connector: KVConnector
    outbox: list[Shipment] = field(default_factory=list)  # for engine_core_proc.py to send
    awaited: dict[str, Awaited] = field(default_factory=dict)  # transfer id -> held-back sequences
    sent: int = 0
    received: int = 0
    failed: int = 0
    pages_sent: int = 0
    pages_received: int = 0

    sending: dict[int, Handoff] = field(default_factory=dict)  # seq id -> where its prompt's pages go
    clock: Callable[[], float] = time.monotonic  # what WAIT_S is measured by

    def start(self, handoff: Handoff, seqs: list[Sequence]) -> None:
        if handoff.send_to is None:
            self.expect(handoff.transfer_id, seqs)
        else:
            self.sending[seqs[0].seq_id] = handoff
            seqs[0].ships_prompt = True

    # -- the prefill side

    def prompt_computed(self, seq: Sequence) -> None:
        """seq has its first token: if its prompt's pages are to go elsewhere, they go now (once)."""
        if (handoff := self.sending.pop(seq.seq_id, None)) is not None:
            assert handoff.send_to is not None
            self.ship(handoff.send_to, handoff.transfer_id, seq)

    def ship(self, address: str, transfer_id: str, seq: Sequence) -> None:
        """seq's prompt is in the prefix cache (seq itself may have ended): its full pages before the last prompt
        token go to address."""
        cached = self.pages.cached
        hashes = list(itertools.takewhile(cached.__contains__, seq.page_hashes[:(seq.num_prompt_tokens - 1) //
                                                                               self.pages.page_size]))
        count, ids = len(hashes), [cached[h] for h in hashes]
        digest = self.connector.layout.digest
        for start in range(0, max(count, 1), PAGES_PER_SHIPMENT):
            batch = slice(start, start + PAGES_PER_SHIPMENT)
            header = ShipmentHeader(transfer_id, digest, hashes[batch], start + PAGES_PER_SHIPMENT >= count)
            self.outbox.append(Shipment(address, header, [self.connector.read(b) for b in ids[batch]]))
        states = self.pages.states
        if states is not None and hashes and (slot := states.cached.get(hashes[-1])) is not None:
            self.outbox[-1].header.state = hashes[-1]
            self.outbox[-1].pages.append(self.connector.read_state(slot))
        self.sent += 1
        self.pages_sent += count

    def take_outbox(self) -> list[Shipment]:
        taken, self.outbox = self.outbox, []
        return taken

    # -- the decode side

    def expect(self, transfer_id: str, seqs: list[Sequence]) -> None:
        """Hold seqs back until transfer_id's pages have come (or the hand-off is given up)."""
        for seq in seqs:
            seq.awaiting_kv = True
        self.awaited[transfer_id] = Awaited(seqs, self.clock() + WAIT_S)

    def receive(self, header: ShipmentHeader, frames: list[zmq.Frame]) -> None:
        """A shipment has come: adopt its pages into the prefix cache; the last lets the request go."""
        waiting = self.awaited.get(header.transfer_id)
        if waiting is None:  # aborted, or given up already: its pages may still serve a later prompt
            return
        layout = self.connector.layout
        sizes = [layout.page_bytes] * len(header.hashes) + [layout.state_bytes] * (header.state is not None)
        if header.layout != layout.digest or [len(frame.buffer) for frame in frames] != sizes:
            log.warning("hand-off %s: pages for another model, dtype or layout; computing the prompt here",
                        header.transfer_id)
            self.give_up(header.transfer_id)
            return
        for h, frame in zip(header.hashes, frames):
            data = torch.frombuffer(bytearray(frame.buffer), dtype=layout.torch_dtype).view(layout.page_shape)
            if not self.pages.adopt(h, lambda page_id, data=data: self.connector.write(page_id, data)):
                break  # the pool is full: the rest is computed here
            waiting.pages += 1
        if header.state is not None and header.state in self.pages.cached:  # without its page it resumes nothing
            self._adopt_state(header.state, frames[-1])
        self.pages_received += len(header.hashes)
        if header.last:
            self.received += 1
            self._release(header.transfer_id)

    def _adopt_state(self, h: bytes, frame: zmq.Frame) -> None:
        layout = self.connector.layout
        data = torch.frombuffer(bytearray(frame.buffer), dtype=STATE_DTYPE).view(layout.state_shape)
        self.pages.adopt_state(h, lambda slot: self.connector.write_state(slot, data))

    def give_up(self, transfer_id: str) -> None:
        """The pages will not come (all of them): the request goes on here with what it has."""
        if transfer_id in self.awaited:
            self.failed += 1
            log.warning("hand-off %s given up after %d pages; the rest of the prompt is computed here",
                        transfer_id, self.awaited[transfer_id].pages)
            self._release(transfer_id)

    def expire(self) -> None:
        now = self.clock()
        for transfer_id in [t for t, w in self.awaited.items() if w.deadline <= now]:
            self.give_up(transfer_id)
        for transfer_id in [t for t, w in self.awaited.items() if all(s.finished for s in w.seqs)]:
            del self.awaited[transfer_id]  # aborted while it waited

    def _release(self, transfer_id: str) -> None:
        for seq in self.awaited.pop(transfer_id).seqs:
            seq.awaiting_kv = False


class ShipmentSockets:
    """The engine core's ZeroMQ sockets for shipments: one it binds to receive them (ipc:// for a local
    process, tcp:// on its node for a Ray actor), and one it connects to each decode replica it sends to."""

    def __init__(self, context: zmq.Context, bind: str):
        self.context = context
        self.inbox = context.socket(zmq.PULL)
        if bind.startswith("tcp://") and bind.count(":") == 1:  # a host only: any free port on it
            self.address = f"{bind}:{self.inbox.bind_to_random_port(bind)}"
        else:
            self.inbox.bind(bind)
            self.address = bind
        self._outboxes: dict[str, zmq.Socket] = {}

    def send(self, shipment: Shipment) -> None:
        """Never blocks: a decode replica that is gone (or hopelessly behind) loses the shipment, and its
        request goes on without it."""
        socket = self._outboxes.get(shipment.address)
        if socket is None:
            socket = self._outboxes[shipment.address] = self.context.socket(zmq.PUSH)
            socket.setsockopt(zmq.SNDHWM, SEND_QUEUE)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(shipment.address)
        try:
            socket.send_multipart(shipment.frames(), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            log.warning("hand-off %s: %s takes no more shipments; one was dropped", shipment.header.transfer_id,
                        shipment.address)

    def close(self) -> None:
        """A socket left open would keep its context's term() waiting for ever."""
        for socket in [self.inbox, *self._outboxes.values()]:
            socket.close(linger=0)

    def receive(self) -> list[tuple[ShipmentHeader, list[zmq.Frame]]]:
        """Every shipment waiting (an undecodable one is dropped with a warning)."""
        got = []
        while True:
            try:
                frames = self.inbox.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return got
            try:
                got.append((msgspec.msgpack.decode(frames[0].buffer, type=ShipmentHeader), frames[1:]))
            except msgspec.ValidationError as exc:
                log.warning("a shipment that cannot be read was dropped: %s", exc)
