"""A simulation harness for the scaling policies: a model of a job, fed by a load profile.

No processes and no clock. A job is a graph of `Stage`s, each with a per-instance capacity in
records/s, a selectivity, the shares of its upstream stages' output it receives, and optionally
skew (the fraction of its load on its hottest instance) and contention (capacity each instance
loses per extra instance). A `LoadProfile` gives the records/s arriving at the sources at every
simulated second. The harness advances the model one `step` at a time (backpressure caps the
whole pipeline at its bottleneck; what the sources cannot take becomes a backlog) and, every
`settings.interval` seconds, plays the control loop of keyshift.operator.autoscaler: it builds
the `ScalingInput` a MetricsSource would (rates averaged over the window, cut at the last
rescale's end; a source's offered rate and backlog as gauges, their latest values), runs the
policy and the guards, and runs the decision's rescales one after another as the loop's executor
does, each taking `Scenario.rescale_duration` seconds (the stage keeps `rescale_throughput` of
its capacity meanwhile), reported to the guards at the next tick, the next one started then.

The optimum a run is scored against: for each scalable stage and load level, the fewest
instances (within the stage's bounds) whose hottest instance stays at or under the target
utilization, skew and contention included (`optimal_parallelism`).

It then scores the run against the parallelism that is optimal for each load level: decisions
(rescales) to converge after each load change, overshoot, direction reversals under stationary
load, rescales per hour, instances used, backlog. Deterministic: measurement noise comes from a
seeded generator. Pure (no I/O); called by bench/autoscaling_sim.py and tests/test_simulation.py.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal, NamedTuple, Protocol

from keyshift.policies import make_policy
from keyshift.policies.decide import decide, rescale_order, window
from keyshift.policies.guards import GuardState
from keyshift.policies.model import (
    Decision,
    InstanceRates,
    Policy,
    ScalingInput,
    StageRates,
)
from keyshift.policies.settings import AutoscalerSettings

# A backlog below this many records is rounding, not a pipeline that is behind.
BACKLOG_EPSILON = 1.0
# Busy fractions within this of the target utilization still count as meeting it.
UTILIZATION_SLACK = 1e-9
# The target: at the optimum within this many rescales of a stage after every step.
CONVERGE_WITHIN = 3

ChangeKind = Literal["start", "step", "ramp", "sine"]


# --- the job model ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    """One stage of a modelled job. A stage without upstream is a source (never scaled)."""

    name: str
    capacity: float  # records/s one instance takes in when busy all the time
    selectivity: float = 1.0  # records out per record in
    upstream: Mapping[str, float] = field(default_factory=dict)  # stage -> share of its output
    parallelism: int = 1  # at the start of a run
    skew: float = 0.0  # share of the load on the hottest instance (at least 1/parallelism)
    contention: float = 0.0  # each extra instance costs every instance this fraction of capacity
    load_share: float = 1.0  # sources: the fraction of the load profile arriving here

    def __post_init__(self) -> None:
        if not (math.isfinite(self.capacity) and self.capacity > 0):
            raise ValueError(f"stage {self.name}: capacity must be positive")
        if not (math.isfinite(self.selectivity) and self.selectivity >= 0):
            raise ValueError(f"stage {self.name}: selectivity must be >= 0")
        if not 0 <= self.skew <= 1:
            raise ValueError(f"stage {self.name}: skew must be within [0, 1]")
        if not 0 <= self.contention < 1:
            raise ValueError(f"stage {self.name}: contention must be within [0, 1)")
        if self.parallelism < 1:
            raise ValueError(f"stage {self.name}: parallelism must be >= 1")
        if any(not (math.isfinite(s) and s >= 0) for s in self.upstream.values()):
            raise ValueError(f"stage {self.name}: upstream shares must be >= 0")

    @property
    def is_source(self) -> bool:
        return not self.upstream

    def instance_capacity(self, parallelism: int) -> float:
        """Records/s one instance takes in at this parallelism, contention included."""
        return self.capacity * (1.0 - self.contention) ** (parallelism - 1)

    def shares(self, parallelism: int) -> tuple[float, ...]:
        """The fraction of the stage's input each instance gets, hottest first."""
        if parallelism == 1:
            return (1.0,)
        hot = max(self.skew, 1.0 / parallelism)
        rest = (1.0 - hot) / (parallelism - 1)
        return (hot, *([rest] * (parallelism - 1)))

    def max_input(self, parallelism: int) -> float:
        """Records/s the stage takes in before its hottest instance is busy all the time."""
        return self.instance_capacity(parallelism) / self.shares(parallelism)[0]

    def hottest_busy(self, load: float, parallelism: int) -> float:
        """The hottest instance's busy fraction if the stage took in `load` records/s."""
        return load * self.shares(parallelism)[0] / self.instance_capacity(parallelism)


