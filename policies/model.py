"""The values policies read and return: observed rates per stage and instance, recommendations.

A MetricsSource (keyshift.operator) builds a `ScalingInput` from Prometheus or from scraped
/metrics; a policy turns it into one `Recommendation` per stage; the guards turn those into
`Decision`s. All are plain frozen values, so a decision can be logged, shown and tested whole.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

Action = Literal["scale_up", "scale_down", "hold"]


@dataclass(frozen=True)
class InstanceRates:
    """One instance over the window: records per second in and out, busy seconds per second."""

    records_in: float
    records_out: float
    busy: float

    def valid(self) -> bool:
        values = (self.records_in, self.records_out, self.busy)
        return all(math.isfinite(v) and v >= 0 for v in values)


@dataclass(frozen=True)
class StageRates:
    """One stage over the window.

    `upstream` maps each upstream stage to the share of its output this stage receives (1.0 in
    a chain or when records are copied to every branch, 0.5 when split evenly in two). Sources
    have no upstream; their `offered` rate is what arrives from outside (None: what they emit),
    `backlog` the records that arrived but have not been taken in yet, and `client_backlog` the
    records an ingest source's clients report due but not pushed yet (still outside the job).
    """

    name: str
    parallelism: int
    instances: tuple[InstanceRates, ...]
    upstream: Mapping[str, float] = field(default_factory=dict)
    offered: float | None = None
    backlog: float = 0.0
    client_backlog: float = 0.0

    @property
    def is_source(self) -> bool:
        return not self.upstream

    @property
    def records_in(self) -> float:
        return sum(i.records_in for i in self.instances)

    @property
    def records_out(self) -> float:
        return sum(i.records_out for i in self.instances)

    @property
    def busy(self) -> float:
        """Mean busy fraction of the stage's instances (0..1)."""
        return sum(i.busy for i in self.instances) / max(len(self.instances), 1)

    def problem(self) -> str | None:
        """Why these rates cannot be trusted, or None."""
        if not self.instances:
            return f"no metrics for stage {self.name}"
        if not all(i.valid() for i in self.instances):
            return f"stage {self.name} has a NaN, infinite or negative rate"
        if self.offered is not None and not (math.isfinite(self.offered) and self.offered >= 0):
            return f"stage {self.name} has an invalid offered rate {self.offered}"
        if not (math.isfinite(self.backlog) and self.backlog >= 0):
            return f"stage {self.name} has an invalid backlog {self.backlog}"
        if not (math.isfinite(self.client_backlog) and self.client_backlog >= 0):
            return f"stage {self.name} has an invalid client backlog {self.client_backlog}"
        return None


@dataclass(frozen=True)
class ScalingInput:
    """What a policy sees at `now`: every stage, sources first (topological order)."""

    now: float
    window: float
    stages: tuple[StageRates, ...]

    def stage(self, name: str) -> StageRates:
        return next(s for s in self.stages if s.name == name)


@dataclass(frozen=True)
class Recommendation:
    """A policy's answer for one stage, with the inputs it used and why, in words."""

    stage: str
    current: int
    recommended: int
    reason: str
    inputs: Mapping[str, float] = field(default_factory=dict)
    scalable: bool = True  # False: a source, whose rate is given; reported, never applied


@dataclass(frozen=True)
class Decision:
    """A guarded recommendation: what the loop does for a stage at `at`, and why."""

    stage: str
    at: float
    policy: str
    current: int
    recommended: int
    target: int
    action: Action
    reason: str
    inputs: Mapping[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        return {
            "stage": self.stage,
            "at": self.at,
            "policy": self.policy,
            "from": self.current,
            "recommended": self.recommended,
            "to": self.target,
            "action": self.action,
            "reason": self.reason,
            "inputs": dict(self.inputs),
        }


def rate_text(value: float) -> str:
    """Records per second, short: 410k/s, 1.2M/s, 850/s."""
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            text = f"{value / scale:.3g}"
            return f"{text}{suffix}/s"
    return f"{value:.3g}/s"


class Policy(Protocol):
    """Turns observed rates into one recommendation per stage; pure."""

    name: str

    def decide(self, given: ScalingInput) -> list[Recommendation]: ...
