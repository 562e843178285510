"""DS2 (Kalavri et al., OSDI'18, "Three steps is all you need"): parallelism from true rates.

Per instance, the true processing rate is records processed per second of useful (busy) time,
and the true output rate likewise; a stage's true rates are the sums over its instances. The
target input rate of each stage comes from the sources' offered rates through every upstream
stage's observed selectivity, in one pass over the graph; the optimal parallelism is
ceil(target input rate / (true processing rate per instance * target utilization)).

A source's backlog is caught up by the headroom the target utilization leaves: it adds
instances only when that headroom would take longer than `catch_up` seconds, i.e. when the
catch-up rate (offered + backlog / catch_up, through the same selectivities) exceeds the target
rate / target utilization; then a stage gets ceil(catch-up rate / true rate per instance). So
the ordinary backlog a step or a rescale leaves behind never buys instances that must be given
back once it is drained (an overshoot, then a reversal, under a load that no longer changes).

The backlog an ingest source's clients report (rows due but not pushed yet: demand that has not
reached the job) is different: it goes into the source's target rate itself, observed rate +
client backlog / `client_catch_up` (see `_source`).

An instance busy less than MIN_BUSY of the window says nothing of its true rate. When no
instance of a stage is busier, the stage is all but idle: each instance does at least its
records in / MIN_BUSY, a lower bound that may scale the stage in but never out.
Pure: called by the control loop and the simulation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from keyshift.policies.model import Recommendation, ScalingInput, StageRates, rate_text
from keyshift.policies.settings import AutoscalerSettings

# An instance busy less than this fraction of the window says too little about its capacity.
MIN_BUSY = 0.01
# Rates are measured, so 2.0000001 instances' worth of work is two instances, not three.
EPSILON = 1e-6


@dataclass(frozen=True)
class Rates:
    """A stage's target output rate, and the rate that would also catch up the backlog."""

    target: float
    catch_up: float


def true_rates(stage: StageRates) -> tuple[float, float, int]:
    """(true processing rate, true output rate, instances measured), summed over the instances
    that were busy enough to say something about their capacity."""
    measured = [i for i in stage.instances if i.busy >= MIN_BUSY]
    processing = sum(i.records_in / i.busy for i in measured)
    output = sum(i.records_out / i.busy for i in measured)
    return processing, output, len(measured)


def optimal_parallelism(target: float, per_instance: float, utilization: float) -> int:
    return max(1, math.ceil(target / (per_instance * utilization) - EPSILON))


