"""The StreamingJob custom resource (keyshift.io/v1alpha1): its spec and status as pydantic models.

These models are the single source of truth: `keyshift crds` turns them into the CRD's OpenAPI
schema (`keyshift.operator.crd`), the operator validates every object with them, and the status
it writes is built from them. The embedded job and autoscaler settings are the very models a
job file uses (`keyshift.runtime.job.JobSpec`, `keyshift.policies.settings`), so a job moves from
`keyshift run` to a cluster unchanged. Used by the kopf handlers and the CRD generator.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from keyshift.operator.autoscaled_job import AutoscaledJob
from keyshift.operator.pod_hardening import template_problems
from keyshift.runtime.job import JobError, parse_job_as
from keyshift.runtime.protocol import (
    DEFAULT_STRATEGY,
    STRATEGIES,
    ProtocolError,
    Strategy,
    parse_strategy,
)
from keyshift.runtime.rescale import RescaleError, options_for

GROUP = "keyshift.io"
VERSION = "v1alpha1"
KIND = "StreamingJob"
PLURAL = "streamingjobs"
SINGULAR = "streamingjob"
SHORT_NAMES = ("sj",)
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti)?$"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class ResourceList(_Model):
    cpu: str | None = Field(default=None, pattern=QUANTITY_PATTERN, description="e.g. 500m")
    memory: str | None = Field(default=None, pattern=QUANTITY_PATTERN, description="e.g. 512Mi")


class Resources(_Model):
    requests: ResourceList = Field(
        default_factory=lambda: ResourceList(cpu="250m", memory="256Mi"),
        description="what each worker pod asks for",
    )
    limits: ResourceList = Field(
        default_factory=lambda: ResourceList(cpu="1", memory="1Gi"),
        description="what each worker pod may use at most",
    )


class Migration(_Model):
    """How keyed state moves between instances when the keyed stage rescales: the one place
    for every rescale of the job, manual (`kubectl scale`, an edit) or the autoscaler's."""

    strategy: Strategy = Field(
        default=DEFAULT_STRATEGY,
        description="how keyed state moves in every rescale, manual or the autoscaler's "
        "(spec.job.autoscaler.strategy is a deprecated alias)",
    )
    options: dict[str, Annotated[float, Field(ge=0)]] = Field(
        default_factory=dict,
        description="strategy options, e.g. batch_groups: 256 (positive numbers), or handover: "
        "0 to move state directly instead of handing it over from the latest checkpoint (1, the "
        "default, in a checkpointed job); which ones apply depends on the strategy; sent with "
        "every rescale",
    )


class SparkApp(_Model):
    """A PySpark job that feeds the StreamingJob (a source) or reads its output (a sink)."""

    name: str = Field(pattern=r"^[a-z][a-z0-9-]{0,39}$")
    image: str | None = Field(default=None, description="defaults to the StreamingJob's image")
    script: str = Field(min_length=1, description="path of the PySpark script in the image")
    args: list[str] = Field(default_factory=list, description="arguments of the script")
    resources: Resources = Field(default_factory=Resources)
    stage: str | None = Field(
        default=None,
        description="spec.sources: the ingest source stage it writes into (its address is "
        "KEYSHIFT_INGEST); needed when the job has several ingest sources",
    )


# A DNS subdomain name, as Kubernetes names Secrets and claims.
SECRET_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"
# Names of storage options that carry credentials: they belong in a Secret, never in the spec.
CREDENTIAL_OPTIONS = frozenset(
    {"key", "secret", "token", "password", "access_key", "secret_key", "session_token",
     "aws_access_key_id", "aws_secret_access_key", "aws_session_token", "account_key",
     "sas_token", "client_secret", "connection_string"}
)  # fmt: skip


class OutputLocation(_Model):
    """Where the job's output log (a `log` sink) lives, so that its Spark sinks can read it."""

    claim: str = Field(
        pattern=SECRET_NAME_PATTERN,
        description="a PersistentVolumeClaim (ReadWriteMany) mounted at the log sink's output "
        "directory (job.sink.config.path) in the sink stage's pods and every spec.sinks app: "
        "the output outlives the pods and the Spark sinks read it there; with several log "
        "sinks, a subdirectory of it per sink (named after the sink) at each sink's directory",
    )


class StorageCredentials(_Model):
    """Checkpoint/output storage credentials, as environment variables from a Secret (fsspec
    and its S3, GCS and Azure back ends read them from the environment)."""

    secret_name: str = Field(alias="secretName", pattern=SECRET_NAME_PATTERN)
    keys: dict[str, str] = Field(
        default_factory=lambda: {
            "AWS_ACCESS_KEY_ID": "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY": "AWS_SECRET_ACCESS_KEY",
        },
        description="environment variable -> key in the Secret",
    )


