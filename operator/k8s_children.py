"""The Kubernetes objects a StreamingJob owns, built as plain manifests (dicts).

Pure functions, no I/O: the kopf handlers in `keyshift.operator.k8s_operator` call `children`
on create, update and resume, adopt each manifest (`kopf.adopt` sets the owner reference, which
is why none is set here) and apply it (`k8s_apply`); they also use the names, labels and selectors
defined here to find the children again (`stage_set_name`, `stage_selector`, ...) and
`child_problems` to refuse a job whose children could not exist before creating any of them.

What a job becomes, in creation order:

- a ConfigMap `<job>-job` holding the job as `job.yaml` (the same model `keyshift run` reads);
- the coordinator: a Deployment (one replica, Recreate) running `keyshift.runtime.coordinator`
  on that file, and a ClusterIP Service `<job>-coordinator` (grpc 7000, metrics 9100);
- per stage (every source, keyed stage and the sink): a headless Service `<job>-<stage>` and a
  StatefulSet of the same name whose pods run `keyshift.runtime.instance --index hostname` (the
  pod ordinal is the instance index) and register their pod IP with the coordinator. A keyed
  stage with `standby: N` has N pods more than its parallelism (`stage_replicas`), and all its
  pods run with `--standby` too: each offers itself to the coordinator for its ordinal only, and
  takes it at once when the stage wants it, so the top N ordinals wait warm until a scale-out
  reaches them; the StatefulSet then grows by as much, which starts the next standbys;
- per entry of `spec.sources` and `spec.sinks`: a Deployment `<job>-<source|sink>-<app>` (one
  replica, Recreate) running the PySpark script with `spark-submit --master local[*]`. The app
  finds the job through its environment and the job file (mounted at JOB_MOUNT/JOB_FILE, as in
  the coordinator): KEYSHIFT_JOB (the job's name), KEYSHIFT_COORDINATOR
  (host:port of the coordinator), KEYSHIFT_ROLE (`source` or `sink`) and, for sources writing
  into a `kind: ingest` source with a fixed port (the app's `stage`, or the job's only ingest
  source), KEYSHIFT_INGEST (host:port of that source stage's headless Service, which resolves
  to its pods; a gRPC client picks one):
  examples/spark/source_job.py takes $KEYSHIFT_INGEST as its endpoint. A Spark sink reads the
  output log where the sink stage writes it: `spec.output.claim`, a ReadWriteMany
  PersistentVolumeClaim mounted at the log's directory in the sink stage's pods and in every
  sink app, whose KEYSHIFT_OUTPUT names that directory. A job of several log sinks mounts one
  subdirectory of the claim per sink (`subPath`: the sink's name) at that sink's directory,
  in its pods and in every sink app, where KEYSHIFT_OUTPUT names the first sink's directory
  and KEYSHIFT_OUTPUTS (JSON) every sink's, by name.

Switched on by the operator's options (`ChildOptions`, which the chart gives it as JSON in
KEYSHIFT_CHILD_OPTIONS, parsed by `child_options_from_env`), also:

- a NetworkPolicy `<job>` on all the job's pods: ingress only from the job's own pods, from the
  operator to the coordinator's port, from Prometheus to the metrics port, and from the named
  Spark clients to the coordinator's and the ingest port; egress is left alone;
- per stage, a PodDisruptionBudget `<job>-<stage>` (a voluntary eviction, such as a node drain,
  takes at most `maxUnavailable` of the stage's pods at a time).

The options also give the image of a job without `spec.image`: the chart passes the operator's
own image, by digest when it pins one.

Every pod of the job (coordinator, stages, Spark apps) gets the job's secret as
KEYSHIFT_JOB_SECRET from the Secret `<job>-secret` (`job_secret`: the operator creates it once,
random, and never patches it), the storage credentials from the Secret `spec.storageCredentials`
names, and with `spec.tls` the TLS Secret's files mounted at TLS_MOUNT: all by reference, so no
manifest and not the ConfigMap holds a credential.

Every pod runs as user 10001 with a read-only root filesystem, no privilege escalation, no
capabilities and the RuntimeDefault seccomp profile; /tmp is an emptyDir and HOME points there.
No service account token is mounted (the pods do not talk to the Kubernetes API; a podTemplate
can set `automountServiceAccountToken`). keyshift containers run in APP_DIR (`/app`, where
keyshift images keep the job's code: the runtime imports users' `module:function` references
from its working directory), so a `log` sink with a relative path writes below `/app`, and the
sink stage gets a volume mounted at its output directory: `spec.output.claim`, or else an
emptyDir, which lives as long as the pod (the operator refuses Spark sinks without the claim,
since they could not read it). Checkpoints (and an ingest
source's log beside them) must outlive every pod and be shared by all of them: in an object
store (`s3://...`), or in a local directory on `spec.checkpointClaim`, a ReadWriteMany
PersistentVolumeClaim mounted there in the coordinator and every stage pod.

`spec.pod_template` (a partial PodTemplateSpec) is merged into every pod template, the
coordinator's and the Spark apps' included, so tolerations and node selectors reach all of
them: dicts are merged, lists replaced, except the lists Kubernetes merges by a key (containers,
volumes, env, ports, volume mounts), which are merged by that key, so a sidecar or an extra
volume does not remove ours. Every container we make is named CONTAINER ("keyshift"); a
podTemplate container of that name is merged into it. The labels set here always win over the
podTemplate's, so it can add labels but not move a pod out of its selector. A podTemplate that
would undo the pods' hardening never gets here (`keyshift.operator.pod_hardening`).
"""