def check_graph(stages: Sequence[Stage]) -> None:
    """Raise ValueError unless names are unique, upstreams come first and a source exists."""
    seen: set[str] = set()
    for stage in stages:
        if stage.name in seen:
            raise ValueError(f"stage {stage.name} appears twice")
        missing = sorted(set(stage.upstream) - seen)
        if missing:
            raise ValueError(f"stage {stage.name}: upstream {', '.join(missing)} must come first")
        seen.add(stage.name)
    if not any(s.is_source for s in stages):
        raise ValueError("a job needs a source")


def stage_loads(stages: Sequence[Stage], source_input: Mapping[str, float]) -> dict[str, float]:
    """Records/s into every stage when the sources take in `source_input`."""
    by_name = {s.name: s for s in stages}
    load: dict[str, float] = {}
    for stage in stages:
        if stage.is_source:
            load[stage.name] = source_input.get(stage.name, 0.0)
        else:
            load[stage.name] = sum(
                load[u] * by_name[u].selectivity * share for u, share in stage.upstream.items()
            )
    return load


def optimal_parallelism(stage: Stage, load: float, settings: AutoscalerSettings) -> int:
    """The fewest instances within the stage's bounds whose hottest instance stays at or under
    the target utilization for `load`; if none can, the fewest that make it least busy."""
    bounds = settings.bounds_of(stage.name)
    best, best_busy = bounds.max_parallelism, math.inf
    for parallelism in range(bounds.min_parallelism, bounds.max_parallelism + 1):
        busy = stage.hottest_busy(load, parallelism)
        if busy <= settings.target_utilization + UTILIZATION_SLACK:
            return parallelism
        if busy < best_busy - UTILIZATION_SLACK:
            best, best_busy = parallelism, busy
    return best


def optimal_configuration(
    stages: Sequence[Stage], rate: float, settings: AutoscalerSettings
) -> dict[str, int]:
    """The optimal parallelism of every scalable stage when `rate` records/s arrive."""
    loads = stage_loads(stages, {s.name: rate * s.load_share for s in stages if s.is_source})
    return {
        s.name: optimal_parallelism(s, loads[s.name], settings) for s in stages if not s.is_source
    }


# --- load profiles ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Change:
    """The load starts to change at `start` and is constant again from `settled` on (inf: it
    never is). A run's beginning counts as a change of kind "start"."""

    start: float
    settled: float
    kind: ChangeKind


