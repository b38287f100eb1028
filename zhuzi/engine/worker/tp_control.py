"""Tensor parallelism's control plane: rank 0's model runner posts each step's work (a forward pass, an
LM-head call) to the group's store, and the other ranks, which only follow (tp_worker.py), run the same
work over their slices. The model holds only the data plane (its slices, all-reduce, the vocabulary
gather); what to run, and when, is decided here.
"""
from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zhuzi.model.attention import AttentionMetadata, PrefillChunk
from zhuzi.model.parallel import TPRank
from zhuzi.model.recurrent import StateRun

# The followers wait for their next step as long as the server idles, in turns of IDLE_WAIT.
IDLE_WAIT = datetime.timedelta(hours=1)
FORWARD, LOGITS, STOP = "forward", "logits", "stop"


@dataclass
class StepChannel:
    """The ops of one group, numbered in order: posted by rank 0, taken by the others."""

    tp: TPRank
    _step: int = 0  # the ops posted (rank 0) or taken (the others)

    def post(self, op: str, payload: torch.Tensor | None = None) -> None:
        """Tell the followers what to run next; a payload goes as raw bytes beside it."""
        self._step += 1
        data = b"" if payload is None else payload.contiguous().cpu().view(torch.uint8).numpy().tobytes()
        header = f"{op},{'' if payload is None else str(payload.dtype).removeprefix('torch.')},"
        header += ",".join(map(str, payload.shape if payload is not None else ()))
        self.tp.store.set(f"op/{self._step}", header.encode() + b";" + data)

    def done(self) -> None:
        """The op just posted has run on every rank (its collective is behind us): its key can go."""
        self.tp.store.delete_key(f"op/{self._step}")

    @contextlib.contextmanager
    def posted(self, op: str, payload: torch.Tensor) -> Iterator[None]:
        """Rank 0 runs its share of op inside: posted before, its key removed after."""
        self.post(op, payload)
        yield
        self.done()

    def next_op(self) -> tuple[str, torch.Tensor | None]:
        """Wait, however long the server idles, for rank 0's next op."""
        self._step += 1
        self.tp.store.set_timeout(IDLE_WAIT)
        while True:
            try:
                raw = self.tp.store.get(f"op/{self._step}")
                break
            except dist.DistStoreError as exc:
                if "timeout" not in str(exc):
                    raise
        header, _, data = raw.partition(b";")
        op, dtype, *shape = header.decode().split(",")
        if not dtype:
            return op, None
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype))
        return op, flat.view(*map(int, filter(None, shape))).to(self.tp.device)


# ---------------------------------------------------------------- a step's inputs as one tensor

def pack_step(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Everything a follower needs to run the same forward pass, as one int64 tensor."""
    num_decodes = meta.num_decode_tokens
    width = meta.decode_slots.shape[1] if num_decodes else 0
    runs = [x for run in meta.state_runs for x in _packed_run(run)]
    header = [len(input_ids), num_decodes, width, len(meta.prefills), len(runs)]
    header += [x for c in meta.prefills for x in (c.start, c.length, c.context)] + runs
    parts = [torch.tensor(header), input_ids, positions, meta.slot_mapping]
    if num_decodes:
        parts += [meta.decode_slots.reshape(-1), meta.decode_lengths]
    parts += [c.slots for c in meta.prefills]
    return torch.cat([p.to("cpu", torch.long) for p in parts])


def _packed_run(run: StateRun) -> list[int]:
    """A hybrid model's run as ints (-1: none): six, then its snapshots' (rows, slot) pairs."""
    return [run.start, run.length, run.slot, -1 if run.restore is None else run.restore, int(run.fresh),
            len(run.snapshots)] + [x for pair in run.snapshots for x in pair]


def _unpacked_runs(flat: list[int]) -> list[StateRun]:
    runs, at = [], 0
    while at < len(flat):
        start, length, slot, restore, fresh, n = flat[at:at + 6]
        pairs = flat[at + 6:at + 6 + 2 * n]
        runs.append(StateRun(start, length, slot, tuple(zip(pairs[::2], pairs[1::2])),
                             None if restore < 0 else restore, bool(fresh)))
        at += 6 + 2 * n
    return runs


def unpack_step(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    tokens, num_decodes, width, num_prefills, run_ints = flat[:5].tolist()
    chunks = flat[5:5 + 3 * num_prefills].view(-1, 3).tolist()
    at = 5 + 3 * num_prefills + run_ints
    runs = _unpacked_runs(flat[at - run_ints:at].tolist())

    def take(n: int) -> torch.Tensor:
        nonlocal at
        at += n
        return flat[at - n:at]

    input_ids, positions, slot_mapping = take(tokens), take(tokens), take(tokens)
    decode_slots = take(num_decodes * width).view(num_decodes, width)
    decode_lengths = take(num_decodes)
    prefills = [PrefillChunk(start, length, context, take(context)) for start, length, context in chunks]
    return input_ids, positions, AttentionMetadata(slot_mapping, num_decodes, decode_slots, decode_lengths, prefills,
                                                   runs)
