"""The wire between the engine's front (core_client.py) and its cores (engine_core_proc.py): typed msgspec
structs as msgpack on ZeroMQ, commands one way (add a request or a probe, snapshot, unpin, abort, give up a
hand-off, shut down) and one Outputs per step the other; and the header of the KV shipments cores send each
other (kv/transfer.py). The structs wrap the engine's own dataclasses; the only tensor that crosses is an
inspection's logits, as float32 bytes."""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass

import msgspec
import torch

from zhuzi.engine.sequence import Probe, Tenant
from zhuzi.outputs import EngineSnapshot, EngineStats, RequestOutput
from zhuzi.sampling_params import InvalidRequest, SamplingParams, StructuredOutputError

# ---------------------------------------------------------------- front -> engine core

@dataclass(frozen=True)
class Handoff:
    """A request's part in a hand-off: on the prefill replica, send its prompt's pages to send_to (the decode
    replica's address); on the decode replica (send_to None), wait for them."""

    transfer_id: str
    send_to: str | None = None


class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    tenant: Tenant = Tenant()
    handoff: Handoff | None = None  # its part in a prefill/decode hand-off

    @classmethod
    def of(cls, request_id: str, prompt_token_ids: list[int], params: SamplingParams, tenant: Tenant = Tenant(),
           handoff: Handoff | None = None) -> AddRequest:
        """A JSON schema travels as its JSON text (the engine core parses it back, in the same order): msgpack
        holds no integer beyond 64 bits, and a schema may hold one (or be true or false, no msgpack map)."""
        constraint = params.structured_outputs
        if constraint is not None and constraint.json is not None and not isinstance(constraint.json, str):
            constraint = copy.copy(constraint)
            constraint.json = json.dumps(constraint.json)
            params = copy.copy(params)
            params.structured_outputs = constraint
        return cls(request_id, prompt_token_ids, params, tenant, handoff)


class AddProbe(msgspec.Struct, tag=True):
    """An inspection (the inspector's next-token logits, logit lens), batched with everyone's tokens."""

    request_id: str
    token_ids: list[int]
    probe: Probe


class Snapshot(msgspec.Struct, tag=True):
    request_id: str  # the call's, for the answer
    num_steps: int


class Abort(msgspec.Struct, tag=True):
    request_id: str


class GiveUpHandoff(msgspec.Struct, tag=True):
    """The prefill replica of this hand-off died or refused it: the decode replica computes the prompt."""

    transfer_id: str


class Unpin(msgspec.Struct, tag=True):
    request_id: str  # the call's, for the answer
    name: str


class Shutdown(msgspec.Struct, tag=True):
    pass


Command = AddRequest | AddProbe | Snapshot | Unpin | GiveUpHandoff | Abort | Shutdown


# ---------------------------------------------------------------- engine core -> front

class Ready(msgspec.Struct, tag=True):
    """The model is loaded: what the front needs to know of it."""

    replica: int
    pid: int
    model_path: str
    model_name: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    stats: EngineStats
    kv_address: str | None = None  # where prefill replicas send it KV pages
    embedding_size: int = 0  # an embedding's length (the hidden size)


class Refused(msgspec.Struct):
    """A request the engine would not admit: InvalidRequest's fields (or a plain ValueError's message), and
    StructuredOutputError's, so the front can name the request field the constraint came from."""

    request_id: str
    message: str
    param: str | None = None
    code: str | None = None
    invalid: bool = True  # InvalidRequest, else ValueError
    constraint: tuple[str, str] | None = None  # a StructuredOutputError's field and reason

    @classmethod
    def of(cls, request_id: str, exc: ValueError) -> Refused:
        if isinstance(exc, StructuredOutputError):
            return cls(request_id, str(exc), exc.param, exc.code, constraint=(exc.field, exc.reason))
        if isinstance(exc, InvalidRequest):
            return cls(request_id, str(exc), exc.param, exc.code)
        return cls(request_id, str(exc), invalid=False)

    def error(self) -> ValueError:
        if self.constraint is not None:
            return StructuredOutputError(*self.constraint)
        return InvalidRequest(self.param, self.message, self.code) if self.invalid else ValueError(self.message)


class Outputs(msgspec.Struct, tag=True):
    """One loop turn's news: at most one per step, so a step costs one send however many requests ran."""

    replica: int
    outputs: list[RequestOutput]
    refused: list[Refused]
    stats: EngineStats
    stored: list[bytes]  # prefix-cache page hashes registered this turn
    removed: list[bytes]  # and evicted


class Failed(msgspec.Struct, tag=True):
    """The engine core cannot go on (the model did not load, or the loop failed): its last word."""

    replica: int
    reason: str
    user_error: bool = False  # a bad path or option (ValueError, OSError): the user's to fix


class SnapshotTaken(msgspec.Struct, tag=True):
    replica: int
    request_id: str
    snapshot: EngineSnapshot


class Unpinned(msgspec.Struct, tag=True):
    replica: int
    request_id: str
    removed: bool  # False: no pin had that name
    stats: EngineStats  # without the pin's pages (no step may follow soon to say so)


Message = Ready | Outputs | SnapshotTaken | Unpinned | Failed


def _encode_tensor(obj: object) -> bytes:
    """An inspection's logits: float32 bytes (the only tensor that crosses)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    raise NotImplementedError(f"{type(obj).__name__} does not cross the process boundary")


def _decode_tensor(kind: type, obj: object) -> object:
    if kind is torch.Tensor and isinstance(obj, bytes):
        return torch.frombuffer(bytearray(obj), dtype=torch.float32)
    raise NotImplementedError(f"{kind} does not cross the process boundary")


encode = msgspec.msgpack.Encoder(enc_hook=_encode_tensor).encode
decode_command = msgspec.msgpack.Decoder(Command).decode
decode_message = msgspec.msgpack.Decoder(Message, dec_hook=_decode_tensor).decode


# ---------------------------------------------------------------- engine core -> engine core

class ShipmentHeader(msgspec.Struct):
    """The first frame of a shipment; one frame of raw K/V bytes per page follows (and for a hybrid model, in
    the last shipment, one of the states after the last page)."""

    transfer_id: str
    layout: bytes  # KVLayout.digest of the sender: a page is never adopted by another model or layout
    hashes: list[bytes]
    last: bool
    state: bytes | None = None  # the hash of the page that the states frame follows