class LoadProfile(Protocol):
    def rate(self, t: float) -> float:
        """Records/s arriving at `t` seconds into the run."""
        ...

    def changes(self) -> tuple[Change, ...]:
        """The load changes, in time order, the first at 0."""
        ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class Piecewise:
    """Linear between (seconds, records/s) points; two points at the same time make a step."""

    points: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("a piecewise profile needs a point")
        times = [t for t, _ in self.points]
        if times != sorted(times) or times[0] != 0:
            raise ValueError("points must start at 0 and be in time order")
        if any(not (math.isfinite(r) and r >= 0) for _, r in self.points):
            raise ValueError("rates must be >= 0")

    @cached_property
    def _times(self) -> list[float]:
        return [t for t, _ in self.points]

    def rate(self, t: float) -> float:
        i = max(0, bisect.bisect_right(self._times, t) - 1)  # the last point at or before t
        if i == len(self.points) - 1:
            return self.points[i][1]
        (t0, r0), (t1, r1) = self.points[i], self.points[i + 1]
        return r0 + (r1 - r0) * (t - t0) / (t1 - t0)

    def changes(self) -> tuple[Change, ...]:
        found: list[Change] = []
        for (t0, r0), (t1, r1) in itertools.pairwise(self.points):
            if r0 == r1:
                continue
            kind: ChangeKind = "step" if t0 == t1 else "ramp"
            last = found[-1] if found else None
            if kind == "ramp" and last is not None and last.kind == "ramp" and last.settled == t0:
                found[-1] = Change(last.start, t1, "ramp")
            else:
                found.append(Change(t0, t1, kind))
        if not found or found[0].start > 0:
            found.insert(0, Change(0.0, 0.0, "start"))
        return tuple(found)

    def describe(self) -> str:
        """E.g. "10k/s, 42k at 600 s, 46k over 300-900 s"."""
        parts = [f"{_k(self.rate(0))}/s"]
        for change in self.changes():
            level = _k(self.rate(change.settled))
            if change.kind == "step":
                parts.append(f"{level} at {change.start:g} s")
            elif change.kind == "ramp":
                parts.append(f"{level} over {change.start:g}-{change.settled:g} s")
        return ", ".join(parts)


def _k(rate: float) -> str:
    return f"{rate / 1000:g}k"


def steps(*levels: tuple[float, float]) -> Piecewise:
    """A step profile: (from seconds, records/s) levels."""
    points: list[tuple[float, float]] = []
    for t, rate in levels:
        if points:
            points.append((t, points[-1][1]))
        points.append((t, rate))
    return Piecewise(tuple(points))


@dataclass(frozen=True)
class Sine:
    """mean + amplitude * sin(2πt / period): never stationary."""

    mean: float
    amplitude: float
    period: float

    def __post_init__(self) -> None:
        if self.amplitude > self.mean or self.period <= 0:
            raise ValueError("a sine profile needs amplitude <= mean and a positive period")

    def rate(self, t: float) -> float:
        return self.mean + self.amplitude * math.sin(2 * math.pi * t / self.period)

    def changes(self) -> tuple[Change, ...]:
        return (Change(0.0, math.inf, "sine"),)

    def describe(self) -> str:
        return f"{_k(self.mean)} ± {_k(self.amplitude)}/s, period {self.period:g} s"


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    stages: tuple[Stage, ...]
    load: LoadProfile
    duration: float  # simulated seconds
    rescale_duration: float = 5.0  # seconds from starting a rescale to the new parallelism
    rescale_throughput: float = 1.0  # the fraction of its capacity a stage keeps meanwhile
    noise: float = 0.0  # measured rates and busy fractions are off by up to ± this fraction
    seed: int = 1
    # False: the scenario breaks an assumption DS2 makes (an instance's true rate does not
    # depend on the parallelism; load spreads evenly over the instances) to show what DS2 does
    # then; the convergence target is not expected there.
    ds2_assumptions_hold: bool = True

    def __post_init__(self) -> None:
        check_graph(self.stages)
        if self.duration <= 0 or self.rescale_duration < 0:
            raise ValueError("duration must be positive and rescale_duration >= 0")
        if not 0 <= self.rescale_throughput <= 1 or not 0 <= self.noise < 1:
            raise ValueError("rescale_throughput must be within [0, 1] and noise within [0, 1)")


