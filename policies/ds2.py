"""DS2 (Kalavri et al., OSDI'18, "Three steps is all you need"): parallelism from true rates.

Per instance, the true processing rate is records processed per second of useful (busy) time,
and the true output rate likewise; a stage's true rates are the sums over its instances. The
target input rate of each stage comes from the sources' offered rates (plus a backlog to catch
up) through every upstream stage's observed selectivity, in one pass over the graph; the
optimal parallelism is ceil(target input rate / true processing rate per instance), divided by
the target utilization to leave headroom. Pure: called by the control loop and the simulation.
"""

from __future__ import annotations

import math

from keyshift.policies.model import Recommendation, ScalingInput, StageRates, rate_text
from keyshift.policies.settings import AutoscalerSettings

# An instance busy less than this fraction of the window says too little about its capacity.
MIN_BUSY = 0.01
# Rates are measured, so 2.0000001 instances' worth of work is two instances, not three.
EPSILON = 1e-6


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
        target_out: dict[str, float | None] = {}
        result = []
        for stage in given.stages:
            if stage.is_source:
                rec, target_out[stage.name] = self._source(stage)
            else:
                rec, target_out[stage.name] = self._operator(stage, target_out)
            result.append(rec)
        return result

    def _source(self, stage: StageRates) -> tuple[Recommendation, float | None]:
        problem = stage.problem()
        if problem is not None:
            return _hold(stage, problem, scalable=False), None
        offered = stage.offered if stage.offered is not None else stage.records_in
        target_in = offered + stage.backlog / self.settings.catch_up
        selectivity = stage.records_out / stage.records_in if stage.records_in > 0 else 1.0
        reason = (
            f"{stage.name}: source, offered {rate_text(offered)}, "
            f"backlog {stage.backlog:,.0f} records, selectivity {selectivity:.2f}"
        )
        inputs = {
            "offered_rate": offered,
            "backlog": stage.backlog,
            "target_rate": target_in,
            "selectivity": selectivity,
            "busy": stage.busy,
        }
        rec = Recommendation(
            stage.name, stage.parallelism, stage.parallelism, reason, inputs, scalable=False
        )
        return rec, target_in * selectivity

    def _operator(
        self, stage: StageRates, target_out: dict[str, float | None]
    ) -> tuple[Recommendation, float | None]:
        problem = stage.problem()
        if problem is not None:
            return _hold(stage, problem), None
        upstream = {u: target_out.get(u) for u in stage.upstream}
        unknown = sorted(u for u, t in upstream.items() if t is None)
        if unknown:
            return _hold(stage, f"no target rate for upstream {', '.join(unknown)}"), None
        target_in = sum((t or 0.0) * share for (u, t), share in zip(
            upstream.items(), stage.upstream.values(), strict=True
        ))  # fmt: skip
        processing, output, measured = true_rates(stage)
        if measured == 0:
            if target_in <= EPSILON:
                reason = f"{stage.name}: {stage.parallelism}→1, no input"
                return Recommendation(stage.name, stage.parallelism, 1, reason, {}), 0.0
            return _hold(stage, f"no busy time measured for stage {stage.name} yet"), None
        per_instance = processing / measured
        selectivity = output / processing if processing > 0 else 1.0
        optimal = optimal_parallelism(target_in, per_instance, self.settings.target_utilization)
        reason = (
            f"{stage.name}: {stage.parallelism}→{optimal}, true rate {rate_text(per_instance)} "
            f"per instance, target {rate_text(target_in)}, busy {stage.busy:.2f}"
        )
        inputs = {
            "target_rate": target_in,
            "true_rate_per_instance": per_instance,
            "observed_rate": stage.records_in,
            "selectivity": selectivity,
            "busy": stage.busy,
        }
        rec = Recommendation(stage.name, stage.parallelism, optimal, reason, inputs)
        return rec, target_in * selectivity


def _hold(stage: StageRates, why: str, scalable: bool = True) -> Recommendation:
    return Recommendation(
        stage.name, stage.parallelism, stage.parallelism, f"{stage.name}: {why}", {}, scalable
    )
