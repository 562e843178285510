"""The autoscaling loop's own logic: what it does with bad metrics, refused and failed rescales,
and the metrics window after a rescale. Its parts are the interfaces of docs/architecture.md's
hosts; here they are small scripted implementations (the live tests use the real ones), so
each fault can be produced exactly. The policy, guards and exported metrics are the real ones."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import generate_latest

from keyshift.operator.autoscaler import (
    AutoscalingLoop,
    MetricsUnavailable,
    RescaleOutcome,
    RescaleRefused,
)
from keyshift.operator.scaling_metrics import _rate, job_graph, shares
from keyshift.policies import make_policy
from keyshift.policies.model import Decision, InstanceRates, ScalingInput, StageRates
from keyshift.policies.settings import AutoscalerSettings
from keyshift.runtime.job import load_job, parse_job
from keyshift.runtime.metrics import JOB_LABEL, NAMESPACE_LABEL, AutoscalerMetrics, MetricName
from tests.test_graph_rescale import fan_out_and_in

SETTINGS = AutoscalerSettings(activation=1, warmup=10, metrics_window=30, failure_backoff=20)


def overloaded(busy: float = 1.0, records_in: float = 10_000) -> ScalingInput:
    """A source offering 30k/s to one keyed instance that manages 10k/s."""
    source = StageRates("source", 1, (InstanceRates(10_000, 10_000, 0.1),), offered=30_000)
    keyed = StageRates("keyed", 1, (InstanceRates(records_in, records_in, busy),), {"source": 1})
    return ScalingInput(0, 30, (source, keyed))


@dataclass
class ScriptedMetrics:
    answers: list[ScalingInput | str]
    windows: list[float] = field(default_factory=list)

    def collect(self, window: float, now: float) -> ScalingInput:
        self.windows.append(window)
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, str):
            raise MetricsUnavailable(answer)
        return answer


@dataclass
class ScriptedExecutor:
    refuse: str | None = None
    outcomes: list[RescaleOutcome] = field(default_factory=list)
    applied: list[tuple[str, int]] = field(default_factory=list)
    scalable: Mapping[str, int] = field(default_factory=lambda: {"keyed": 256})
    moving: str | None = None

    def apply(self, steps: Sequence[tuple[str, int]]) -> None:
        if self.refuse:
            raise RescaleRefused(self.refuse)
        self.applied += steps

    def running(self) -> str | None:
        return self.moving

    def finished(self) -> list[RescaleOutcome]:
        done, self.outcomes = self.outcomes, []
        return done


@dataclass
class Recorded:
    decisions: list[Decision] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def decided(self, decisions: Sequence[Decision]) -> None:
        self.decisions += decisions

    def problem(self, at: float, reason: str) -> None:
        self.problems.append(reason)


class FixedClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        return self.t


def make_loop(
    metrics: ScriptedMetrics,
    executor: ScriptedExecutor,
    settings: AutoscalerSettings = SETTINGS,
    chained: dict[str, list[str]] | None = None,
) -> tuple[AutoscalingLoop, Recorded, AutoscalerMetrics]:
    events, exported = Recorded(), AutoscalerMetrics("j")
    loop = AutoscalingLoop(
        settings, metrics, make_policy(settings), executor, events, FixedClock(), exported,
        chained=chained,
    )  # fmt: skip
    return loop, events, exported


# A local loop's series: the job's name, and no namespace (an empty label is no label).
OWNER = {JOB_LABEL: "j", NAMESPACE_LABEL: ""}


def exported_value(exported: AutoscalerMetrics, name: MetricName, labels: dict[str, str]) -> float:
    """A sample of the loop's registry as Prometheus would scrape it (a counter's _total)."""
    value = exported.registry.get_sample_value(name, labels)
    assert value is not None, (name, labels, generate_latest(exported.registry).decode())
    return value


def test_an_overloaded_stage_is_scaled_in_one_step_and_the_decision_exported() -> None:
    executor = ScriptedExecutor()
    loop, events, exported = make_loop(ScriptedMetrics([overloaded()]), executor)
    decisions = loop.tick(0.0)
    keyed = next(d for d in decisions if d.stage == "keyed")
    assert (keyed.action, keyed.target) == ("scale_up", 4)  # ceil(30k / (10k x 0.8))
    assert executor.applied == [("keyed", 4)]
    assert "true rate 10k/s per instance, target 30k/s" in keyed.reason
    keyed_stage = {**OWNER, "stage": "keyed"}
    assert exported_value(exported, MetricName.AUTOSCALER_RECOMMENDED, keyed_stage) == 4
    scaled_up = {**keyed_stage, "action": "scale_up"}
    assert exported_value(exported, MetricName.AUTOSCALER_DECISIONS, scaled_up) == 1
    assert events.decisions == decisions


def test_one_tick_sizes_every_stage_and_hands_the_executor_its_rescales_in_order() -> None:
    """A chain of two keyed stages: `a` over-provisioned, `b` the bottleneck. One DS2 decision
    sizes both, and the executor gets the scale-up first (capacity before it is taken away)."""
    source = StageRates("source", 1, (InstanceRates(10_000, 10_000, 0.1),), offered=12_000)
    a = StageRates("a", 4, (InstanceRates(2_500, 2_500, 0.1),) * 4, {"source": 1})
    b = StageRates("b", 1, (InstanceRates(10_000, 10_000, 1.0),), {"a": 1})
    executor = ScriptedExecutor(scalable={"a": 256, "b": 256})
    settings = SETTINGS.model_copy(update={"scale_down_activation": 1})
    observed = ScriptedMetrics([ScalingInput(0, 30, (source, a, b))])
    loop, events, _ = make_loop(observed, executor, settings)
    decisions = loop.tick(0.0)
    assert [(d.stage, d.action, d.target) for d in decisions] == [
        ("source", "hold", 1),
        ("a", "scale_down", 1),  # 12k/s at 25k/s per instance and 0.8
        ("b", "scale_up", 2),  # 12k/s at 10k/s per instance and 0.8
    ]
    assert executor.applied == [("b", 2), ("a", 1)]
    assert events.problems == []


def test_while_a_decisions_rescales_run_every_stage_holds() -> None:
    executor = ScriptedExecutor(moving="keyed")
    loop, _, _ = make_loop(ScriptedMetrics([overloaded()]), executor)
    keyed = next(d for d in loop.tick(0.0) if d.stage == "keyed")
    assert keyed.action == "hold" and "a rescale of keyed is running" in keyed.reason
    assert executor.applied == []


def test_no_metrics_or_nan_rates_mean_no_decision_and_a_recorded_reason() -> None:
    nan = overloaded(busy=math.nan)
    executor = ScriptedExecutor()
    loop, events, exported = make_loop(
        ScriptedMetrics(["Prometheus at http://x failed: refused", nan]), executor
    )
    assert loop.tick(0.0) == [] and loop.tick(5.0) == []
    assert events.problems == [
        "no decision: Prometheus at http://x failed: refused",
        "no decision: stage keyed has a NaN, infinite or negative rate",
    ]
    assert executor.applied == [] and events.decisions == []
    errors = {**OWNER, "reason": "metrics"}
    assert exported_value(exported, MetricName.AUTOSCALER_ERRORS, errors) == 2


def test_a_refused_rescale_backs_off_instead_of_retrying_every_tick() -> None:
    executor = ScriptedExecutor(refuse="job is draining")
    loop, events, _ = make_loop(ScriptedMetrics([overloaded()]), executor)
    loop.tick(0.0)
    assert events.problems == ["rescale of keyed not started: job is draining"]
    for now in (5.0, 10.0, 15.0):
        keyed = next(d for d in loop.tick(now) if d.stage == "keyed")
        assert keyed.action == "hold" and "backing off after 1 failed" in keyed.reason
    assert len(events.problems) == 1
    loop.tick(21.0)  # the back-off (20 s) is over: one more attempt, then twice as long
    assert len(events.problems) == 2
    keyed = next(d for d in loop.tick(50.0) if d.stage == "keyed")
    assert "backing off after 2 failed" in keyed.reason


def test_a_rescale_that_fails_later_is_recorded_and_backed_off() -> None:
    executor = ScriptedExecutor()
    loop, events, _ = make_loop(ScriptedMetrics([overloaded()]), executor)
    loop.tick(0.0)
    executor.outcomes = [RescaleOutcome("keyed", False, "instance keyed/3 did not register")]
    keyed = next(d for d in loop.tick(5.0) if d.stage == "keyed")
    assert events.problems == ["rescale of keyed failed: instance keyed/3 did not register"]
    assert keyed.action == "hold" and "backing off after 1 failed" in keyed.reason
    assert len(executor.applied) == 1


def test_after_a_rescale_the_window_starts_at_its_end() -> None:
    metrics = ScriptedMetrics([overloaded()])
    executor = ScriptedExecutor()
    loop, _, _ = make_loop(metrics, executor)
    loop.tick(0.0)
    executor.outcomes = [RescaleOutcome("keyed", True, "done")]
    loop.tick(4.0)  # the rescale ended now: 3 s (the least) of metrics, then more as they come
    loop.tick(12.0)
    loop.tick(100.0)
    assert metrics.windows == [30, 3, 8, 30]


def test_dry_run_decides_but_never_applies() -> None:
    executor = ScriptedExecutor()
    settings = SETTINGS.model_copy(update={"dry_run": True})
    loop, _, _ = make_loop(ScriptedMetrics([overloaded()]), executor, settings)
    keyed = next(d for d in loop.tick(0.0) if d.stage == "keyed")
    assert keyed.action == "scale_up" and keyed.reason.endswith(
        "dry run, not applied: scale up 1→4"
    )
    assert executor.applied == []


def test_poll_ticks_once_per_interval() -> None:
    executor = ScriptedExecutor()
    loop, events, _ = make_loop(ScriptedMetrics(["not yet"]), executor)
    clock = loop.clock
    assert isinstance(clock, FixedClock)
    loop.poll()
    clock.t += SETTINGS.interval / 2
    loop.poll()
    clock.t += SETTINGS.interval / 2
    loop.poll()
    assert len(events.problems) == 2


def test_counter_rates_survive_a_restart() -> None:
    samples = [(0.0, {"c": 100.0}), (1.0, {"c": 150.0}), (2.0, {"c": 20.0}), (3.0, {"c": 70.0})]
    assert _rate(samples, "c") == (50 + 20 + 50) / 3


def test_every_sink_is_in_the_metrics_graph_after_the_keyed_stage_feeding_it() -> None:
    spec = load_job(Path(__file__).resolve().parent.parent / "examples" / "user_regions.yaml")
    graph = job_graph(spec)
    assert graph == [
        ("clicks", ()),
        ("per-user", ("clicks",)),
        ("per-region", ("per-user",)),
        ("users", ("per-user",)),
        ("regions", ("per-region",)),
    ]
    # per-user's output counts each update once per way: to per-region and to users.
    out = {"clicks": 1000.0, "per-user": 2000.0, "per-region": 1000.0}
    taken = {"per-user": 1000.0, "per-region": 1000.0, "users": 1000.0, "regions": 1000.0}
    assert shares(graph, taken, out)["users"] == {"per-user": 0.5}


def test_the_metrics_graph_is_the_jobs_and_its_shares_come_from_observed_rates() -> None:
    """clicks feeds users and (through a filter) odds; users feeds regions and the sink; odds
    feeds regions. Each stage's share of an input's output: all of it from an input it alone
    reads; from one it shares with other stages, what it takes in beyond the other inputs'
    output, over that input's output."""
    spec = parse_job(fan_out_and_in(Path("out")))
    graph = job_graph(spec)
    assert graph == [
        ("clicks", ()),
        ("users", ("clicks",)),
        ("odds", ("clicks",)),
        ("regions", ("users", "odds")),
        ("zones", ("regions",)),
        ("out", ("users", "zones")),
    ]
    out = {"clicks": 1500.0, "users": 2000.0, "odds": 500.0, "regions": 2500.0, "zones": 2500.0}
    taken = {"users": 1000.0, "odds": 500.0, "regions": 1500.0, "zones": 2500.0, "out": 3500.0}
    assert shares(graph, taken, out) == {
        "clicks": {},
        "users": {"clicks": 1000 / 1500},
        "odds": {"clicks": 500 / 1500},
        "regions": {"users": 0.5, "odds": 1.0},  # 1,000 of users' 2,000, and odds' 500
        "zones": {"regions": 1.0},
        "out": {"users": 0.5, "zones": 1.0},
    }
    idle = shares(graph, {}, {})
    assert idle["users"] == {"clicks": 0.5} and idle["regions"] == {"users": 0.5, "odds": 1.0}


def test_the_decisions_name_the_stages_chained_in_each_stage_and_why_sources_hold() -> None:
    """The chained map/filter stages of a job's graph have no decision of their own: the
    decisions of the stage they run in name them; a source says why it is not sized."""
    job = parse_job(fan_out_and_in(Path("out")))
    chained = job.dataflow().chained()
    assert chained == {"users": ["to-region"], "regions": ["to-zone"], "clicks": ["keep"],
                       "odds": ["odd-to-region"]}  # fmt: skip
    loop, events, _ = make_loop(ScriptedMetrics([overloaded()]), ScriptedExecutor(),
                                chained={"keyed": ["enrich", "only-big"]})  # fmt: skip
    decisions = {d.stage: d for d in loop.tick(0.0)}
    assert decisions["keyed"].reason.endswith(
        "; runs enrich, only-big chained in its processes, at its parallelism"
    )
    assert "not sized" in decisions["source"].reason
    assert events.decisions == list(decisions.values())