# --- results ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rescale:
    at: float  # when the loop started it
    stage: str
    current: int
    target: int
    reason: str

    @property
    def direction(self) -> int:
        return 1 if self.target > self.current else -1


@dataclass(frozen=True)
class ChangeResult:
    """How a policy followed one load change, up to the next change (or the end of the run)."""

    change: Change
    end: float
    optimal: Mapping[str, int]  # for the load it settles at; empty for a sine
    decisions: Mapping[str, int | None]  # rescales of each stage; None: not at optimal at `end`
    overshoot: int  # instances above both the optimum and where the stage was at `start`
    reversals: int  # rescales after `settled` opposite to the stage's previous one

    @property
    def stationary(self) -> bool:
        return math.isfinite(self.change.settled)

    @property
    def converged(self) -> bool:
        return self.stationary and all(d is not None for d in self.decisions.values())

    @property
    def decisions_to_converge(self) -> int | None:
        """The most rescales any stage needed to settle at its optimum (None: one did not)."""
        if not self.converged:
            return None
        return max((d for d in self.decisions.values() if d is not None), default=0)


@dataclass(frozen=True)
class RunResult:
    scenario: str
    policy: str
    duration: float
    rescales: tuple[Rescale, ...]
    changes: tuple[ChangeResult, ...]
    mean_instances: float  # time-weighted, summed over the scaled stages
    mean_backlog: float  # time-weighted records waiting at the sources
    backlogged: float  # fraction of the time with records waiting at the sources
    max_lag: float  # longest the sources fell behind: backlog / offered rate, seconds
    final: Mapping[str, int]  # parallelism at the end
    ticks: int

    @property
    def rescales_per_hour(self) -> float:
        return len(self.rescales) * 3600.0 / self.duration

    @property
    def stationary_reversals(self) -> int:
        return sum(c.reversals for c in self.changes)

    @property
    def max_overshoot(self) -> int:
        return max((c.overshoot for c in self.changes if c.stationary), default=0)


# --- the simulation ---------------------------------------------------------------------------


class _Sample(NamedTuple):
    """One step of a stage, recorded at the step's end `t`: its parallelism then, the records/s
    its hottest instance and each other instance took in, their busy fractions and, for a
    source, the records/s offered to it."""

    t: float
    parallelism: int
    hot_in: float
    rest_in: float
    hot_busy: float
    rest_busy: float
    offered: float


@dataclass
class _Running:
    stage: int  # index into the scenario's stages
    target: int
    ends: float
    applied: bool = False


