"""The baseline: scale on the busy ratio alone, as Kubernetes' HPA scales on CPU.

Outside the band [scale_down_busy, scale_up_busy] the new parallelism is HPA's
ceil(current * busy / target utilization); inside it nothing changes. Busy time saturates at
1.0, so a badly overloaded stage grows by at most 1/target_utilization per decision: the
baseline needs several decisions where DS2 needs one. Pure; used by the loop and the simulation.
"""

from __future__ import annotations

import math

from keyshift.policies.ds2 import EPSILON
from keyshift.policies.model import Recommendation, ScalingInput, StageRates
from keyshift.policies.settings import AutoscalerSettings


class ThresholdPolicy:
    name = "threshold"

    def __init__(self, settings: AutoscalerSettings) -> None:
        self.settings = settings

    def decide(self, given: ScalingInput) -> list[Recommendation]:
        return [self._stage(stage) for stage in given.stages]

    def _stage(self, stage: StageRates) -> Recommendation:
        current = stage.parallelism
        problem = stage.problem()
        if problem is not None:
            return Recommendation(stage.name, current, current, f"{stage.name}: {problem}", {},
                                  scalable=not stage.is_source)  # fmt: skip
        busy = stage.busy
        inputs = {"busy": busy, "observed_rate": stage.records_in}
        s = self.settings
        if stage.is_source:
            reason = f"{stage.name}: source, busy {busy:.2f}"
            return Recommendation(stage.name, current, current, reason, inputs, scalable=False)
        if s.scale_down_busy <= busy <= s.scale_up_busy:
            wanted = current
            why = f"busy {busy:.2f} within [{s.scale_down_busy}, {s.scale_up_busy}]"
        else:
            wanted = max(1, math.ceil(current * busy / s.target_utilization - EPSILON))
            side = "above" if busy > s.scale_up_busy else "below"
            bound = s.scale_up_busy if busy > s.scale_up_busy else s.scale_down_busy
            why = f"busy {busy:.2f} {side} {bound}, target utilization {s.target_utilization}"
        reason = f"{stage.name}: {current}→{wanted}, {why}"
        return Recommendation(stage.name, current, wanted, reason, inputs)