from __future__ import annotations

import base64
import copy
import json
import posixpath
import re
from collections.abc import Collection, Mapping
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from keyshift.operator.state_memory import PROCESS_ENV, sized_resources
from keyshift.operator.streamingjob import OutputLocation, Resources, SparkApp, StreamingJobSpec
from keyshift.runtime.auth import TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV, TLS_SERVER_NAME_ENV
from keyshift.runtime.job import IngestSource, JobSpec, KeyedStage, LogSink, SinkStage
from keyshift.runtime.job_secret import SECRET_ENV

Manifest = dict[str, Any]
Role = Literal["source", "sink"]

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_JOB = "keyshift.io/job"
LABEL_STAGE = "keyshift.io/stage"
LABEL_APP = "keyshift.io/app"
APP_NAME = "keyshift"
MANAGER = "keyshift-operator"

COORDINATOR_PORT = 7000
METRICS_PORT = 9100
DATA_PORT = 7100
JOB_MOUNT = "/etc/keyshift"
JOB_FILE = "job.yaml"
APP_DIR = "/app"
TMP_DIR = "/tmp"
USER_ID = 10001
CONTAINER = "keyshift"
REGISTER_TIMEOUT = 300

# A StatefulSet's pods carry a `controller-revision-hash` label of `<name>-<hash>` (up to 10
# characters of hash), and label values have at most 63 characters.
MAX_STATEFULSET_NAME = 52
MAX_DNS_LABEL = 63
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")

# The lists of a pod template that Kubernetes' strategic merge merges by a key.
POD_MERGE_KEYS: Mapping[str, str] = {
    "containers": "name",
    "initContainers": "name",
    "volumes": "name",
    "env": "name",
    "ports": "containerPort",
    "volumeMounts": "mountPath",
}

CHILD_OPTIONS_ENV = "KEYSHIFT_CHILD_OPTIONS"

_JOB_VOLUME = "job"
_TMP_VOLUME = "tmp"
_OUTPUT_VOLUME = "output"
_CHECKPOINT_VOLUME = "checkpoints"
_STATE_VOLUME = "state"
_TLS_VOLUME = "tls"
TLS_MOUNT = "/etc/keyshift-tls"
SECRET_KEY = "secret"  # the key of the job's token Secret that holds the secret


# -- what the operator is told about the children it makes -------------------------------------


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Peer(_Options):
    """Pods a NetworkPolicy lets in: those with `podLabels` (all, when empty) in the namespaces
    with `namespaceLabels` (every namespace when empty; the job's own when null)."""

    namespace_labels: dict[str, str] | None = Field(default=None, alias="namespaceLabels")
    pod_labels: dict[str, str] = Field(default_factory=dict, alias="podLabels")


class NetworkPolicyOptions(_Options):
    operator: Peer
    prometheus: Peer
    spark_clients: list[Peer] = Field(default_factory=list, alias="sparkClients")


class DisruptionBudgetOptions(_Options):
    max_unavailable: int = Field(default=1, ge=1, alias="maxUnavailable")


class ChildOptions(_Options):
    """The operator-wide settings of the children (from the chart's values)."""

    job_image: str | None = Field(default=None, min_length=1, alias="jobImage")
    network_policy: NetworkPolicyOptions | None = Field(default=None, alias="networkPolicy")
    pod_disruption_budget: DisruptionBudgetOptions | None = Field(
        default=None, alias="podDisruptionBudget"
    )


class ChildOptionsError(ValueError):
    """KEYSHIFT_CHILD_OPTIONS is not valid; the message names the bad field."""


def child_options_from_env(environ: Mapping[str, str]) -> ChildOptions:
    """The options in `environ[CHILD_OPTIONS_ENV]` (JSON); none set when it is absent."""
    raw = environ.get(CHILD_OPTIONS_ENV, "").strip()
    if not raw:
        return ChildOptions()
    try:
        return ChildOptions.model_validate_json(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'the value'}: {e['msg']}" for e in exc.errors()
        )
        raise ChildOptionsError(f"{CHILD_OPTIONS_ENV}: {problems}") from exc


# -- names, labels, selectors -------------------------------------------------------------------


def coordinator_service_name(name: str) -> str:
    """The coordinator's Service (and Deployment)."""
    return f"{name}-coordinator"


def coordinator_address(name: str, namespace: str) -> str:
    """host:port of the coordinator, as stage instances and Spark apps dial it."""
    return f"{coordinator_service_name(name)}.{namespace}.svc:{COORDINATOR_PORT}"


