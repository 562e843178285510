"""Guards between a policy's recommendation and a rescale: bounds, warm-up, back-off,
noise threshold, activation (and a slower scale-down), no decision while a rescale runs, dry run.

Pure: the loop passes in what happened so far as a `GuardState` value and gets the next one
back with the decisions. Called by keyshift.operator.autoscaler and the simulation harness; the
Kubernetes operator keeps the state in the StreamingJob's status (`to_json` / `from_json`), so
a restarted operator goes on with the same warm-up, streaks and back-off.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, get_args

from keyshift.policies.model import Action, Decision, Recommendation
from keyshift.policies.settings import AutoscalerSettings


@dataclass(frozen=True)
class StageHistory:
    """What the guards remember of one stage."""

    rescaled_at: float | None = None  # when its last rescale ended
    direction: Action = "hold"  # of the current streak of recommendations
    streak: tuple[int, ...] = ()  # consecutive recommendations in that direction
    failures: int = 0  # consecutive failed rescales
    blocked_until: float = float("-inf")  # no rescale before this (back-off)

    def to_json(self) -> dict[str, Any]:
        """A plain value. JSON has no infinity: no back-off is a null `blockedUntil` (every key
        is always there, so a merge patch of it also clears what no longer holds)."""
        return {
            "rescaledAt": self.rescaled_at,
            "direction": self.direction,
            "streak": list(self.streak),
            "failures": self.failures,
            "blockedUntil": self.blocked_until if math.isfinite(self.blocked_until) else None,
        }

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> StageHistory:
        """The inverse of `to_json`; raises ValueError naming what is wrong."""
        direction = value.get("direction", "hold")
        if direction not in get_args(Action):
            raise ValueError(f"direction must be one of {get_args(Action)}, got {direction!r}")
        rescaled_at = value.get("rescaledAt")
        blocked_until = value.get("blockedUntil")
        failures = value.get("failures", 0)
        streak = value.get("streak", [])
        if not isinstance(failures, int) or isinstance(failures, bool) or failures < 0:
            raise ValueError(f"failures must be a count, got {failures!r}")
        if not isinstance(streak, list) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in streak
        ):
            raise ValueError(f"streak must be a list of parallelisms, got {streak!r}")
        return cls(
            rescaled_at=None if rescaled_at is None else _time(rescaled_at, "rescaledAt"),
            direction=direction,
            streak=tuple(streak),
            failures=failures,
            blocked_until=(
                float("-inf") if blocked_until is None else _time(blocked_until, "blockedUntil")
            ),
        )


def _time(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a time in seconds, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class GuardState:
    stages: Mapping[str, StageHistory] = field(default_factory=dict)

    def of(self, stage: str) -> StageHistory:
        return self.stages.get(stage, StageHistory())

    def to_json(self) -> dict[str, Any]:
        return {stage: history.to_json() for stage, history in sorted(self.stages.items())}

    @classmethod
    def from_json(cls, value: Any) -> GuardState:
        """The inverse of `to_json`; raises ValueError naming the stage and what is wrong."""
        if not isinstance(value, Mapping):
            raise ValueError(f"guard state must be a mapping of stages, got {value!r}")
        stages = {}
        for stage, history in value.items():
            if not isinstance(history, Mapping):
                raise ValueError(f"stage {stage!r}: expected a mapping, got {history!r}")
            try:
                stages[str(stage)] = StageHistory.from_json(history)
            except ValueError as exc:
                raise ValueError(f"stage {stage!r}: {exc}") from None
        return cls(stages)

    def with_stage(self, stage: str, history: StageHistory) -> GuardState:
        return GuardState({**self.stages, stage: history})

    def rescaled(self, stage: str, now: float) -> GuardState:
        """A rescale of `stage` finished at `now`: warm up, forget the streak and failures."""
        return self.with_stage(stage, StageHistory(rescaled_at=now))

    def failed(self, stage: str, now: float, settings: AutoscalerSettings) -> GuardState:
        """A rescale of `stage` failed at `now`: back off, longer after every failure in a row."""
        old = self.of(stage)
        failures = old.failures + 1
        backoff = min(settings.failure_backoff * 2 ** (failures - 1), settings.max_failure_backoff)
        return self.with_stage(
            stage,
            StageHistory(
                rescaled_at=old.rescaled_at, failures=failures, blocked_until=now + backoff
            ),
        )


def guard(
    recommendations: Sequence[Recommendation],
    state: GuardState,
    settings: AutoscalerSettings,
    now: float,
    policy: str,
    rescaling: str | None = None,
    limits: Mapping[str, int] | None = None,
) -> tuple[list[Decision], GuardState]:
    """Decide what to do for each stage. `rescaling` names a stage whose rescale is running (or
    is the next of a decision's rescales still to run): while one runs, every stage holds.
    Otherwise each stage is guarded on its own, so one tick may rescale several stages: DS2
    sizes the whole graph in one decision, and the host's executor runs its rescales one after
    another (keyshift.operator.autoscaler). `limits`: the most instances a stage can have,
    whatever the settings' bounds say (the sink: its output partitions)."""
    decisions = []
    for rec in recommendations:
        history = state.of(rec.stage)
        most = (limits or {}).get(rec.stage)
        action, target, why, history = _one(rec, history, settings, now, rescaling, most)
        state = state.with_stage(rec.stage, history)
        if action != "hold" and settings.dry_run:
            why = f"dry run, not applied: {why}"
        decisions.append(
            Decision(
                stage=rec.stage,
                at=now,
                policy=policy,
                current=rec.current,
                recommended=rec.recommended,
                target=target,
                action=action,
                reason=f"{rec.reason}; {why}",
                inputs=rec.inputs,
            )
        )
    return decisions, state


def _one(
    rec: Recommendation,
    history: StageHistory,
    settings: AutoscalerSettings,
    now: float,
    busy: str | None,
    most: int | None = None,
) -> tuple[Action, int, str, StageHistory]:
    current = rec.current
    hold: Action = "hold"
    if not rec.scalable:
        return hold, current, "not scaled by the autoscaler", history
    if busy is not None:
        return hold, current, f"held: a rescale of {busy} is running", history
    if history.rescaled_at is not None and now - history.rescaled_at < settings.warmup:
        left = settings.warmup - (now - history.rescaled_at)
        return hold, current, f"held: warming up after a rescale ({left:.0f} s left)", history
    if now < history.blocked_until:
        return (
            hold,
            current,
            f"held: backing off after {history.failures} failed rescale(s) "
            f"({history.blocked_until - now:.0f} s left)",
            history,
        )
    bounds = settings.bounds_of(rec.stage)
    upper = bounds.max_parallelism if most is None else min(bounds.max_parallelism, most)
    lower = min(bounds.min_parallelism, upper)
    wanted = min(max(rec.recommended, lower), upper)
    capped = ""
    if wanted != rec.recommended:
        limit = ": the most instances the stage can have" if upper == most else ""
        capped = f" (bounded to [{lower}, {upper}]{limit})"
    if abs(wanted - current) <= settings.change_threshold * current or wanted == current:
        why = "no change" if wanted == current else (
            f"held: {current}→{wanted} is within the change threshold "
            f"{settings.change_threshold:.0%}"
        )  # fmt: skip
        return hold, current, why + capped, replace(history, direction=hold, streak=())
    direction: Action = "scale_up" if wanted > current else "scale_down"
    streak = (*history.streak, wanted) if history.direction == direction else (wanted,)
    needed = settings.activation if direction == "scale_up" else settings.scale_down_activation
    if len(streak) < needed:
        why = (
            f"held: {direction.replace('_', '-')} to {wanted}{capped} seen "
            f"{len(streak)}/{needed} ticks in a row"
        )
        return hold, current, why, replace(history, direction=direction, streak=streak)
    # Up: the latest answer. Down: the highest of the ticks that agreed, so one low sample
    # cannot take away capacity.
    target = wanted if direction == "scale_up" else max(streak[-needed:])
    why = f"{direction.replace('_', ' ')} {current}→{target}{capped}"
    return direction, target, why, replace(history, direction="hold", streak=())
