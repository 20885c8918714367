"""Means with bootstrap intervals, for the reproduction tables (passkey prompts within seeds, MQAR
cells over seeds).

A score is measured on a few seeds, each on a number of prompts (or samples). Both vary: a seed is a
different trained model, a prompt a different question to it. The interval resamples both levels
(Davison & Hinkley, "Bootstrap Methods", 1997, §3.8): draw the seeds with replacement, then within
each drawn seed its prompts with replacement, and take the mean of the per-seed means; the interval
is the percentile interval of that mean over the resamples. With one seed it is the ordinary
bootstrap over prompts; with one value per seed, over seeds alone. Three seeds cannot give an
interval narrower than their own spread: drawing the same extreme seed three times has probability
1/27 > 2.5 %, so a 95 % interval reaches the lowest and the highest seed's score (exactly with one
value per seed; beyond them when the prompts inside those seeds are redrawn too).
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Interval:
    mean: float  # of the per-seed means (each seed weighs the same)
    low: float
    high: float

    def __str__(self) -> str:
        return f"{self.mean:.2f} [{self.low:.2f}, {self.high:.2f}]"


def bootstrap_mean(groups: list[list[float]], level: float = 0.95, resamples: int = 10_000, seed: int = 0) -> Interval:
    """The mean of the groups' means with its two-level percentile bootstrap interval (module
    docstring); `groups` holds each seed's outcomes (at least one each)."""
    if not groups or any(len(g) == 0 for g in groups):
        raise ValueError(f"every group needs at least one value, got sizes {[len(g) for g in groups]}")
    generator = torch.Generator().manual_seed(seed)
    values = [torch.tensor(g, dtype=torch.float64) for g in groups]
    drawn = torch.randint(0, len(groups), (resamples, len(groups)), generator=generator)
    total = torch.zeros(resamples, dtype=torch.float64)
    for g, v in enumerate(values):  # every slot of every resample that drew seed g: its prompts redrawn
        times = int((drawn == g).sum())
        picks = torch.randint(0, len(v), (times, len(v)), generator=generator)
        total.index_add_(0, (drawn == g).nonzero()[:, 0], v[picks].mean(-1))
    means = total / len(groups)
    tail = (1 - level) / 2
    low, high = torch.quantile(means, torch.tensor([tail, 1 - tail], dtype=torch.float64)).tolist()
    return Interval(sum(v.mean().item() for v in values) / len(values), low, high)