def stage_set_name(name: str, stage: str) -> str:
    """A stage's StatefulSet and its headless Service."""
    return f"{name}-{stage}"


def job_secret_name(name: str) -> str:
    """The Secret with the job's secret (KEYSHIFT_JOB_SECRET of every pod)."""
    return f"{name}-secret"


def config_map_name(name: str) -> str:
    """The ConfigMap with the job definition."""
    return f"{name}-job"


def spark_app_name(name: str, role: Role, app: str) -> str:
    """The Deployment of a PySpark source or sink."""
    return f"{name}-{role}-{app}"


def common_labels(name: str, component: str) -> dict[str, str]:
    """The labels every child of the job carries."""
    return {
        LABEL_NAME: APP_NAME,
        LABEL_INSTANCE: name,
        LABEL_MANAGED_BY: MANAGER,
        LABEL_JOB: name,
        LABEL_COMPONENT: component,
    }


def coordinator_selector_labels(name: str) -> dict[str, str]:
    return {LABEL_JOB: name, LABEL_COMPONENT: "coordinator"}


def stage_selector_labels(name: str, stage: str) -> dict[str, str]:
    return {LABEL_JOB: name, LABEL_STAGE: stage}


def spark_selector_labels(name: str, role: Role, app: str) -> dict[str, str]:
    return {LABEL_JOB: name, LABEL_COMPONENT: role, LABEL_APP: app}


def stage_selector(name: str, stage: str) -> str:
    """The label selector of a stage's pods, as status.selector (the scale subresource) wants."""
    return ",".join(f"{k}={v}" for k, v in stage_selector_labels(name, stage).items())


def child_problems(
    name: str, spec: StreamingJobSpec, job: JobSpec, options: ChildOptions | None = None
) -> list[str]:
    """Why the children of this job could not exist (names Kubernetes refuses, clashes, no
    image), so the operator can refuse the job before it creates any of them; empty when all
    is well."""
    found: list[str] = []
    if not spec.image and (options is None or options.job_image is None):
        found.append(
            "spec.image is not set, and the operator has no default job image (the chart gives "
            f"it its own image in {CHILD_OPTIONS_ENV})"
        )
    services = [coordinator_service_name(name)]
    if not _DNS_1035.match(name) or len(name) > MAX_DNS_LABEL:
        found.append(
            f"metadata.name {name!r} must be a DNS label (lower case letters, digits and '-', "
            f"starting with a letter, ending with a letter or digit, at most {MAX_DNS_LABEL} "
            "characters): it names Services and labels"
        )
    for stage in job.stages():
        set_name = stage_set_name(name, stage.name)
        services.append(set_name)
        if not _DNS_1035.match(set_name) or len(set_name) > MAX_STATEFULSET_NAME:
            found.append(
                f"stage {stage.name!r}: the StatefulSet name {set_name!r} must be a DNS label "
                f"of at most {MAX_STATEFULSET_NAME} characters ending with a letter or digit"
            )
    apps: list[tuple[Role, SparkApp]] = [
        *(("source", app) for app in spec.sources),
        *(("sink", app) for app in spec.sinks),
    ]
    for role, app in apps:
        app_name = spark_app_name(name, role, app.name)
        if not _DNS_1035.match(app_name) or len(app_name) > MAX_DNS_LABEL:
            found.append(
                f"spec.{role}s {app.name!r}: the Deployment name {app_name!r} must be a DNS label "
                f"of at most {MAX_DNS_LABEL} characters ending with a letter or digit"
            )
    clashes = sorted({s for s in services if services.count(s) > 1})
    if clashes:
        found.append(f"two Services would be named {clashes} (is a stage named 'coordinator'?)")
    found += _checkpoint_problems(spec, job)
    found += _output_problems(spec, job)
    for app in spec.sources:
        found += _spark_source_problems(job, app)
    return found


def _ingest_sources(job: JobSpec) -> dict[str, IngestSource]:
    """The job's ingest sources' configs, by stage."""
    return {
        step.stage.name: step.stage.config
        for step in job.source_steps()
        if isinstance(step.stage.config, IngestSource)
    }


def _spark_target(job: JobSpec, app: SparkApp) -> str | None:
    """The ingest source stage a Spark source writes into: the one it names, or the job's only
    ingest source; None when there is none (or it names none of several: a problem)."""
    ingest = _ingest_sources(job)
    if app.stage is not None:
        return app.stage if app.stage in ingest else None
    return next(iter(ingest)) if len(ingest) == 1 else None


def _spark_source_problems(job: JobSpec, app: SparkApp) -> list[str]:
    ingest = _ingest_sources(job)
    where = f"spec.sources {app.name!r}"
    if app.stage is not None and app.stage not in ingest:
        return [
            f"{where}: stage {app.stage!r} is not an ingest source of the job (its ingest "
            f"sources: {sorted(ingest)})"
        ]
    if app.stage is None and len(ingest) > 1:
        return [
            f"{where}: the job has several ingest sources ({sorted(ingest)}): name the one it "
            "writes into as its `stage`"
        ]
    target = _spark_target(job, app)
    if target is not None and ingest[target].port == 0:
        return [
            f"stage {target!r}: a job with Spark sources needs a fixed ingest port in the "
            "source's config (0 picks a random one, which the sources cannot find)"
        ]
    return []


