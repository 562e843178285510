"""The restart strategy of a checkpointed job: how long a host waits before it restarts the job
from its latest checkpoint, and when it stops trying. Like Flink's exponential-delay strategy
with its bounded attempts (`attempts-before-reset-backoff`): repeated failures wait longer and
longer, up to a ceiling; a failure long after the previous one starts the series again; too many
failures in one series fail the job for good.

Pure: the hosts pass in the times of the failures so far and `now`. The job spec embeds the
settings (`JobSpec.restart`); the local host (`keyshift.operator.local_host`) and the Kubernetes
operator (`keyshift.operator.k8s_operator`) apply them to the global restarts, and the
coordinator (`keyshift.runtime.coordinator`) to its local recoveries: every recovery is one
failure of the same series, as every failover is in Flink. The coordinator counts the failures
its record of recoveries holds (`recorded_failures`); the hosts count each local recovery the
coordinator reports besides their own restarts (`counting_local`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator


@dataclass(frozen=True)
class RestartDecision:
    """What to do about a failure: restart after `delay` seconds, or give up (`delay` None) for
    the reason in `why`. `attempt` numbers the failure within its series, from 1."""

    delay: float | None
    attempt: int
    why: str


class RestartStrategy(BaseModel):
    """Exponential delay with a bounded number of attempts per series of failures."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    initial_delay: float = Field(
        default=1.0,
        gt=0,
        le=3600,
        description="seconds before the second restart of a series (the first is immediate: a "
        "lone failure waits for nothing)",
    )
    max_delay: float = Field(
        default=60.0, gt=0, le=86_400, description="the longest wait before a restart, seconds"
    )
    multiplier: float = Field(
        default=2.0,
        ge=1,
        le=100,
        description="each further restart of a series waits this many times longer",
    )
    max_attempts: int = Field(
        default=10,
        ge=1,
        le=10_000,
        description="restarts in one series; the failure after them fails the job",
    )
    reset_after: float = Field(
        default=3600.0,
        gt=0,
        le=7 * 86_400,
        description="a failure this many seconds after the previous one starts a new series "
        "(the job ran well in between): the count and the delay start again",
    )

    @model_validator(mode="after")
    def _delays_in_order(self) -> RestartStrategy:
        if self.max_delay < self.initial_delay:
            raise ValueError(
                f"max_delay ({self.max_delay:g} s) must be at least initial_delay "
                f"({self.initial_delay:g} s)"
            )
        return self

    def decide(self, failures: Sequence[float], now: float) -> RestartDecision:
        """The decision for a failure at `now`, given the earlier failures' times (ascending,
        on the same clock, the restarts they caused included)."""
        earlier = 0
        later = now
        for failed in reversed(failures):
            if later - failed >= self.reset_after:
                break
            earlier += 1
            later = failed
        attempt = earlier + 1
        if attempt > self.max_attempts:
            return RestartDecision(
                None,
                attempt,
                f"{attempt} failures in a row, each less than {self.reset_after:g} s after the "
                f"one before, and restart.max_attempts allows {self.max_attempts} restarts",
            )
        delay = 0.0 if earlier == 0 else self.initial_delay
        for _ in range(earlier - 1):  # step by step: a power could overflow a float
            delay = min(delay * self.multiplier, self.max_delay)
        return RestartDecision(
            delay, attempt, f"restart {attempt} of at most {self.max_attempts} in a row"
        )

    def kept(self, failures: Sequence[float]) -> list[float]:
        """The newest of `failures` that a decision can look at (one more than the attempts)."""
        return list(failures[-(self.max_attempts + 1) :])


def recorded_failures(recoveries: Sequence[Mapping[str, Any]], since: float) -> list[float]:
    """The failures a record of recoveries (keyshift.runtime.checkpoint_store) holds from
    `since` on, local and global, ascending: when each recovered failure happened."""
    times = (r.get("failed_at") for r in recoveries)
    return sorted(float(t) for t in times if t is not None and float(t) >= since)


def counting_local(failures: Sequence[float], last: Mapping[str, Any] | None) -> list[float]:
    """`failures` (a host's, ascending) with `last`, the latest recovery a coordinator reports,
    counted when it is a local one not counted yet: the host's own restarts are counted when
    it makes them, the local recoveries only the coordinator makes."""
    if not last or last.get("mode") != "local" or last.get("failed_at") is None:
        return list(failures)
    failed = float(last["failed_at"])
    if failed in failures:
        return list(failures)
    return sorted([*failures, failed])
