"""Every autoscaler setting, with its default and a one-line description, in one model.

A job file's `autoscaler:` section and a StreamingJob's `spec.autoscaler` are this model; the
README's settings table is generated from it (`settings_table`). Read by the policies, the
guards and the control loop in keyshift.operator.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# The most instances one stage may have: a job file's parallelism, a rescale (the coordinator
# refuses one above it), the autoscaler's bounds and the StreamingJob CRD's schema all take it
# from here; the coordinator's and the instances' gRPC servers are sized for it.
MAX_PARALLELISM = 256


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StageBounds(_Model):
    min_parallelism: int = Field(
        default=1, ge=1, le=MAX_PARALLELISM, description="never scale below this"
    )
    max_parallelism: int = Field(
        default=8, ge=1, le=MAX_PARALLELISM, description="never scale above this"
    )

    @model_validator(mode="after")
    def _ordered(self) -> StageBounds:
        if self.min_parallelism > self.max_parallelism:
            raise ValueError(
                f"min_parallelism ({self.min_parallelism}) must not exceed "
                f"max_parallelism ({self.max_parallelism})"
            )
        return self


class AutoscalerSettings(_Model):
    policy: Literal["ds2", "threshold"] = Field(
        default="ds2",
        description="ds2 (rates and selectivities, one step) or threshold (busy ratio, as HPA)",
    )
    interval: float = Field(
        default=5.0, gt=0, le=3600, description="seconds between two ticks of the loop"
    )
    metrics_window: float = Field(
        default=15.0, gt=0, le=86_400, description="seconds of metrics each decision averages"
    )
    warmup: float = Field(
        default=10.0,
        ge=0,
        le=86_400,
        description="seconds after a rescale before the stage's metrics count again",
    )
    activation: int = Field(
        default=2, ge=1, le=1000, description="consecutive ticks a scale-up must repeat"
    )
    scale_down_activation: int = Field(
        default=6,
        ge=1,
        le=1000,
        description="consecutive ticks a scale-down must repeat (it takes the highest of them)",
    )
    change_threshold: float = Field(
        default=0.1,
        ge=0,
        lt=1,
        description="ignore a new parallelism within this fraction of the current one",
    )
    target_utilization: float = Field(
        default=0.8,
        gt=0,
        le=1,
        description="busy fraction each instance should run at (headroom for bursts)",
    )
    catch_up: float = Field(
        default=300.0,
        gt=0,
        le=86_400,
        description="ds2: seconds in which a source's backlog is caught up; it adds instances "
        "only when the target utilization's headroom would take longer",
    )
    client_catch_up: float = Field(
        default=30.0,
        gt=0,
        le=86_400,
        description="ds2: seconds in which the backlog an ingest source's clients report (rows "
        "due but not pushed yet) is caught up; it adds backlog / client_catch_up to the "
        "source's target rate",
    )
    scale_up_busy: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="threshold policy: busy ratio above which a stage scales up",
    )
    scale_down_busy: float = Field(
        default=0.4,
        ge=0,
        lt=1,
        description="threshold policy: busy ratio below which a stage scales down",
    )
    failure_backoff: float = Field(
        default=30.0,
        gt=0,
        le=86_400,
        description="seconds before retrying after a failed rescale (doubles per failure)",
    )
    max_failure_backoff: float = Field(
        default=600.0, gt=0, le=86_400, description="longest back-off after repeated failures"
    )
    dry_run: bool = Field(default=False, description="decide and report, but never rescale")
    strategy: Literal["hot-first", "all-at-once", "batched", "lazy"] = Field(
        default="hot-first", description="how state moves when the loop rescales"
    )
    prometheus_url: str | None = Field(
        default=None,
        description="Prometheus to read metrics from; none scrapes the instances directly",
    )
    bounds: StageBounds = Field(
        default_factory=StageBounds, description="parallelism bounds of every stage"
    )
    stages: dict[str, StageBounds] = Field(
        default_factory=dict, description="bounds for named stages, overriding `bounds`"
    )

    @model_validator(mode="after")
    def _consistent(self) -> AutoscalerSettings:
        if self.scale_down_busy >= self.scale_up_busy:
            raise ValueError(
                f"scale_down_busy ({self.scale_down_busy}) must be below "
                f"scale_up_busy ({self.scale_up_busy})"
            )
        if self.max_failure_backoff < self.failure_backoff:
            raise ValueError("max_failure_backoff must not be below failure_backoff")
        return self

    def bounds_of(self, stage: str) -> StageBounds:
        return self.stages.get(stage, self.bounds)


def settings_table() -> str:
    """The settings as a Markdown table (name, default, description), for the README."""
    rows = ["| setting | default | what it does |", "|---|---|---|"]
    for name, field in AutoscalerSettings.model_fields.items():
        default = field.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            default = default.model_dump()
        rows.append(f"| `{name}` | `{default!r}` | {field.description} |")
    for name, field in StageBounds.model_fields.items():
        rows.append(f"| `bounds.{name}` | `{field.default!r}` | {field.description} |")
    return "\n".join(rows)