class _Simulation:
    """One run. Stages are addressed by their index in the scenario, in lists, for speed."""

    def __init__(
        self, scenario: Scenario, settings: AutoscalerSettings, policy: Policy, step: float
    ) -> None:
        self.scenario = scenario
        self.settings = settings
        self.policy = policy
        self.step = step
        self.stages = scenario.stages
        self.index = {s.name: i for i, s in enumerate(self.stages)}
        # Per stage: (upstream index, records it gets per record the upstream takes in).
        self.links = [
            tuple(
                (self.index[u], self.stages[self.index[u]].selectivity * share)
                for u, share in s.upstream.items()
            )
            for s in self.stages
        ]
        self.sources = [i for i, s in enumerate(self.stages) if s.is_source]
        self.scaled = [i for i, s in enumerate(self.stages) if not s.is_source]
        self.parallelism = [s.parallelism for s in self.stages]
        self.born = [[0.0] * s.parallelism for s in self.stages]
        self.backlog = [0.0] * len(self.stages)  # only sources have one
        kept = math.ceil(settings.metrics_window / step) + 1
        self.samples: list[deque[_Sample]] = [deque(maxlen=kept) for _ in self.stages]
        # Per stage at its current parallelism: the hottest instance's share of the load, each
        # other's, an instance's capacity, and the records/s the stage can take in.
        self.hot_share = [1.0] * len(self.stages)
        self.rest_share = [1.0] * len(self.stages)
        self.capacity = [1.0] * len(self.stages)
        self.limit = [1.0] * len(self.stages)
        self.state = GuardState()
        self.running: _Running | None = None
        self.queued: deque[Decision] = deque()  # the running decision's rescales still to run
        self.rescales: list[Rescale] = []
        self.rng = random.Random(scenario.seed)
        self.ticks = 0
        self.instance_seconds = 0.0
        self.backlog_seconds = 0.0
        self.backlogged_seconds = 0.0
        self.max_lag = 0.0
        for i in range(len(self.stages)):
            self._reshape(i)

    def run(self) -> None:
        count = round(self.scenario.duration / self.step)
        every = round(self.settings.interval / self.step)
        for k in range(count):
            self._finish_rescale(k * self.step)
            self._advance(k * self.step)
            if (k + 1) % every == 0:
                self._tick((k + 1) * self.step)

    # physics

    def _reshape(self, i: int) -> None:
        stage, p = self.stages[i], self.parallelism[i]
        shares = stage.shares(p)
        self.hot_share[i], self.rest_share[i] = shares[0], shares[-1]
        self.capacity[i] = stage.instance_capacity(p)
        # The hottest instance is the first to be busy all the time.
        self.limit[i] = self.capacity[i] / shares[0]
        running = self.running
        if running is not None and not running.applied and running.stage == i:
            self.limit[i] *= self.scenario.rescale_throughput

    def _advance(self, t: float) -> None:
        """One step: what the sources are offered, what the pipeline takes (capped as a whole
        by its tightest stage, as backpressure does), the backlog, and every stage's sample."""
        dt = self.step
        rate_now = self.scenario.load.rate(t + dt / 2)
        count = len(self.stages)
        offered = [0.0] * count
        loads = [0.0] * count
        for i, links in enumerate(self.links):
            if links:
                loads[i] = sum(loads[j] * weight for j, weight in links)
            else:
                offered[i] = rate_now * self.stages[i].load_share
                loads[i] = offered[i] + self.backlog[i] / dt
        fraction = 1.0
        for i in range(count):
            if loads[i] > 0:
                fraction = min(fraction, self.limit[i] / loads[i])
        total = 0.0
        for i in self.sources:
            self.backlog[i] = max(0.0, self.backlog[i] + (offered[i] - loads[i] * fraction) * dt)
            total += self.backlog[i]
            if offered[i] > 0:
                self.max_lag = max(self.max_lag, self.backlog[i] / offered[i])
        end = t + dt
        for i in range(count):
            load = loads[i] * fraction
            hot_in, rest_in = load * self.hot_share[i], load * self.rest_share[i]
            capacity = self.capacity[i]
            self.samples[i].append(
                _Sample(
                    end,
                    self.parallelism[i],
                    hot_in,
                    rest_in,
                    min(1.0, hot_in / capacity),
                    min(1.0, rest_in / capacity),
                    offered[i],
                )
            )
        self.instance_seconds += dt * sum(self.parallelism[i] for i in self.scaled)
        self.backlog_seconds += total * dt
        if total > BACKLOG_EPSILON:
            self.backlogged_seconds += dt

    # the control loop

    def _finish_rescale(self, t: float) -> None:
        running = self.running
        if running is None or running.applied or running.ends > t:
            return
        i, old = running.stage, self.parallelism[running.stage]
        self.born[i] = self.born[i][: running.target] + [t] * (running.target - old)
        self.parallelism[i] = running.target
        running.applied = True
        self._reshape(i)

    def _tick(self, now: float) -> None:
        self.ticks += 1
        self._finish_rescale(now)
        if self.running is not None and self.running.applied:
            # As the loop: the end of a rescale is seen at the first tick after it, and the
            # executor starts the decision's next rescale then.
            self.state = self.state.rescaled(self.stages[self.running.stage].name, now)
            self.running = None
            if self.queued:
                self._start(self.queued.popleft(), now)
        observed = self._measure(now, window(self.state, self.settings, now))
        rescaling = self.stages[self.running.stage].name if self.running is not None else None
        step = decide(observed, self.policy, self.state, self.settings, now, rescaling)
        self.state, decisions = step.state, step.decisions
        acted = rescale_order(decisions)
        if self.settings.dry_run or not acted:
            return
        if self.running is not None:
            raise RuntimeError(f"the guards let a rescale start while one runs: {acted}")
        self._start(acted[0], now)
        self.queued.extend(acted[1:])

    def _start(self, decision: Decision, now: float) -> None:
        i = self.index[decision.stage]
        if decision.current != self.parallelism[i]:
            raise RuntimeError(f"decision for a parallelism the stage does not have: {decision}")
        self.rescales.append(
            Rescale(now, decision.stage, decision.current, decision.target, decision.reason)
        )
        self.running = _Running(i, decision.target, now + self.scenario.rescale_duration)
        self._reshape(i)
        self._finish_rescale(now)

    def _measure(self, now: float, window: float) -> ScalingInput:
        rates = []
        for i, stage in enumerate(self.stages):
            samples = [s for s in self.samples[i] if s.t > now - window + 1e-9]
            p = self.parallelism[i]
            born = self.born[i]
            alike = bool(samples) and all(s.parallelism == p for s in samples)
            if alike and max(born) <= samples[0].t - self.step + 1e-9:
                # Every instance ran through the whole window: the hottest measured one thing,
                # every other one the same other thing.
                hot = self._average(stage, samples, hottest=True)
                rest = self._average(stage, samples, hottest=False)
                raw = [hot] + [rest] * (p - 1)
            else:
                raw = [self._instance(stage, samples, j, born[j]) for j in range(p)]
            rates.append(
                StageRates(
                    name=stage.name,
                    parallelism=p,
                    instances=tuple(self._noisy(r) for r in raw),
                    upstream=stage.upstream,
                    # Gauges, as keyshift.operator.scaling_metrics reads them: the latest value.
                    offered=(samples[-1].offered if samples else 0.0) if stage.is_source else None,
                    backlog=self.backlog[i],
                )
            )
        return ScalingInput(now=now, window=window, stages=tuple(rates))

    @staticmethod
    def _average(stage: Stage, samples: Sequence[_Sample], hottest: bool) -> InstanceRates:
        n = len(samples)
        if hottest:
            records_in = sum(s.hot_in for s in samples) / n
            busy = sum(s.hot_busy for s in samples) / n
        else:
            records_in = sum(s.rest_in for s in samples) / n
            busy = sum(s.rest_busy for s in samples) / n
        return InstanceRates(records_in, records_in * stage.selectivity, busy)

    def _instance(
        self, stage: Stage, samples: Sequence[_Sample], index: int, born: float
    ) -> InstanceRates:
        """What instance `index` measured over `samples`, averaged over the steps it ran."""
        mine = [s for s in samples if s.parallelism > index and s.t - self.step >= born - 1e-9]
        if not mine:
            return InstanceRates(0.0, 0.0, 0.0)
        return self._average(stage, mine, hottest=index == 0)

    def _noisy(self, rates: InstanceRates) -> InstanceRates:
        """The rates as measured: each off by up to ± the scenario's noise (rates in and out
        by the same factor), drawn independently for every instance at every tick."""
        noise = self.scenario.noise
        if noise == 0:
            return rates
        rate_error = 1.0 + self.rng.uniform(-noise, noise)
        busy_error = 1.0 + self.rng.uniform(-noise, noise)
        return InstanceRates(
            rates.records_in * rate_error,
            rates.records_out * rate_error,
            min(1.0, rates.busy * busy_error),
        )

    def result(self) -> RunResult:
        duration = self.scenario.duration
        return RunResult(
            scenario=self.scenario.name,
            policy=self.policy.name,
            duration=duration,
            rescales=tuple(self.rescales),
            changes=score(self.scenario, self.settings, self.rescales),
            mean_instances=self.instance_seconds / duration,
            mean_backlog=self.backlog_seconds / duration,
            backlogged=self.backlogged_seconds / duration,
            max_lag=self.max_lag,
            final={s.name: p for s, p in zip(self.stages, self.parallelism, strict=True)},
            ticks=self.ticks,
        )


