"""Pearson's chi-square test of sampled outputs against their exact distribution, for the sampling tests.
Every test that uses it draws from seeded generators, so its verdict is the same on every run."""
from __future__ import annotations

from collections.abc import Hashable

import torch


def chi_square_p(samples: list[Hashable], expected: dict[Hashable, float]) -> float:
    """p-value of the samples under the expected distribution; cells expecting < 5 are pooled."""
    n = len(samples)
    counts = dict.fromkeys(expected, 0)
    for s in samples:
        counts[s] += 1  # a KeyError here would be an output the distribution cannot produce
    big = [s for s, p in expected.items() if p * n >= 5]
    small = [s for s, p in expected.items() if p * n < 5]
    observed = [counts[s] for s in big] + [sum(counts[s] for s in small)]
    wanted = [expected[s] * n for s in big] + [sum(expected[s] for s in small) * n]
    if wanted[-1] < 5:  # too little pooled mass for a cell of its own: fold it into the first
        observed[0] += observed.pop()
        wanted[0] += wanted.pop()
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, wanted))
    df = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))