class DS2Policy:
    name = "ds2"

    def __init__(self, settings: AutoscalerSettings) -> None:
        self.settings = settings

    def decide(self, given: ScalingInput) -> list[Recommendation]:
        target_out: dict[str, Rates | None] = {}
        result = []
        for stage in given.stages:
            if stage.is_source:
                rec, target_out[stage.name] = self._source(stage)
            else:
                rec, target_out[stage.name] = self._operator(stage, target_out)
            result.append(rec)
        return result

    def _source(self, stage: StageRates) -> tuple[Recommendation, Rates | None]:
        problem = stage.problem()
        if problem is not None:
            return _hold(stage, problem, scalable=False), None
        offered = stage.offered if stage.offered is not None else stage.records_in
        # Rows the clients report due but not pushed yet are demand the job has not seen: while
        # the job pushes back, what an ingest source takes in is what the job manages, not what
        # arrives. Flink's autoscaler sizes a source for its processing rate plus its lag over
        # `job.autoscaler.catch-up.duration` (on top of the utilization-scaled input rate); DS2
        # here adds the client backlog over `client_catch_up` to the target rate, so it flows
        # through the selectivities like the offered rate. Into the target, not only the
        # catch-up rate below: these rows are late already, and the headroom rule would leave
        # them waiting as long as the headroom lasts. Hence a horizon short beside `catch_up`'s,
        # yet long enough that the standing backlog of a micro-batching client (about one batch
        # interval of rows) adds a few percent, within the headroom, and not an instance.
        target = offered + stage.client_backlog / self.settings.client_catch_up
        catch_up = target + stage.backlog / self.settings.catch_up
        selectivity = stage.records_out / stage.records_in if stage.records_in > 0 else 1.0
        clients = (
            f", clients' backlog {stage.client_backlog:,.0f} records (target {rate_text(target)})"
            if stage.client_backlog > 0
            else ""
        )
        reason = (
            f"{stage.name}: source (not sized: its partitions, set when the job starts), "
            f"offered {rate_text(offered)}{clients}, "
            f"backlog {stage.backlog:,.0f} records, selectivity {selectivity:.2f}"
        )
        inputs = {
            "offered_rate": offered,
            "backlog": stage.backlog,
            "client_backlog": stage.client_backlog,
            "target_rate": target,
            "catch_up_rate": catch_up,
            "selectivity": selectivity,
            "busy": stage.busy,
        }
        rec = Recommendation(
            stage.name, stage.parallelism, stage.parallelism, reason, inputs, scalable=False
        )
        return rec, Rates(target * selectivity, catch_up * selectivity)

    def _operator(
        self, stage: StageRates, target_out: dict[str, Rates | None]
    ) -> tuple[Recommendation, Rates | None]:
        problem = stage.problem()
        if problem is not None:
            return _hold(stage, problem), None
        upstream: dict[str, Rates] = {}
        unknown = []
        for name in stage.upstream:
            rates = target_out.get(name)
            if rates is None:
                unknown.append(name)
            else:
                upstream[name] = rates
        if unknown:
            return _hold(stage, f"no target rate for upstream {', '.join(sorted(unknown))}"), None
        target_in = sum(upstream[u].target * share for u, share in stage.upstream.items())
        catch_up_in = sum(upstream[u].catch_up * share for u, share in stage.upstream.items())
        processing, output, measured = true_rates(stage)
        if measured == 0:
            if catch_up_in <= EPSILON:
                reason = f"{stage.name}: {stage.parallelism}→1, no input"
                return Recommendation(stage.name, stage.parallelism, 1, reason, {}), Rates(0, 0)
            return self._idle(stage, target_in, catch_up_in)
        per_instance = processing / measured
        selectivity = output / processing if processing > 0 else 1.0
        optimal = optimal_parallelism(target_in, per_instance, self.settings.target_utilization)
        catching_up = optimal_parallelism(catch_up_in, per_instance, 1.0)
        why = f"target {rate_text(target_in)}"
        if catching_up > optimal:
            optimal = catching_up
            why = (
                f"catch-up rate {rate_text(catch_up_in)} (target {rate_text(target_in)} "
                f"plus the backlog over {self.settings.catch_up:g} s)"
            )
        reason = (
            f"{stage.name}: {stage.parallelism}→{optimal}, true rate {rate_text(per_instance)} "
            f"per instance, {why}, busy {stage.busy:.2f}"
        )
        inputs = {
            "target_rate": target_in,
            "catch_up_rate": catch_up_in,
            "true_rate_per_instance": per_instance,
            "observed_rate": stage.records_in,
            "selectivity": selectivity,
            "busy": stage.busy,
        }
        rec = Recommendation(stage.name, stage.parallelism, optimal, reason, inputs)
        return rec, Rates(target_in * selectivity, catch_up_in * selectivity)

    def _idle(
        self, stage: StageRates, target_in: float, catch_up_in: float
    ) -> tuple[Recommendation, Rates | None]:
        """No instance was busy enough to measure its capacity. One that took in records at
        under MIN_BUSY busy does at least records in / MIN_BUSY when busy throughout: a bound
        loose enough to scale in a stage that is all but idle, never to scale one out."""
        if stage.records_in <= 0:
            return _hold(stage, f"no busy time measured for stage {stage.name} yet"), None
        selectivity = stage.records_out / stage.records_in
        rates = Rates(target_in * selectivity, catch_up_in * selectivity)
        at_least = stage.records_in / (len(stage.instances) * MIN_BUSY)
        utilization = self.settings.target_utilization
        enough = max(
            optimal_parallelism(target_in, at_least, utilization),
            optimal_parallelism(catch_up_in, at_least, 1.0),
        )
        if enough >= stage.parallelism:
            return _hold(stage, f"no busy time measured for stage {stage.name} yet"), rates
        reason = (
            f"{stage.name}: {stage.parallelism}→{enough}, every instance under {MIN_BUSY:.0%} "
            f"busy: true rate at least {rate_text(at_least)} per instance, "
            f"target {rate_text(target_in)}"
        )
        inputs = {
            "target_rate": target_in,
            "catch_up_rate": catch_up_in,
            "true_rate_per_instance": at_least,
            "observed_rate": stage.records_in,
            "selectivity": selectivity,
            "busy": stage.busy,
        }
        return Recommendation(stage.name, stage.parallelism, enough, reason, inputs), rates


def _hold(stage: StageRates, why: str, scalable: bool = True) -> Recommendation:
    return Recommendation(
        stage.name, stage.parallelism, stage.parallelism, f"{stage.name}: {why}", {}, scalable
    )
