"""Faults to inject into a real engine: requests that slipped past validation, and a sampler that breaks."""
from __future__ import annotations

from zhuzi.sampler import Sampler
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