def simulate(scenario: Scenario, settings: AutoscalerSettings, step: float = 1.0) -> RunResult:
    """Run `scenario` under the policy `settings` name, with the guards, and score the run.
    `settings.interval` must be a whole number of `step`s."""
    every = settings.interval / step
    if step <= 0 or abs(every - round(every)) > 1e-9 or round(every) < 1:
        raise ValueError(f"interval {settings.interval} s is not a whole number of {step} s steps")
    simulation = _Simulation(scenario, settings, make_policy(settings), step)
    simulation.run()
    return simulation.result()


# --- scoring ----------------------------------------------------------------------------------


def score(
    scenario: Scenario, settings: AutoscalerSettings, rescales: Sequence[Rescale]
) -> tuple[ChangeResult, ...]:
    """Each load change, scored from its start to the next change's start (or the end)."""
    changes = scenario.load.changes()
    scaled = [s for s in scenario.stages if not s.is_source]
    results = []
    for i, change in enumerate(changes):
        end = changes[i + 1].start if i + 1 < len(changes) else scenario.duration
        stationary = math.isfinite(change.settled)
        optimal = (
            optimal_configuration(scenario.stages, scenario.load.rate(change.settled), settings)
            if stationary
            else {}
        )
        decisions: dict[str, int | None] = {}
        overshoot = reversals = 0
        for stage in scaled:
            before = [r for r in rescales if r.stage == stage.name and r.at < change.start]
            mine = [r for r in rescales if r.stage == stage.name and change.start <= r.at < end]
            first = before[-1].target if before else stage.parallelism
            last = mine[-1].target if mine else first
            previous: Rescale | None = None
            for rescale in mine:
                opposite = previous is not None and previous.direction != rescale.direction
                if opposite and rescale.at >= change.settled:
                    reversals += 1
                previous = rescale
            if not stationary:
                continue
            decisions[stage.name] = len(mine) if last == optimal[stage.name] else None
            highest = max([first, *(r.target for r in mine)])
            overshoot = max(overshoot, highest - max(optimal[stage.name], first))
        results.append(ChangeResult(change, end, optimal, decisions, overshoot, reversals))
    return tuple(results)


