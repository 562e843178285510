"""Pacing a rescale's state push to a latency objective (Megaphone's `max_latency_ms`): pure.

`PushPacer` is an AIMD controller: while the sink's recent p99 stays under the objective the
old owners' push rate grows by a step each period, and above it the rate halves, never below a
floor so that the move always completes. `recent_p99` reads the sinks' recent samples. No I/O,
`now` passed in. Used by `keyshift.runtime.rescale` (the coordinator paces, since only it sees
every sink's latency and every old owner).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

# A move under an objective it cannot meet still completes: at this many keys/s per old owner
# at the least (on-demand fetches move the keys records ask for meanwhile).
FLOOR_KEYS_PER_S = 1000.0
PERIOD_S = 1.0  # two instance reports: each decision sees fresh samples


@dataclass
class PushPacer:
    """The push rate for an objective, decided once a period from the sinks' recent samples
    ((emitted at, latency) in epoch seconds)."""

    objective_s: float
    step_keys_per_s: float  # the additive increase per period (and the first rate)
    rate_keys_per_s: float = 0.0
    window_start: float = 0.0  # the samples after it are this period's
    worst_p99_s: float | None = None
    rates: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rate_keys_per_s = max(self.step_keys_per_s, FLOOR_KEYS_PER_S)
        self.rates.append(self.rate_keys_per_s)

    def start(self, now: float) -> None:
        """State starts moving (each step of a batched rescale): judge from now on."""
        self.window_start = now

    def decide(self, now: float, samples: Iterable[tuple[float, float]]) -> float | None:
        """The new rate when a period has passed and its p99 changes the rate, else None.
        A period with no samples (no record reached a sink) judges nothing."""
        if now - self.window_start < PERIOD_S:
            return None
        p99 = self.finish(samples)
        self.window_start = now
        if p99 is None:
            return None
        if p99 > self.objective_s:
            rate = max(FLOOR_KEYS_PER_S, self.rate_keys_per_s / 2)
        else:
            rate = self.rate_keys_per_s + self.step_keys_per_s
        if rate == self.rate_keys_per_s:
            return None
        self.rate_keys_per_s = rate
        self.rates.append(rate)
        return rate

    def finish(self, samples: Iterable[tuple[float, float]]) -> float | None:
        """The p99 of the period so far, counted in the worst seen (also the move's tail after
        the last decision)."""
        p99 = recent_p99(samples, self.window_start)
        if p99 is not None:
            self.worst_p99_s = max(self.worst_p99_s or 0.0, p99)
        return p99

    def met(self) -> bool | None:
        """Whether the worst p99 seen stayed within the objective (None: no samples)."""
        return None if self.worst_p99_s is None else self.worst_p99_s <= self.objective_s


def recent_p99(samples: Iterable[tuple[float, float]], since: float) -> float | None:
    """The p99 of the sinks' per-batch worst latencies (seconds) emitted after `since` (epoch
    seconds): an upper bound of the records' p99, since each sample is its batch's maximum."""
    values = [latency for at, latency in samples if at > since]
    return float(np.percentile(values, 99)) if values else None
