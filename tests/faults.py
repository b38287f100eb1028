"""Faults to inject into a real engine: requests that slipped past validation, a sampler that breaks, and
faults planted in an engine wherever it runs (this process, or an engine core process started meanwhile)."""
from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from zhuzi.engine.core.scheduler import Scheduler
from zhuzi.sample.sampler import Sampler
from zhuzi.sampling_params import SamplingParams


class Unchecked(SamplingParams):
    """Parameters that skip SamplingParams' range checks, as a request that slipped past validation would."""

    def _validate(self) -> None:
        pass


class FailingSampler(Sampler):
    """The real sampler, except that a batch holding the culprit's row raises from the culprit's n-th step on."""

    def __init__(self, culprit: SamplingParams, from_step: int) -> None:
        self.culprit, self.from_step, self.steps = culprit, from_step, 0

    def __call__(self, logits, rows):
        if any(row.params is self.culprit for row in rows):
            self.steps += 1
            if self.steps >= self.from_step:
                raise RuntimeError("injected fault")
        return super().__call__(logits, rows)


# -- faults planted in the engine's classes; each returns its undo

def _patch(cls: type, name: str, replacement: Callable) -> Callable[[], None]:
    original = cls.__dict__[name]
    setattr(cls, name, replacement)
    return lambda: setattr(cls, name, original)


@dataclass(frozen=True)
class Gate:
    """Where a planted stall, in whichever process it runs, says that it has begun and hears that it may end:
    two files in a folder."""

    folder: Path

    def stall(self, request_prefix: str, at_step: int, seconds: float = 60.0) -> str:
        """stall_step through this gate, as planted() takes it."""
        return f"stall_step({request_prefix!r}, at_step={at_step}, seconds={seconds}, gate={str(self.folder)!r})"

    def hang(self, seconds: float) -> None:
        (self.folder / "stalled").touch()
        end = time.monotonic() + seconds
        while not (self.folder / "released").exists() and time.monotonic() < end:
            time.sleep(0.01)

    async def stalled(self, timeout: float = 60.0) -> None:
        """Until the stall has begun."""
        deadline = time.monotonic() + timeout
        while not (self.folder / "stalled").exists():
            assert time.monotonic() < deadline, "the planted stall never began"
            await asyncio.sleep(0.01)

    def release(self) -> None:
        (self.folder / "released").touch()


def stall_step(request_prefix: str, at_step: int, seconds: float, gate: str) -> Callable[[], None]:
    """The at_step-th step (from 1) holding a request whose id starts with request_prefix first hangs, as a
    deadlock or a kernel that never returns would: for seconds, or until the gate in folder gate is released."""
    schedule, seen = Scheduler.schedule, []

    def stalling(self: Scheduler):
        batch = schedule(self)
        if any(item.seq.request_id.startswith(request_prefix) for item in batch):
            seen.append(1)
            if len(seen) == at_step:
                Gate(Path(gate)).hang(seconds)
        return batch

    return _patch(Scheduler, "schedule", stalling)


def break_loop(request_id: str) -> Callable[[], None]:
    """Scheduling raises once the request request_id waits: the step loop's own state is broken."""
    schedule = Scheduler.schedule

    def broken(self: Scheduler):
        if any(seq.request_id == request_id for seq in self.waiting):
            raise RuntimeError("the scheduler's state is broken")
        return schedule(self)

    return _patch(Scheduler, "schedule", broken)


def fail_sampling(seed: int) -> Callable[[], None]:
    """The sampler raises for a batch holding a row of this seed, as for a request that slipped past
    validation and overflows there."""
    sample = Sampler.__call__

    def failing(self: Sampler, logits, rows):
        if any(row.params.seed == seed for row in rows):
            raise RuntimeError("injected fault: the sampler overflowed")
        return sample(self, logits, rows)

    return _patch(Sampler, "__call__", failing)


@contextmanager
def planted(*faults: str) -> Iterator[None]:
    """Plant faults (calls of this module's fault functions, as source: 'break_loop("x")') in this process and
    in every process started meanwhile: Python runs a sitecustomize module at start-up, spawned engine cores
    too. Undone here at the end."""
    tests = str(Path(__file__).parent)
    saved = os.environ.get("PYTHONPATH")
    with tempfile.TemporaryDirectory(prefix="zhuzi-fault-") as site:
        Path(site, "sitecustomize.py").write_text("import faults\n" + "".join(f"faults.{f}\n" for f in faults))
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [site, tests, saved]))
        undo = [eval(fault, globals()) for fault in faults]
        try:
            yield
        finally:
            for u in reversed(undo):
                u()
            if saved is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = saved