def _checkpoint_problems(spec: StreamingJobSpec, job: JobSpec) -> list[str]:
    storage = job.checkpoints.storage if job.checkpoints is not None else None
    local = storage is not None and "://" not in storage
    if local and spec.checkpoint_claim is None:
        return [
            f"spec.job.checkpoints.storage {storage!r} is a local directory, which every pod of "
            "the job writes and the restarted ones read: give spec.checkpointClaim (a "
            "ReadWriteMany PersistentVolumeClaim, mounted there) or an object store URL "
            "(s3://bucket/prefix)"
        ]
    if spec.checkpoint_claim is not None and not local:
        return [
            f"spec.checkpointClaim {spec.checkpoint_claim!r} is mounted where local checkpoints "
            f"go, but the job has {'no checkpoints' if storage is None else storage!r}"
        ]
    return []


def _local_output_dir(sink: SinkStage) -> str | None:
    """The directory a `log` sink writes files to, as an absolute path in the container (None
    when the sink writes no files, or not to a local directory)."""
    config = sink.config
    if not isinstance(config, LogSink) or config.format == "none" or "://" in config.path:
        return None
    return posixpath.normpath(posixpath.join(APP_DIR, config.path))


def _local_outputs(job: JobSpec) -> dict[str, str]:
    """Each sink writing files to a local directory, and that directory (the first sink
    first)."""
    dirs = {sink.name: _local_output_dir(sink) for sink in job.sinks()}
    return {name: path for name, path in dirs.items() if path is not None}


def _output_mounts(job: JobSpec, sinks: list[str]) -> list[Manifest]:
    """The output volume's mounts of `sinks`' directories: the claim's root where the job has
    one log sink (as before sinks were several), a subdirectory per sink where it has more."""
    local = _local_outputs(job)
    shared = len(local) > 1
    return [
        {"name": _OUTPUT_VOLUME, "mountPath": local[sink], **({"subPath": sink} if shared else {})}
        for sink in sinks
        if sink in local
    ]


def _output_problems(spec: StreamingJobSpec, job: JobSpec) -> list[str]:
    local = _local_outputs(job)
    if spec.output is not None and not local:
        return [
            f"spec.output.claim {spec.output.claim!r} is mounted where the output log goes, but "
            "the job writes no output log files to a local directory (a sink's config: "
            "kind log, a relative or absolute path, format jsonl or parquet)"
        ]
    if spec.sinks and spec.output is None and local:
        return [
            f"spec.sinks read the output log in {', '.join(local.values())}, which lives in the "
            "sink pods' emptyDir where no other pod can read it: give spec.output.claim (a "
            "ReadWriteMany PersistentVolumeClaim, mounted there in the sink pods and the Spark "
            "sinks)"
        ]
    return []


def sink_rescale_problem(spec: StreamingJobSpec, job: JobSpec, sink: str) -> str | None:
    """Why sink `sink` cannot be rescaled live here, if it cannot: its partitions move between
    pods, so a log on local files must be in the one directory every sink pod mounts."""
    local = _local_outputs(job).get(sink)
    if local is None or spec.output is not None:
        return None
    return (
        f"the sink's output log in {local} lives in each sink pod's own emptyDir: a rescale "
        "would move its partitions to pods that cannot see them; give spec.output.claim (a "
        "ReadWriteMany PersistentVolumeClaim every sink pod mounts) to rescale the sink"
    )


def _output_volume(output: OutputLocation | None) -> Manifest:
    """The sink's output log volume: the shared claim, else an emptyDir of the pod's own."""
    if output is None:
        return {"name": _OUTPUT_VOLUME, "emptyDir": {}}
    return {"name": _OUTPUT_VOLUME, "persistentVolumeClaim": {"claimName": output.claim}}


def _checkpoint_volume(spec: StreamingJobSpec, job: JobSpec) -> tuple[Manifest, Manifest] | None:
    """The shared volume of local checkpoints and where the pods mount it, if there is one."""
    if spec.checkpoint_claim is None or job.checkpoints is None:
        return None
    volume = {
        "name": _CHECKPOINT_VOLUME,
        "persistentVolumeClaim": {"claimName": spec.checkpoint_claim},
    }
    path = posixpath.normpath(posixpath.join(APP_DIR, job.checkpoints.storage))
    return volume, {"name": _CHECKPOINT_VOLUME, "mountPath": path}


# -- merging ------------------------------------------------------------------------------------