class JobTls(_Model):
    """TLS on every port of the job, from a Secret with tls.crt, tls.key and ca.crt (the
    layout cert-manager writes)."""

    secret_name: str = Field(alias="secretName", pattern=SECRET_NAME_PATTERN)
    server_name: str | None = Field(
        default=None,
        alias="serverName",
        description="the name the certificate is for, when it does not name every pod's IP",
    )


class StreamingJobSpec(_Model):
    """What to run (image and job) and how it scales and moves its state."""

    image: str | None = Field(
        default=None,
        min_length=1,
        description="container image with keyshift and the job's code; by default the image "
        "the operator is given for jobs (the chart's keyshift image, pinned by digest if set)",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", alias="imagePullPolicy"
    )
    job: dict[str, Any] = Field(
        description="the job, exactly as a `keyshift run` job file (name, source, keyed, sink, "
        "batching, autoscaler); stage parallelism is the initial one"
    )
    migration: Migration = Field(default_factory=Migration)
    sources: list[SparkApp] = Field(default_factory=list, description="PySpark jobs feeding it")
    sinks: list[SparkApp] = Field(default_factory=list, description="PySpark jobs reading it")
    resources: Resources = Field(default_factory=Resources)
    pod_template: dict[str, Any] = Field(
        default_factory=dict,
        alias="podTemplate",
        description="merged into every worker pod template (labels, tolerations, ...); it may "
        "not undo the pods' hardening (no privileged or root containers, privilege escalation, "
        "added capabilities, host namespaces or hostPath volumes)",
    )
    service_account: str | None = Field(
        default=None,
        alias="serviceAccountName",
        pattern=r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$",
        description="the service account of every pod (its token is not mounted)",
    )
    checkpoint_claim: str | None = Field(
        default=None,
        alias="checkpointClaim",
        pattern=r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$",
        description="a PersistentVolumeClaim (ReadWriteMany) mounted at the job's checkpoint "
        "directory in the coordinator and every stage pod: needed when job.checkpoints.storage "
        "is a local path (checkpoints, and an ingest source's log, live there)",
    )
    storage_credentials: StorageCredentials | None = Field(
        default=None,
        alias="storageCredentials",
        description="a Secret whose keys become the storage credentials' environment variables "
        "in every pod (never inline in job.checkpoints.storage_options)",
    )
    tls: JobTls | None = Field(default=None, description="TLS on every port of the job")

    output: OutputLocation | None = Field(
        default=None,
        description="where the output log lives; without it, in the sink pods' emptyDir (gone "
        "with the pods, and no Spark sink can read it)",
    )

    @field_validator("job")
    @classmethod
    def _job_is_a_mapping(cls, job: dict[str, Any]) -> dict[str, Any]:
        if "name" not in job:
            raise ValueError("job.name is required")
        return job

    def job_spec(self) -> AutoscaledJob:
        """The embedded job, validated as `keyshift run` would, but without importing the user's
        functions (they live in the image): raises JobError naming each bad field."""
        return parse_job_as(AutoscaledJob, self.job, "spec.job", resolve_functions=False)

    def _alias_strategy(self) -> str | None:
        """spec.job.autoscaler.strategy, the deprecated place of the loop's strategy."""
        autoscaler = self.job.get("autoscaler")
        strategy = autoscaler.get("strategy") if isinstance(autoscaler, dict) else None
        return str(strategy) if strategy is not None else None

    def strategy(self) -> Strategy:
        """The strategy of every rescale: spec.migration.strategy, or the deprecated
        spec.job.autoscaler.strategy when only that one is set (`problems` refuses the two
        set apart)."""
        alias = self._alias_strategy()
        if alias is not None and "strategy" not in self.migration.model_fields_set:
            return parse_strategy(alias)
        return self.migration.strategy

    def deprecations(self) -> list[str]:
        """Fields that still work but should move; one warning each."""
        if self._alias_strategy() is None:
            return []
        return [
            "spec.job.autoscaler.strategy is deprecated: set spec.migration.strategy, the one "
            "strategy of every rescale (manual and the autoscaler's)"
        ]

    def problems(self) -> list[str]:
        """What the schema cannot express but makes the job unrunnable; every problem found,
        one message each (empty when the spec can run)."""
        found: list[str] = []
        spec: AutoscaledJob | None
        try:
            spec = self.job_spec()
        except JobError as exc:
            spec = None
            found.append(str(exc))
        alias = self._alias_strategy()
        if (
            alias is not None
            and "strategy" in self.migration.model_fields_set
            and alias != self.migration.strategy
        ):
            found.append(
                f"spec.job.autoscaler.strategy ({alias}) disagrees with spec.migration.strategy "
                f"({self.migration.strategy}): one strategy applies to every rescale; set it in "
                "spec.migration.strategy only"
            )
        try:
            options_for(self.strategy(), dict(self.migration.options))
        except (RescaleError, ProtocolError) as exc:
            found.append(f"spec.migration: {exc}")
        found += template_problems(self.pod_template)
        if spec is not None and spec.checkpoints is not None:
            found.extend(
                f"spec.job.checkpoints.storage_options.{path}: credentials do not go inline; "
                "put them in a Secret named by spec.storageCredentials"
                for path in _credential_paths(spec.checkpoints.storage_options)
            )
        names = {app.name for app in [*self.sources, *self.sinks]}
        if len(names) != len(self.sources) + len(self.sinks):
            found.append("spec.sources and spec.sinks need distinct names")
        if spec is not None and spec.autoscaler is not None:
            for step in spec.keyed_stages():
                stage, bounds = step.stage, spec.autoscaler.bounds_of(step.stage.name)
                if not bounds.min_parallelism <= stage.parallelism <= bounds.max_parallelism:
                    where = (
                        f"spec.job.graph stage {stage.name}'s parallelism"
                        if spec.graph is not None
                        else "spec.job.keyed.parallelism"
                    )
                    found.append(
                        f"{where} {stage.parallelism} is outside the autoscaler's bounds "
                        f"[{bounds.min_parallelism}, {bounds.max_parallelism}]"
                    )
        return found