def target_problems(result: RunResult, within: int = CONVERGE_WITHIN) -> list[str]:
    """Why a run misses the target (empty: it meets it): at the optimal parallelism within
    `within` decisions after the start and after every step, and no reversal under stationary
    load. Ramps and sines are not steps; their reversals still count once the load is flat."""
    problems = []
    for c in result.changes:
        what = f"{c.change.kind} at {c.change.start:g} s"
        if c.change.kind in ("start", "step"):
            decisions = c.decisions_to_converge
            if decisions is None:
                missed = sorted(s for s, d in c.decisions.items() if d is None)
                problems.append(f"{what}: {', '.join(missed)} not at the optimum by {c.end:g} s")
            elif decisions > within:
                problems.append(f"{what}: {decisions} decisions to converge")
        if c.reversals:
            problems.append(f"{what}: {c.reversals} reversal(s) under stationary load")
    return problems


# --- the scenarios ----------------------------------------------------------------------------

SOURCE_CAPACITY = 1e7  # sources are never the bottleneck here


def chain() -> tuple[Stage, ...]:
    """source → parse (keeps half) → enrich (doubles) → aggregate (emits a tenth)."""
    return (
        Stage("source", SOURCE_CAPACITY),
        Stage("parse", 24_000, selectivity=0.5, upstream={"source": 1.0}),
        Stage("enrich", 4_000, selectivity=2.0, upstream={"parse": 1.0}),
        Stage("aggregate", 10_000, selectivity=0.1, upstream={"enrich": 1.0}),
    )


