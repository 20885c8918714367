"""The per-step window of the sliding-window attention layers (SWAX stochastic window training).

For optimizer step t (0-based) the window is a pure function of (seed, t): a uniform number is derived
from a hash of the two (a counter-based draw, no RNG stream), and picks a window by its probability.
Every rank therefore draws the same window for the same step, and a resumed run draws the windows
the uninterrupted run would have drawn, whatever happened before. The last `anneal_fraction` of the
steps skip the draw and use the annealing window (the largest by default).
"""

import hashlib
import struct

from megabam.config.schema import WindowConfig


class WindowSampler:
    """`window(step)` → the window of every SWA layer at optimizer step `step` (0-based).

    Steps ≥ `anneal_start` = total_steps − round(anneal_fraction·total_steps) use `anneal_window`.
    A fixed window is `windows: [w], probabilities: [1.0]`.
    """

    def __init__(self, cfg: WindowConfig, seed: int, total_steps: int):
        self.windows = list(cfg.windows)
        self.probabilities = list(cfg.probabilities)
        self.anneal_fraction = cfg.anneal_fraction
        self.anneal_window = cfg.final_window()
        self.seed = seed
        self.total_steps = total_steps
        self.anneal_start = total_steps - round(cfg.anneal_fraction * total_steps)

    def uniform(self, step: int) -> float:
        """A number in [0, 1) that depends only on (seed, step): 53 bits of blake2b(seed, step)."""
        digest = hashlib.blake2b(struct.pack("<qq", self.seed, step), digest_size=8).digest()
        return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)

    def window(self, step: int) -> int:
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        if step >= self.anneal_start:
            return self.anneal_window
        u, cumulative = self.uniform(step), 0.0
        for window, p in zip(self.windows, self.probabilities):
            cumulative += p
            if u < cumulative:
                return window
        return self.windows[-1]  # u within rounding of 1 when the probabilities sum to 1 - ε

    def state_dict(self) -> dict:
        """Everything the draw depends on; the sampler holds no other state."""
        return {
            "windows": self.windows,
            "probabilities": self.probabilities,
            "anneal_fraction": self.anneal_fraction,
            "anneal_window": self.anneal_window,
            "seed": self.seed,
            "total_steps": self.total_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        """Check a checkpoint's sampler against this one; a resumed run must draw the same windows."""
        mine = self.state_dict()
        differing = [k for k in mine if state.get(k) != mine[k]]
        if differing or set(state) != set(mine):
            detail = ", ".join(
                f"{k}: checkpoint {state.get(k)!r} vs now {mine.get(k)!r}"
                for k in differing or sorted(set(state) ^ set(mine))
            )
            raise ValueError(f"window sampler differs from the checkpoint's ({detail})")

    def describe(self, step: int | None = None) -> str:
        """One line for the log: the schedule, or the window of `step`."""
        if step is not None:
            return f"window {self.window(step)} (step {step}{', annealing' if step >= self.anneal_start else ''})"
        draw = ", ".join(f"{w} with p={p:g}" for w, p in zip(self.windows, self.probabilities))
        anneal = (
            f"steps {self.anneal_start}..{self.total_steps - 1} use {self.anneal_window}"
            if self.anneal_start < self.total_steps
            else "no annealing"
        )
        return f"SWA window per step: {draw}; {anneal} (anneal_fraction={self.anneal_fraction:g}); seed {self.seed}"