def _credential_paths(options: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted paths of credential-looking keys in (nested) storage options."""
    found = []
    for key, value in options.items():
        path = f"{prefix}{key}"
        if key.lower() in CREDENTIAL_OPTIONS:
            found.append(path)
        elif isinstance(value, dict):
            found.extend(_credential_paths(value, f"{path}."))
    return found


class StageStatus(_Model):
    name: str
    current: int = Field(description="instances registered with the coordinator")
    target: int = Field(description="instances the job should have")
    ready: int = Field(
        description="instances' pods ready (of a stage keeping standbys: at most `target`, "
        "since its StatefulSet also runs the standbys)"
    )
    standbys: int = Field(
        default=0, description="warm standbys waiting for a scale-out (a keyed stage's `standby`)"
    )
    last_decision: str = Field(
        default="",
        alias="lastDecision",
        description="why the autoscaler's latest decision for this stage was what it was",
    )
    pending: int | None = Field(
        default=None,
        description="the parallelism a rescale of the decision being applied, not started yet, "
        "takes it to (status.pendingRescales has the whole decision)",
    )


class DecisionStatus(_Model):
    time: str
    stage: str
    from_: int = Field(alias="from")
    to: int
    action: str
    reason: str
    inputs: dict[str, float] = Field(default_factory=dict)


class RescaleStatus(_Model):
    id: int
    stage: str
    from_: int = Field(alias="from")
    to: int
    strategy: str
    options: dict[str, float] = Field(
        default_factory=dict, description="the strategy's options the rescale ran with"
    )
    phase: str
    duration: float
    error: str | None = None


class GuardStatus(_Model):
    """What the autoscaler's guards remember of one stage (keyshift.policies.guards), kept so
    a restarted operator goes on with it; times in seconds since the epoch."""

    rescaled_at: float | None = Field(
        default=None, alias="rescaledAt", description="when its last rescale ended (warm-up)"
    )
    direction: Literal["scale_up", "scale_down", "hold"] = "hold"
    streak: list[int] = Field(
        default_factory=list, description="consecutive recommendations in that direction"
    )
    failures: int = Field(default=0, ge=0, description="consecutive failed rescales")
    blocked_until: float | None = Field(
        default=None, alias="blockedUntil", description="no rescale before this (back-off)"
    )


class RecoveryStatus(_Model):
    """The job's recoveries from its checkpoints, as its coordinator keeps them (with the
    checkpoints, so over the job's life)."""

    total: int = Field(default=0, ge=0, description="recoveries so far")
    last_checkpoint: int | None = Field(
        default=None, alias="lastCheckpoint", description="the checkpoint the last one went on from"
    )
    last_reason: str = Field(default="", alias="lastReason", description="why it was needed")
    last_seconds: float | None = Field(
        default=None,
        alias="lastSeconds",
        description="seconds from the failure noticed to the job running again",
    )
    last_mode: Literal["local", "global"] | None = Field(
        default=None,
        alias="lastMode",
        description="local: the lost instance was started again alone and the others rewound "
        "in place; global: every process was restarted",
    )


class RestartMemoryStatus(_Model):
    """The restart strategy's memory (keyshift.operator.k8s_restarts), read back on start; times
    in seconds since the epoch."""

    failures: list[float] = Field(
        default_factory=list, description="when the failures the operator restarted after came"
    )
    handled: str | None = Field(default=None, description="the failed coordinator taken in")
    due: float | None = Field(default=None, description="when it is to be restarted")
    gave_up: str | None = Field(
        default=None, alias="gaveUp", description="why the job is not restarted again"
    )


class RescaleMarkStatus(_Model):
    """The last rescale whose outcome the operator has taken: the coordinator process
    (incarnation) and the rescale's id in it."""

    incarnation: str
    id: int = Field(ge=0)


class PendingStepStatus(_Model):
    stage: str
    parallelism: int = Field(ge=1)


class StartedRescaleStatus(RescaleMarkStatus):
    stage: str = Field(description="the stage it rescales")


class PendingRescalesStatus(_Model):
    """What is left of the decision (the autoscaler's, or an edit of several stages) the
    operator applies one rescale at a time; read back on start, so a restart loses none."""

    started: StartedRescaleStatus | None = Field(
        default=None, description="the rescale started last, its end not seen yet"
    )
    queued: list[PendingStepStatus] = Field(
        default_factory=list, description="the rescales to start after it, in order"
    )


class Condition(_Model):
    """One aspect of the job's state, as the Kubernetes API conventions shape conditions; the
    operator keeps them with `keyshift.operator.conditions.upsert_conditions`."""

    type: Literal["Ready", "Rescaling", "Degraded"]
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str = ""
    observed_generation: int = Field(
        default=0,
        alias="observedGeneration",
        description="the metadata.generation the condition was computed from",
    )
    last_transition_time: str = Field(
        alias="lastTransitionTime",
        json_schema_extra={"format": "date-time"},
        description="when the status last changed",
    )


class StreamingJobStatus(_Model):
    """What the operator observed and decided; only the operator writes it."""

    phase: Literal[
        "Pending", "Running", "Rescaling", "Recovering", "Degraded", "Failed", "Finished"
    ] = "Pending"
    observed_generation: int = Field(default=0, alias="observedGeneration")
    parallelism: int = Field(
        default=0,
        description="the keyed stage's current parallelism (the scale subresource's replicas)",
    )
    selector: str = Field(default="", description="label selector of the keyed stage's pods")
    stages: list[StageStatus] = Field(default_factory=list)
    decisions: list[DecisionStatus] = Field(default_factory=list, description="the latest")
    rescales: list[RescaleStatus] = Field(default_factory=list, description="the latest")
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Ready, Rescaling and Degraded, one of each type",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    message: str = ""
    guards: dict[str, GuardStatus] = Field(
        default_factory=dict, description="the autoscaler's memory per stage, read back on start"
    )
    handled_rescale: RescaleMarkStatus | None = Field(
        default=None,
        alias="handledRescale",
        description="the last rescale the operator took the outcome of, read back on start",
    )
    pending_rescales: PendingRescalesStatus | None = Field(
        default=None,
        alias="pendingRescales",
        description="the rescales of a decision not done yet, one at a time; read back on start",
    )
    recoveries: RecoveryStatus = Field(
        default_factory=RecoveryStatus, description="recoveries from checkpoints"
    )
    restarts: RestartMemoryStatus | None = Field(
        default=None,
        description="the restart strategy's memory: restarts of a failed job, read back on start",
    )


class StreamingJob(_Model):
    """A keyshift stream-processing job whose stages rescale live (the whole object)."""

    api_version: Literal["keyshift.io/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["StreamingJob"]
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: StreamingJobSpec = Field(description="the job, its image, scaling and state migration")
    status: StreamingJobStatus | None = Field(
        default=None, description="written by the operator: phase, parallelism, decisions"
    )


__all__ = [
    "CREDENTIAL_OPTIONS",
    "GROUP",
    "KIND",
    "PLURAL",
    "SHORT_NAMES",
    "SINGULAR",
    "STRATEGIES",
    "VERSION",
    "Condition",
    "DecisionStatus",
    "GuardStatus",
    "JobTls",
    "Migration",
    "OutputLocation",
    "RescaleMarkStatus",
    "RescaleStatus",
    "Resources",
    "SparkApp",
    "StageStatus",
    "StorageCredentials",
    "StreamingJob",
    "StreamingJobSpec",
    "StreamingJobStatus",
]
