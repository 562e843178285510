"""One decision step, as every control loop takes it: reject untrustworthy rates, ask the
policy, pass its answer through the guards; the order its rescales run in; and the metrics
window the step should read.

Pure. The autoscaling loop (keyshift.operator.autoscaler) and the simulation harness
(keyshift.policies.simulation) both take their steps here, so the simulation runs exactly the
loop's logic.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from keyshift.policies.guards import GuardState, guard
from keyshift.policies.model import Decision, Policy, ScalingInput
from keyshift.policies.settings import AutoscalerSettings

# Rates over less than this many seconds are mostly noise (and Prometheus needs two scrapes).
MIN_WINDOW = 3.0


@dataclass(frozen=True)
class Step:
    decisions: list[Decision]
    state: GuardState
    problem: str | None = None  # why there are no decisions


def window(state: GuardState, settings: AutoscalerSettings, now: float) -> float:
    """The metrics window, cut at the end of the last rescale: rates from before it describe a
    parallelism that no longer exists."""
    ends = [h.rescaled_at for h in state.stages.values() if h.rescaled_at is not None]
    if not ends:
        return settings.metrics_window
    return max(MIN_WINDOW, min(settings.metrics_window, now - max(ends)))


def rescale_order(decisions: Sequence[Decision]) -> list[Decision]:
    """The rescales of one decision in the order they run, one at a time: every scale-up
    before any scale-down, so capacity is added before any is taken away; within each, in the
    graph's order (upstream first)."""
    acted = [d for d in decisions if d.action != "hold"]
    return sorted(acted, key=lambda d: d.action != "scale_up")


def decide(
    observed: ScalingInput,
    policy: Policy,
    state: GuardState,
    settings: AutoscalerSettings,
    now: float,
    rescaling: str | None = None,
    scalable: Mapping[str, int] | None = None,
) -> Step:
    """Decisions for every stage, or none and the reason. `scalable` names the stages the host
    can rescale (None: all), each with the most instances it can have (a keyed stage: its key
    groups; the sink: its output partitions), which bounds it besides the settings' bounds; the
    other stages' decisions are reported, never applied."""
    problem = next((p for s in observed.stages if (p := s.problem()) is not None), None)
    if problem is not None:
        return Step([], state, f"no decision: {problem}")
    recommendations = [
        r if scalable is None or r.stage in scalable else replace(r, scalable=False)
        for r in policy.decide(observed)
    ]
    decisions, state = guard(
        recommendations, state, settings, now, policy.name, rescaling, scalable or {}
    )
    return Step(decisions, state)