def deep_merge(
    base: Mapping[str, Any],
    override: Mapping[str, Any],
    list_keys: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """`override` merged into a copy of `base`: dicts are merged recursively, anything else
    (lists included) is replaced, and a None in `override` removes the key (as in a JSON merge
    patch). With `list_keys` ({field: key}), a list under one of those fields whose items are
    dicts is merged item by item instead: items with the same key are deep-merged, new ones
    appended. Neither input is modified, and the result shares no mutable part with them."""
    keys = list_keys or {}
    merged = copy.deepcopy(dict(base))
    for field, value in override.items():
        if value is None:
            merged.pop(field, None)
        elif isinstance(value, Mapping) and isinstance(merged.get(field), Mapping):
            merged[field] = deep_merge(merged[field], value, list_keys)
        elif field in keys and isinstance(value, list) and isinstance(merged.get(field), list):
            merged[field] = _merge_by_key(merged[field], value, keys[field], keys)
        else:
            merged[field] = copy.deepcopy(value)
    return merged


def _merge_by_key(
    base: list[Any], override: list[Any], key: str, list_keys: Mapping[str, str]
) -> list[Any]:
    merged = list(base)
    for item in override:
        position = next(
            (
                i
                for i, old in enumerate(merged)
                if isinstance(item, Mapping)
                and isinstance(old, Mapping)
                and key in item
                and old.get(key) == item[key]
            ),
            None,
        )
        if position is None:
            merged.append(copy.deepcopy(item))
        else:
            merged[position] = deep_merge(merged[position], item, list_keys)
    return merged


def merge_pod_template(
    template: Mapping[str, Any], override: Mapping[str, Any], fixed_labels: Mapping[str, str]
) -> dict[str, Any]:
    """A pod template with `spec.pod_template` merged in: only the override's metadata labels and
    annotations and its spec are taken, merged as `deep_merge` with POD_MERGE_KEYS, and
    `fixed_labels` (ours, selectors among them) are put back on top."""
    metadata = override.get("metadata") or {}
    patch: dict[str, Any] = {
        "metadata": {k: metadata[k] for k in ("labels", "annotations") if k in metadata},
        "spec": override.get("spec") or {},
    }
    merged = deep_merge(template, patch, POD_MERGE_KEYS)
    merged.setdefault("metadata", {}).setdefault("labels", {}).update(fixed_labels)
    return merged


# -- building blocks ----------------------------------------------------------------------------


def _metadata(name: str, namespace: str, labels: Mapping[str, str]) -> Manifest:
    return {"name": name, "namespace": namespace, "labels": dict(labels)}


def _resources(resources: Resources) -> Manifest:
    out: Manifest = {}
    for part in ("requests", "limits"):
        values = getattr(resources, part).model_dump(exclude_none=True)
        if values:
            out[part] = values
    return out


def _pod_security() -> Manifest:
    return {
        "runAsNonRoot": True,
        "runAsUser": USER_ID,
        "runAsGroup": USER_ID,
        "fsGroup": USER_ID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _container_security() -> Manifest:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _env(values: Mapping[str, str]) -> list[Manifest]:
    return [{"name": k, "value": v} for k, v in values.items()]


def _metrics_probes() -> Manifest:
    check = {"httpGet": {"path": "/metrics", "port": "metrics"}}
    return {
        "readinessProbe": {**check, "periodSeconds": 5, "timeoutSeconds": 3},
        "livenessProbe": {
            **copy.deepcopy(check),
            "initialDelaySeconds": 15,
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        },
    }


def _base_env() -> dict[str, str]:
    return {"HOME": TMP_DIR, "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1", **PROCESS_ENV}


def _security_env(name: str, spec: StreamingJobSpec) -> list[Manifest]:
    """The job's secret, the storage credentials and the TLS files, for every job pod: all
    from Secrets, none of them in a manifest or the ConfigMap."""
    env: list[Manifest] = [
        {"name": SECRET_ENV, "valueFrom": {"secretKeyRef": {
            "name": job_secret_name(name), "key": SECRET_KEY}}},
    ]  # fmt: skip
    credentials = spec.storage_credentials
    if credentials is not None:
        env.extend(
            {"name": variable, "valueFrom": {"secretKeyRef": {
                "name": credentials.secret_name, "key": key}}}
            for variable, key in credentials.keys.items()
        )  # fmt: skip
    if spec.tls is not None:
        env.extend(_env({
            TLS_CA_ENV: f"{TLS_MOUNT}/ca.crt",
            TLS_CERT_ENV: f"{TLS_MOUNT}/tls.crt",
            TLS_KEY_ENV: f"{TLS_MOUNT}/tls.key",
            **({TLS_SERVER_NAME_ENV: spec.tls.server_name} if spec.tls.server_name else {}),
        }))  # fmt: skip
    return env


def _tls_volume(spec: StreamingJobSpec) -> tuple[Manifest, Manifest] | None:
    """The TLS Secret's volume and its mount, if the job has TLS."""
    if spec.tls is None:
        return None
    volume = {"name": _TLS_VOLUME, "secret": {"secretName": spec.tls.secret_name}}
    return volume, {"name": _TLS_VOLUME, "mountPath": TLS_MOUNT, "readOnly": True}


def job_secret(name: str, namespace: str, secret: str) -> Manifest:
    """The job's token Secret: created once by the operator, never patched (the running pods
    hold its value)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": _metadata(job_secret_name(name), namespace, common_labels(name, "secret")),
        "data": {SECRET_KEY: base64.b64encode(secret.encode()).decode()},
    }


def _job_volume(name: str) -> Manifest:
    return {"name": _JOB_VOLUME, "configMap": {"name": config_map_name(name)}}


def _job_mount() -> Manifest:
    return {"name": _JOB_VOLUME, "mountPath": JOB_MOUNT, "readOnly": True}


def _pod_template(
    *,
    spec: StreamingJobSpec,
    labels: Mapping[str, str],
    annotations: Mapping[str, str],
    container: Manifest,
    volumes: list[Manifest],
) -> Manifest:
    """A pod template with our security settings, /tmp, `spec.pod_template` merged in."""
    pod: Manifest = {
        "securityContext": _pod_security(),
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "containers": [
            {
                "name": CONTAINER,
                "imagePullPolicy": spec.image_pull_policy,
                **container,
                "securityContext": _container_security(),
                "volumeMounts": [
                    *container.get("volumeMounts", []),
                    {"name": _TMP_VOLUME, "mountPath": TMP_DIR},
                ],
            }
        ],
        "volumes": [*volumes, {"name": _TMP_VOLUME, "emptyDir": {}}],
    }
    if spec.service_account:
        # Its token stays unmounted all the same; a podTemplate can mount it.
        pod["serviceAccountName"] = spec.service_account
    metadata: Manifest = {"labels": dict(labels)}
    if annotations:
        metadata["annotations"] = dict(annotations)
    return merge_pod_template({"metadata": metadata, "spec": pod}, spec.pod_template, labels)


def _scrape_annotations() -> dict[str, str]:
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS_PORT)}


# -- the children -------------------------------------------------------------------------------


def job_yaml(job: JobSpec) -> str:
    """The job as the coordinator reads it (`keyshift.runtime.job.load_job`)."""
    return yaml.safe_dump(job.model_dump(mode="json", exclude_none=True), sort_keys=False)


def config_map(name: str, namespace: str, job: JobSpec) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(config_map_name(name), namespace, common_labels(name, "config")),
        "data": {JOB_FILE: job_yaml(job)},
    }


def coordinator_deployment(
    name: str, namespace: str, spec: StreamingJobSpec, job: JobSpec
) -> Manifest:
    selector = coordinator_selector_labels(name)
    mounts, volumes = [_job_mount()], [_job_volume(name)]
    for extra in (_checkpoint_volume(spec, job), _tls_volume(spec)):
        if extra is not None:
            volumes.append(extra[0])
            mounts.append(extra[1])
    labels = {**common_labels(name, "coordinator"), **selector}
    container: Manifest = {
        "image": spec.image,
        "command": ["python", "-P", "-m", "keyshift.runtime.coordinator"],
        "args": [
            "--job",
            f"{JOB_MOUNT}/{JOB_FILE}",
            "--host",
            "0.0.0.0",
            "--port",
            str(COORDINATOR_PORT),
            "--metrics-port",
            str(METRICS_PORT),
            "--register-timeout",
            str(REGISTER_TIMEOUT),
            # A job with checkpoints goes on from its latest one whenever the coordinator
            # (re)starts: after its own crash, or after it exited to recover a lost instance.
            *(["--restore"] if job.checkpoints is not None else []),
        ],
        "workingDir": APP_DIR,
        "env": [*_env({**_base_env(), "KEYSHIFT_JOB": name}), *_security_env(name, spec)],
        "ports": [
            {"name": "grpc", "containerPort": COORDINATOR_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
        ],
        "resources": _resources(spec.resources),
        "volumeMounts": mounts,
        **_metrics_probes(),
    }
    template = _pod_template(
        spec=spec,
        labels=labels,
        annotations=_scrape_annotations(),
        container=container,
        volumes=volumes,
    )
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(coordinator_service_name(name), namespace, labels),
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": selector},
            "template": template,
        },
    }


def coordinator_service(name: str, namespace: str) -> Manifest:
    labels = common_labels(name, "coordinator")
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(coordinator_service_name(name), namespace, labels),
        "spec": {
            "type": "ClusterIP",
            "selector": coordinator_selector_labels(name),
            "ports": [
                {"name": "grpc", "port": COORDINATOR_PORT, "targetPort": "grpc", "protocol": "TCP"},
                {
                    "name": "metrics",
                    "port": METRICS_PORT,
                    "targetPort": "metrics",
                    "protocol": "TCP",
                },
            ],
        },
    }


def _ingest_port(job: JobSpec, stage: str) -> int | None:
    """The fixed ingest port of a source stage's pods, if they serve one."""
    config = _ingest_sources(job).get(stage)
    return config.port if config is not None and config.port else None


def _stage_ports(job: JobSpec, stage: str) -> list[tuple[str, int]]:
    ports = [("data", DATA_PORT), ("metrics", METRICS_PORT)]
    ingest = _ingest_port(job, stage)
    if ingest is not None:
        ports.append(("ingest", ingest))
    return ports


def _keyed_stage(job: JobSpec, stage: str) -> KeyedStage | None:
    """`stage`'s settings if it is one of the job's keyed stages."""
    return next((s.stage for s in job.keyed_stages() if s.stage.name == stage), None)


def stage_replicas(job: JobSpec, stage: str, parallelism: int) -> int:
    """The replicas of a stage's StatefulSet at `parallelism`: a keyed stage's standbys run
    above its instances, except once it has no instances (a finished job)."""
    keyed = _keyed_stage(job, stage)
    return parallelism + keyed.standby if keyed is not None and parallelism else parallelism


def _state_volume(job: JobSpec, stage: str) -> tuple[Manifest, Manifest] | None:
    """The local disk of a keyed stage on RocksDB (its `state.path`; the root filesystem is
    read-only): an emptyDir, since the database is rebuilt from checkpoints or a migration at
    every start and never holds the job's only copy of its state."""
    keyed = _keyed_stage(job, stage)
    if keyed is None or keyed.state.backend != "rocksdb":
        return None
    settings = keyed.state
    path = posixpath.normpath(posixpath.join(APP_DIR, settings.path))
    return {"name": _STATE_VOLUME, "emptyDir": {}}, {"name": _STATE_VOLUME, "mountPath": path}


def stage_service(name: str, namespace: str, job: JobSpec, stage: str) -> Manifest:
    """The headless Service of a stage: stable DNS names for its pods (`<set>-N.<set>`)."""
    labels = {**common_labels(name, "stage"), LABEL_STAGE: stage}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(stage_set_name(name, stage), namespace, labels),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": stage_selector_labels(name, stage),
            "ports": [
                {"name": port_name, "port": port, "targetPort": port_name, "protocol": "TCP"}
                for port_name, port in _stage_ports(job, stage)
            ],
        },
    }


