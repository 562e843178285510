"""The autoscaling loop: collect -> decide -> guard -> execute -> record, once per tick.

One object with its parts injected (docs/architecture.md, "Autoscaling"); no Kubernetes and no
process code. One tick sizes every stage of the graph in one decision; the executor runs that
decision's rescales one after another (scale-ups first), and no new decision is taken until the
last has ended. The local host (`keyshift.operator.local_scaling`) and the Kubernetes operator wire
their own MetricsSource, RescaleExecutor and EventSink into it. A tick never raises for a
problem of the job's: no metrics, NaN rates or a failed rescale become a recorded reason, and
the job runs on.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from keyshift.policies.decide import decide, rescale_order, window
from keyshift.policies.guards import GuardState
from keyshift.policies.model import Decision, Policy, ScalingInput
from keyshift.policies.settings import AutoscalerSettings
from keyshift.runtime.metrics import AutoscalerMetrics

log = logging.getLogger(__name__)

KEPT_DECISIONS = 200


class MetricsUnavailable(RuntimeError):
    """The metrics for a decision cannot be had now; the message says why."""


class RescaleRefused(RuntimeError):
    """The runtime did not start a rescale; the message says why."""


@dataclass(frozen=True)
class RescaleOutcome:
    stage: str
    ok: bool
    detail: str


class MetricsSource(Protocol):
    def collect(self, window: float, now: float) -> ScalingInput:
        """Every stage's rates over the last `window` seconds; raises MetricsUnavailable."""
        ...


class RescaleExecutor(Protocol):
    """Runs the rescales of one decision one after another: the job moves one stage at a
    time (the coordinator refuses a second rescale while one runs)."""

    # The stages this host can rescale live, each with the most instances it can have.
    scalable: Mapping[str, int]

    def apply(self, steps: Sequence[tuple[str, int]]) -> None:
        """Start a decision's rescales, (stage, parallelism) in order, with the host's
        migration strategy and options (the coordinator first, then the workers a scale-out
        needs): the first now, each next once the one before it has ended done. Raises
        RescaleRefused if the first is not started (then none is); a later one that fails or
        is refused is a failed outcome from `finished`, and the ones after it are dropped."""
        ...

    def running(self) -> str | None:
        """The stage being rescaled now, whoever started it, or the next of a decision's
        rescales still to run; None when nothing is moving or waiting."""
        ...

    def finished(self) -> list[RescaleOutcome]:
        """Rescales that ended since the last call (starting the next of a decision's)."""
        ...


class EventSink(Protocol):
    def decided(self, decisions: Sequence[Decision]) -> None:
        """One tick's decisions, one per stage."""
        ...

    def problem(self, at: float, reason: str) -> None:
        """Something kept the loop from deciding or from acting."""
        ...


class Clock(Protocol):
    def now(self) -> float: ...


class AutoscalingLoop:
    def __init__(
        self,
        settings: AutoscalerSettings,
        metrics: MetricsSource,
        policy: Policy,
        executor: RescaleExecutor,
        events: EventSink,
        clock: Clock,
        exported: AutoscalerMetrics,
        state: GuardState | None = None,
        chained: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        """`state`: the guards' memory a previous loop of this job left (a restarted host
        keeps it), so a cooldown or back-off in progress goes on. `chained`: the map, filter
        and flat_map stages each stage runs in its processes, which its decisions name (they
        are sized with it, never apart)."""
        self.settings = settings
        self.metrics = metrics
        self.policy = policy
        self.executor = executor
        self.events = events
        self.clock = clock
        self.exported = exported
        self.state = state if state is not None else GuardState()
        self.chained = chained or {}
        self.decisions: deque[Decision] = deque(maxlen=KEPT_DECISIONS)
        self._next_tick: float | None = None

    def poll(self) -> list[Decision]:
        """Tick if one is due by the clock; hosts call this as often as they like."""
        now = self.clock.now()
        if self._next_tick is not None and now < self._next_tick:
            return []
        self._next_tick = now + self.settings.interval
        return self.tick(now)

    def tick(self, now: float) -> list[Decision]:
        self._take_outcomes(now)
        try:
            observed = self.metrics.collect(window(self.state, self.settings, now), now)
        except MetricsUnavailable as exc:
            self._problem(now, "metrics", f"no decision: {exc}")
            return []
        step = decide(
            observed,
            self.policy,
            self.state,
            self.settings,
            now,
            rescaling=self.executor.running(),
            scalable=self.executor.scalable,
        )
        self.state, decisions = step.state, [self._naming_chained(d) for d in step.decisions]
        if step.problem is not None:
            self._problem(now, "metrics", step.problem)
            return []
        for decision in decisions:
            self.exported.decided(
                decision.stage, decision.current, decision.recommended, decision.action
            )
        acted = rescale_order(decisions)
        if acted and not self.settings.dry_run:
            self._execute(acted, now)
        self.decisions.extend(decisions)
        self.events.decided(decisions)
        return decisions

    def _naming_chained(self, decision: Decision) -> Decision:
        names = self.chained.get(decision.stage)
        if not names:
            return decision
        chained = ", ".join(names)
        why = f"{decision.reason}; runs {chained} chained in its processes, at its parallelism"
        return replace(decision, reason=why)

    def _execute(self, acted: list[Decision], now: float) -> None:
        try:
            self.executor.apply([(d.stage, d.target) for d in acted])
        except RescaleRefused as exc:
            first = acted[0].stage
            self.state = self.state.failed(first, now, self.settings)
            self._problem(now, "rescale", f"rescale of {first} not started: {exc}")

    def _take_outcomes(self, now: float) -> None:
        for outcome in self.executor.finished():
            if outcome.ok:
                self.state = self.state.rescaled(outcome.stage, now)
            else:
                self.state = self.state.failed(outcome.stage, now, self.settings)
                self._problem(
                    now, "rescale", f"rescale of {outcome.stage} failed: {outcome.detail}"
                )

    def _problem(self, now: float, kind: str, reason: str) -> None:
        log.warning("autoscaler: %s", reason)
        self.exported.error(kind)
        self.events.problem(now, reason)