def diamond() -> tuple[Stage, ...]:
    """source → parse (0.8) → clicks (75 % of it) and views (25 %, halves) → store (both)."""
    return (
        Stage("source", SOURCE_CAPACITY),
        Stage("parse", 30_000, selectivity=0.8, upstream={"source": 1.0}),
        Stage("clicks", 4_000, upstream={"parse": 0.75}),
        Stage("views", 1_600, selectivity=0.5, upstream={"parse": 0.25}),
        Stage("store", 5_000, selectivity=0.0, upstream={"clicks": 1.0, "views": 1.0}),
    )


def scenarios() -> tuple[Scenario, ...]:
    """The suite bench/autoscaling_sim.py reports and tests/test_simulation.py checks."""
    chain_steps = steps((0, 10_000), (600, 42_000), (1500, 22_000), (2400, 46_000), (3300, 9_000))
    return (
        Scenario(
            "chain-step",
            "3-operator chain (parse 24k/s per instance, selectivity 0.5 → enrich 4k/s, 2 → "
            "aggregate 10k/s, 0.1)",
            chain(),
            chain_steps,
            duration=4200,
        ),
        Scenario(
            "diamond-step",
            "fan-out: parse → clicks (75 % of its output) and views (25 %, selectivity 0.5) → "
            "store (both)",
            diamond(),
            steps((0, 10_000), (600, 30_000), (1500, 15_000), (2400, 35_000), (3300, 8_000)),
            duration=4200,
        ),
        Scenario(
            "chain-ramp",
            "the chain",
            chain(),
            Piecewise(((0, 10_000), (300, 10_000), (900, 46_000), (2100, 46_000), (2700, 10_000))),
            duration=3600,
        ),
        Scenario(
            "chain-lull",
            "the chain, the load all but gone for 15 minutes (every instance under 1 % busy)",
            chain(),
            steps((0, 10_000), (600, 42_000), (1500, 300), (2400, 42_000)),
            duration=3300,
        ),
        Scenario(
            "diamond-sine",
            "the fan-out",
            diamond(),
            Sine(20_000, 10_000, 1800),
            duration=7200,
        ),
        Scenario(
            "contention-step",
            "source → aggregate → sink, each extra aggregate instance costs every one 4 % of its "
            "capacity",
            (
                Stage("source", SOURCE_CAPACITY),
                Stage("aggregate", 10_000, 0.2, {"source": 1.0}, contention=0.04),
                Stage("sink", 50_000, 0.0, {"aggregate": 1.0}),
            ),
            steps((0, 10_000), (600, 40_000), (1500, 15_000), (2400, 7_000)),
            duration=3300,
            ds2_assumptions_hold=False,
        ),
        Scenario(
            "chain-noisy",
            "the chain, every measured rate and busy fraction off by up to ±5 %",
            chain(),
            chain_steps,
            duration=4200,
            noise=0.05,
        ),
        Scenario(
            "chain-paused",
            "the chain, a rescale takes 20 s and pauses the stage",
            chain(),
            chain_steps,
            duration=4200,
            rescale_duration=20.0,
            rescale_throughput=0.0,
        ),
        Scenario(
            "skew-step",
            "source → counts, one hot key carrying 35 % of the load",
            (
                Stage("source", SOURCE_CAPACITY),
                Stage("counts", 10_000, 1.0, {"source": 1.0}, skew=0.35),
            ),
            steps((0, 10_000), (600, 26_000), (1500, 12_000)),
            duration=2400,
            ds2_assumptions_hold=False,
        ),
    )