def stage_stateful_set(
    name: str,
    namespace: str,
    spec: StreamingJobSpec,
    job: JobSpec,
    stage: str,
    replicas: int | None,
) -> Manifest:
    """A stage's StatefulSet; without `replicas` when it is None (the StatefulSet exists and the
    scaler owns its replicas: `keyshift.operator.k8s_apply`)."""
    selector = stage_selector_labels(name, stage)
    labels = {**common_labels(name, "stage"), **selector}
    keyed = _keyed_stage(job, stage)
    mounts = [_job_mount()]
    volumes = [_job_volume(name)]
    output = _output_mounts(job, [stage])
    if output:
        mounts += output
        volumes.append(_output_volume(spec.output))
    for extra in (_checkpoint_volume(spec, job), _tls_volume(spec), _state_volume(job, stage)):
        if extra is not None:
            volumes.append(extra[0])
            mounts.append(extra[1])
    container: Manifest = {
        "image": spec.image,
        "command": ["python", "-P", "-m", "keyshift.runtime.instance"],
        "args": [
            "--coordinator",
            coordinator_address(name, namespace),
            "--stage",
            stage,
            "--index",
            "hostname",
            *(["--standby"] if keyed is not None and keyed.standby else []),
            "--host",
            "$(POD_IP)",
            "--port",
            str(DATA_PORT),
            "--metrics-port",
            str(METRICS_PORT),
        ],
        "workingDir": APP_DIR,
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            *_env({**_base_env(), "KEYSHIFT_JOB": name}),
            *_security_env(name, spec),
        ],
        "ports": [
            {"name": port_name, "containerPort": port, "protocol": "TCP"}
            for port_name, port in _stage_ports(job, stage)
        ],
        "resources": _resources(
            sized_resources(spec.resources, keyed.state) if keyed is not None else spec.resources
        ),
        "volumeMounts": mounts,
        **_metrics_probes(),
    }
    template = _pod_template(
        spec=spec,
        labels=labels,
        annotations=_scrape_annotations(),
        container=container,
        volumes=volumes,
    )
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _metadata(stage_set_name(name, stage), namespace, labels),
        "spec": {
            "serviceName": stage_set_name(name, stage),
            **({} if replicas is None else {"replicas": replicas}),
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector},
            "template": template,
        },
    }


def spark_deployment(
    name: str, namespace: str, spec: StreamingJobSpec, job: JobSpec, role: Role, app: SparkApp
) -> Manifest:
    """A PySpark source or sink: one driver in local mode. It serves no metrics, so it has no
    probes and no scrape annotations."""
    selector = spark_selector_labels(name, role, app.name)
    labels = {**common_labels(name, role), **selector}
    env = {
        **_base_env(),
        "KEYSHIFT_JOB": name,
        "KEYSHIFT_ROLE": role,
        "KEYSHIFT_COORDINATOR": coordinator_address(name, namespace),
    }
    target = _spark_target(job, app) if role == "source" else None
    ingest = None if target is None else _ingest_port(job, target)
    if target is not None and ingest is not None:
        env["KEYSHIFT_INGEST"] = f"{stage_set_name(name, target)}.{namespace}.svc:{ingest}"
    outputs = _local_outputs(job)
    # The job file, for a reader's schema (the `job` option of the keyshift Spark source).
    volumes, mounts = [_job_volume(name)], [_job_mount()]
    if role == "sink" and spec.output is not None and outputs:
        env["KEYSHIFT_OUTPUT"] = next(iter(outputs.values()))
        if len(outputs) > 1:
            env["KEYSHIFT_OUTPUTS"] = json.dumps(outputs)
        volumes.append(_output_volume(spec.output))
        # Read-write: a query that names a `reader` commits its progress in the log.
        mounts += _output_mounts(job, list(outputs))
    tls = _tls_volume(spec)
    if tls is not None:
        volumes.append(tls[0])
        mounts.append(tls[1])
    container: Manifest = {
        "image": app.image or spec.image,
        "command": ["spark-submit", "--master", "local[*]", app.script, *app.args],
        "env": [*_env(env), *_security_env(name, spec)],
        "resources": _resources(app.resources),
        "volumeMounts": mounts,
    }
    template = _pod_template(
        spec=spec, labels=labels, annotations={}, container=container, volumes=volumes
    )
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(spark_app_name(name, role, app.name), namespace, labels),
        "spec": {
            "replicas": 1,
            # Never two drivers at once: both would push the same rows.
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": selector},
            "template": template,
        },
    }


def network_policy(
    name: str, namespace: str, job: JobSpec, options: NetworkPolicyOptions
) -> Manifest:
    """The job's NetworkPolicy: what may reach its pods (see the module's docstring)."""

    def peer(allowed: Peer) -> Manifest:
        out: Manifest = {"podSelector": {"matchLabels": dict(allowed.pod_labels)}}
        if allowed.namespace_labels is not None:
            out["namespaceSelector"] = {"matchLabels": dict(allowed.namespace_labels)}
        return out

    def ports(*numbers: int) -> list[Manifest]:
        return [{"protocol": "TCP", "port": n} for n in numbers]

    own = {"podSelector": {"matchLabels": {LABEL_JOB: name}}}
    rules: list[Manifest] = [
        {"from": [own]},
        {"from": [peer(options.operator)], "ports": ports(COORDINATOR_PORT)},
        {"from": [peer(options.prometheus)], "ports": ports(METRICS_PORT)},
    ]
    if options.spark_clients:
        ingest = [p for stage in _ingest_sources(job) if (p := _ingest_port(job, stage))]
        client_ports = [COORDINATOR_PORT, *ingest]
        rules.append(
            {"from": [peer(c) for c in options.spark_clients], "ports": ports(*client_ports)}
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(name, namespace, common_labels(name, "network-policy")),
        "spec": {
            "podSelector": {"matchLabels": {LABEL_JOB: name}},
            "policyTypes": ["Ingress"],
            "ingress": rules,
        },
    }


def stage_disruption_budget(
    name: str, namespace: str, stage: str, options: DisruptionBudgetOptions
) -> Manifest:
    """A stage's PodDisruptionBudget: evictions take at most `max_unavailable` of its pods."""
    labels = {**common_labels(name, "stage"), LABEL_STAGE: stage}
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(stage_set_name(name, stage), namespace, labels),
        "spec": {
            "maxUnavailable": options.max_unavailable,
            "selector": {"matchLabels": stage_selector_labels(name, stage)},
        },
    }


def children(
    name: str,
    namespace: str,
    spec: StreamingJobSpec,
    job: JobSpec,
    existing: Collection[str] = (),
    options: ChildOptions | None = None,
) -> list[Manifest]:
    """Every child of the StreamingJob `name`, in creation order. `job` is `spec.job_spec()`.
    A stage's StatefulSet starts at the job's parallelism (and standbys); the stages in
    `existing` (their StatefulSet exists) get none, so that applying them never undoes a
    rescale. `options` are the operator's (`ChildOptions`)."""
    settings = options or ChildOptions()
    if not spec.image:
        spec = spec.model_copy(update={"image": settings.job_image})
    out = [
        config_map(name, namespace, job),
        coordinator_deployment(name, namespace, spec, job),
        coordinator_service(name, namespace),
    ]
    if settings.network_policy is not None:
        # Before the pods: none of them is ever reachable from outside its rules.
        out.insert(0, network_policy(name, namespace, job, settings.network_policy))
    for stage in job.stages():
        count = (
            None if stage.name in existing else stage_replicas(job, stage.name, stage.parallelism)
        )
        out.append(stage_service(name, namespace, job, stage.name))
        out.append(stage_stateful_set(name, namespace, spec, job, stage.name, count))
        if settings.pod_disruption_budget is not None:
            budget = settings.pod_disruption_budget
            out.append(stage_disruption_budget(name, namespace, stage.name, budget))
    roles: list[tuple[Role, list[SparkApp]]] = [("source", spec.sources), ("sink", spec.sinks)]
    for role, apps in roles:
        out.extend(spark_deployment(name, namespace, spec, job, role, app) for app in apps)
    return out
