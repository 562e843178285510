"""The Kubernetes operator: kopf handlers that reconcile StreamingJobs and run their autoscaling.

create / resume / update: validate the spec (the schema's rules are the API server's; what it
cannot express, `StreamingJobSpec.problems`, becomes a Degraded condition and an Event, and no
child is created), then create the job's token Secret if it has none (never patched: the pods
hold its value) and apply the children (`k8s_children`, server-side: `k8s_apply`). A
change of a keyed stage's or the sink's parallelism (an edit, or `kubectl scale` of the keyed
stage) rescales the running job live. A timer per job reads the coordinator's status, runs
the autoscaling loop (`k8s_scaling`), applies replica changes and writes the status, with the
memory a restarted operator reads back (the guards' state, the last rescale it handled, the
rescales of a decision still to come); delete releases the job's parts, as the operator's
stop releases every job's.
`keyshift operator` runs it (`run_operator`); tests build it with `build_registry` against an
API emulator.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import kopf
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio.client.exceptions import ApiException
from pydantic import ValidationError

from keyshift.operator.conditions import condition, upsert_conditions
from keyshift.operator.k8s_apply import (
    apply,
    apply_replicas,
    restart_deployment,
    scaler_owns_replicas,
)
from keyshift.operator.k8s_children import (
    SECRET_KEY,
    ChildOptions,
    ChildOptionsError,
    child_options_from_env,
    child_problems,
    children,
    coordinator_address,
    coordinator_service_name,
    job_secret,
    job_secret_name,
    sink_rescale_problem,
    stage_replicas,
    stage_selector,
    stage_set_name,
)
from keyshift.operator.k8s_restarts import Restarts
from keyshift.operator.k8s_scaling import KubeJob, Memory, kube_job, remembered
from keyshift.operator.rescale_executor import MigrationPlan
from keyshift.operator.streamingjob import GROUP, PLURAL, VERSION, StreamingJobSpec
from keyshift.runtime.auth import Security, Tls
from keyshift.runtime.job import JobSpec, KeyedNode, SinkNode
from keyshift.runtime.job_secret import new_job_secret
from keyshift.runtime.metrics import AutoscalerMetrics, OperatorMetrics
from keyshift.runtime.transport import TransportError

log = logging.getLogger(__name__)

STATUS_INTERVAL = 2.0
PHASES = {"starting": "Pending", "running": "Running", "draining": "Running",
          "finished": "Finished", "stopping": "Running", "failed": "Failed",
          "recovering": "Recovering"}  # fmt: skip


@dataclass
class OperatorConfig:
    """What differs between a cluster and a test: how to reach the API and the coordinators."""

    api_client: Callable[[], Awaitable[k8s.ApiClient]]
    login: Callable[..., Any]
    coordinator_address: Callable[[str, str], str] = coordinator_address
    children: ChildOptions = field(default_factory=ChildOptions)
    exported: dict[str, AutoscalerMetrics] = field(default_factory=dict)
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    # Each reconciled job's runtime parts, here rather than in its kopf memo so that they can be
    # closed when the operator stops (a scraping thread outlives kopf otherwise, and keeps
    # knocking at the ports its job's pods had).
    held: dict[str, KubeJob] = field(default_factory=dict)

    def metrics_for(self, namespace: str, job: str) -> AutoscalerMetrics:
        key = f"{namespace}/{job}"
        if key not in self.exported:
            self.exported[key] = AutoscalerMetrics(job, namespace)
        return self.exported[key]

    def job_of(self, namespace: str, job: str) -> KubeJob | None:
        """A job's runtime parts, once it is reconciled."""
        return self.held.get(f"{namespace}/{job}")

    def hold(self, namespace: str, job: str, kube: KubeJob) -> None:
        """Keep a job's new runtime parts, closing the ones they replace."""
        old = self.held.get(f"{namespace}/{job}")
        self.held[f"{namespace}/{job}"] = kube
        if old is not None:
            old.close()

    def release(self, namespace: str, job: str) -> None:
        """A deleted job: close its runtime parts, and its series go away."""
        self.metrics.forget(namespace, job)
        self.exported.pop(f"{namespace}/{job}", None)
        kube = self.held.pop(f"{namespace}/{job}", None)
        if kube is not None:
            kube.close()

    def close(self) -> None:
        """The operator has stopped: close every job's runtime parts."""
        for key in list(self.held):
            self.held.pop(key).close()


def _invalid(spec: Mapping[str, Any]) -> tuple[StreamingJobSpec | None, list[str]]:
    try:
        parsed = StreamingJobSpec.model_validate(dict(spec))
    except ValidationError as exc:
        return None, [
            f"spec.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        ]
    return parsed, parsed.problems()


async def _job_security(
    api: k8s.ApiClient, name: str, namespace: str, spec: StreamingJobSpec, body: kopf.Body
) -> Security:
    """The job's secret (and CA, with TLS) for the operator's own calls to the coordinator.
    The secret's Secret is created the first time, random and owned by the job; it is never
    overwritten, since the running pods hold its value."""
    core = k8s.CoreV1Api(api)
    manifest = job_secret(name, namespace, new_job_secret())
    kopf.adopt(manifest, owner=body)
    try:
        await core.create_namespaced_secret(namespace, manifest)  # type: ignore[arg-type]
    except ApiException as exc:
        if exc.status != 409:
            raise
    stored = await core.read_namespaced_secret(job_secret_name(name), namespace)
    secret = base64.b64decode(stored.data[SECRET_KEY])
    if spec.tls is None:
        return Security(secret)
    tls = await core.read_namespaced_secret(spec.tls.secret_name, namespace)
    ca = base64.b64decode((tls.data or {}).get("ca.crt", ""))
    if not ca:
        raise kopf.TemporaryError(f"Secret {spec.tls.secret_name} has no ca.crt", delay=10)
    return Security(secret, Tls(ca=ca, server_name=spec.tls.server_name))


async def _stateful_sets(
    api: k8s.ApiClient, name: str, namespace: str, job: JobSpec
) -> dict[str, Any]:
    """The job's StatefulSets that exist, by stage."""
    apps = k8s.AppsV1Api(api)
    found = {}
    for stage in job.stages():
        try:
            found[stage.name] = await apps.read_namespaced_stateful_set(
                stage_set_name(name, stage.name), namespace
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
    return found


async def _ready(api: k8s.ApiClient, name: str, namespace: str, job: JobSpec) -> dict[str, int]:
    sets = await _stateful_sets(api, name, namespace, job)
    return {stage: int((s.status and s.status.ready_replicas) or 0) for stage, s in sets.items()}


def build_registry(config: OperatorConfig) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    resource = (GROUP, VERSION, PLURAL)

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> Any:
        return config.login(**kwargs)

    async def reconcile(
        body: kopf.Body,
        spec: kopf.Spec,
        name: str,
        namespace: str | None,
        memo: Any,
        patch: kopf.Patch,
        status: kopf.Status,
        **_: Any,
    ) -> None:
        assert namespace is not None  # StreamingJob is a namespaced kind
        parsed, problems = _invalid(spec)
        if parsed is not None and not problems:
            problems = child_problems(name, parsed, parsed.job_spec(), config.children)
        generation = body.get("metadata", {}).get("generation", 0)
        old_conditions = list(status.get("conditions") or [])
        if parsed is None or problems:
            message = "; ".join(problems)
            patch.status["phase"] = "Degraded"
            patch.status["message"] = message
            patch.status["observedGeneration"] = generation
            patch.status["conditions"] = upsert_conditions(
                old_conditions,
                [condition("Degraded", True, "InvalidSpec", message),
                 condition("Ready", False, "InvalidSpec")],
                generation, time.time(),
            )  # fmt: skip
            kopf.warn(body, reason="InvalidSpec", message=message)
            config.metrics.reconciled(namespace, name, "invalid")
            config.metrics.phase(namespace, name, "Degraded")
            return
        job = parsed.job_spec()
        async with await config.api_client() as api:
            sets = await _stateful_sets(api, name, namespace, job)
            manifests = children(name, namespace, parsed, job, set(sets), config.children)
            kopf.adopt(manifests, owner=body)
            try:
                security = await _job_security(api, name, namespace, parsed, body)
                for stage, live in sets.items():  # a handover an operator restart cut short
                    if not scaler_owns_replicas(live):
                        set_name = stage_set_name(name, stage)
                        await apply_replicas(api, set_name, namespace, live.spec.replicas)
                for manifest in manifests:
                    await apply(api, manifest)
                for created in job.stages():
                    if created.name not in sets:  # the scaler takes the replicas over
                        set_name = stage_set_name(name, created.name)
                        replicas = stage_replicas(job, created.name, created.parallelism)
                        await apply_replicas(api, set_name, namespace, replicas)
            except ApiException:
                config.metrics.reconciled(namespace, name, "error")
                raise  # kopf retries with back-off
        config.metrics.reconciled(namespace, name, "applied")
        for warning in parsed.deprecations():
            kopf.warn(body, reason="Deprecated", message=warning)
        old = config.job_of(namespace, name)
        if old is not None:
            # A re-reconcile goes on from the live memory; a (re)started operator from the
            # status its predecessor wrote.
            memory = Memory(
                old.loop.state if old.loop else None,
                old.executor.handled,
                tuple(old.events.kept),
                old.restarts,
                old.executor.pending(),
            )
        else:
            memory, unreadable = remembered(status)
            for problem in unreadable:
                kopf.warn(body, reason="MemoryLost", message=problem)
        plan = MigrationPlan(parsed.strategy(), dict(parsed.migration.options))
        config.hold(namespace, name, kube_job(
            name, namespace, job, config.coordinator_address(name, namespace),
            config.metrics_for(namespace, name), plan, memory, security,
            partial(sink_rescale_problem, parsed, job),
        ))  # fmt: skip
        memo["spec"] = parsed
        patch.status["observedGeneration"] = generation
        patch.status["selector"] = stage_selector(name, job.keyed.name)
        patch.status["conditions"] = upsert_conditions(
            old_conditions, [condition("Degraded", False, "SpecValid")], generation, time.time()
        )
        if not status.get("phase") or status.get("phase") == "Degraded":
            patch.status["phase"] = "Pending"
            patch.status["message"] = ""
        kopf.info(body, reason="Reconciled", message=f"{len(manifests)} children applied")

    kopf.on.create(*resource, registry=registry, id="reconcile-create")(reconcile)
    kopf.on.resume(*resource, registry=registry, id="reconcile-resume")(reconcile)
    kopf.on.update(*resource, registry=registry, id="reconcile-update")(reconcile)

    def manual_steps(
        parsed: StreamingJobSpec, steps: list[tuple[str, int]], body: kopf.Body
    ) -> list[tuple[str, int]]:
        """The steps that can run: a rescale of a sink whose output log its pods cannot share
        is left out, with a warning Event saying why."""
        job = parsed.job_spec()
        sinks = {sink.name for sink in job.sinks()}
        runnable = []
        for stage, n in steps:
            problem = sink_rescale_problem(parsed, job, stage) if stage in sinks else None
            if problem is None:
                runnable.append((stage, n))
            else:
                kopf.warn(body, reason="RescaleRefused", message=f"{stage}: {problem}")
        return runnable

    async def rescale_one(
        stage: str, new: Any, parsed: StreamingJobSpec, kube: KubeJob, body: kopf.Body
    ) -> None:
        current = _running_parallelism(kube.latest(), stage)
        if current == new or not manual_steps(parsed, [(stage, int(new))], body):
            return
        try:
            await asyncio.to_thread(kube.executor.apply, [(stage, int(new))])
        except Exception as exc:  # RescaleRefused, or the coordinator not up yet
            raise kopf.TemporaryError(f"rescale to {new} not started: {exc}", delay=5) from exc
        kopf.info(body, reason="ManualRescale", message=f"{stage}: {current} -> {new}")

    def reconciled(
        memo: kopf.Memo, name: str, namespace: str | None
    ) -> tuple[KubeJob, StreamingJobSpec]:
        kube = config.job_of(namespace or "", name)
        parsed = memo.get("spec")
        if kube is None or not isinstance(parsed, StreamingJobSpec):
            raise kopf.TemporaryError("the job is not reconciled yet", delay=2)
        return kube, parsed

    @kopf.on.field(*resource, field="spec.job.keyed.parallelism", registry=registry, id="rescale")
    async def rescale(old: Any, new: Any, body: kopf.Body, memo: kopf.Memo, name: str,
                      namespace: str | None, **_: Any) -> None:  # fmt: skip
        """An edit or `kubectl scale` of the keyed stage: rescale the running job live."""
        if old is None or new is None or old == new:
            return
        kube, parsed = reconciled(memo, name, namespace)
        await rescale_one(parsed.job_spec().keyed.name, new, parsed, kube, body)

    @kopf.on.field(
        *resource, field="spec.job.sink.parallelism", registry=registry, id="rescale-sink"
    )
    async def rescale_sink(old: Any, new: Any, body: kopf.Body, memo: kopf.Memo, name: str,
                           namespace: str | None, **_: Any) -> None:  # fmt: skip
        """An edit of the sink's parallelism (a job of the older shape): rescale it live."""
        if old is None or new is None or old == new:
            return
        kube, parsed = reconciled(memo, name, namespace)
        await rescale_one(parsed.job_spec().sink.name, new, parsed, kube, body)

    @kopf.on.field(*resource, field="spec.job.graph", registry=registry, id="rescale-graph")
    async def rescale_graph(old: Any, new: Any, body: kopf.Body, memo: kopf.Memo, name: str,
                            namespace: str | None, **_: Any) -> None:  # fmt: skip
        """An edit of keyed stages' or the sink's parallelism in a graph job: rescale them
        live, one after another (the order of the graph)."""
        if not old or not new:
            return
        kube, parsed = reconciled(memo, name, namespace)
        latest = kube.latest()
        steps = [
            (stage, parallelism)
            for stage, parallelism in rescalable_parallelism(new).items()
            if rescalable_parallelism(old).get(stage) != parallelism
            and _running_parallelism(latest, stage) != parallelism
        ]
        steps = manual_steps(parsed, steps, body)
        if not steps:
            return
        try:
            await asyncio.to_thread(kube.executor.apply, steps)
        except Exception as exc:  # RescaleRefused, or the coordinator not up yet
            raise kopf.TemporaryError(f"rescale of {steps} not started: {exc}", delay=5) from exc
        moves = ", ".join(f"{stage} -> {n}" for stage, n in steps)
        kopf.info(body, reason="ManualRescale", message=moves)

    @kopf.timer(*resource, interval=STATUS_INTERVAL, registry=registry, id="observe")
    async def observe(
        body: kopf.Body,
        name: str,
        namespace: str | None,
        memo: Any,
        patch: kopf.Patch,
        status: kopf.Status,
        **_: Any,
    ) -> None:
        assert namespace is not None  # StreamingJob is a namespaced kind
        kube = config.job_of(namespace, name)
        parsed = memo.get("spec")
        if kube is None or not isinstance(parsed, StreamingJobSpec):
            return  # not reconciled (or invalid): the reconcile handlers report why
        job = parsed.job_spec()
        try:
            current = await asyncio.to_thread(kube.client.call, "Status", None, 3.0)
        except TransportError as exc:
            patch.status["phase"] = "Pending"
            patch.status["message"] = f"coordinator not reachable yet: {exc}"
            return
        kube.latest.value = current
        restart = job.checkpoints is not None and kube.restarts.observe(
            job.restart, current, time.time()
        )
        if current.get("phase") == "finished" and not kube.finished:
            # A finite job is done: its workers exit, and a StatefulSet would restart them.
            kube.finished = True
            for stage in job.stages():
                kube.pool.shrink(stage.name, 0)
        if kube.loop is not None and current.get("phase") == "running":
            await asyncio.to_thread(kube.loop.poll)
        else:
            # Without a loop the executor still reports finished rescales (manual ones).
            await asyncio.to_thread(kube.executor.finished)
        async with await config.api_client() as api:
            if restart:
                at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
                await restart_deployment(api, coordinator_service_name(name), namespace, at)
                errors = "; ".join(current.get("errors") or [])
                message = f"restarting from the latest checkpoint after: {errors}"
                kopf.warn(body, reason="Restarting", message=message)
            changed = await kube.pool.flush(api)
            ready = await _ready(api, name, namespace, job)
        for stage_name, replicas in changed:
            message = f"{stage_set_name(name, stage_name)} -> {replicas}"
            kopf.info(body, reason="Scaled", message=message)
        for decision in kube.events.pending_actions:
            kopf.info(body, reason="AutoscalerDecision", message=decision.reason)
        for problem in kube.events.pending_problems:
            kopf.warn(body, reason="AutoscalerNoDecision", message=problem)
        kube.events.pending_actions.clear()
        kube.events.pending_problems.clear()
        _write_status(patch, status, current, job, ready, kube)
        config.metrics.phase(namespace, name, patch.status["phase"])

    @kopf.on.delete(*resource, registry=registry, id="release", optional=True)
    async def release(name: str, namespace: str | None, **_: Any) -> None:
        config.release(namespace or "", name)
        log.info("released %s; its children go with it (owner references)", name)

    return registry


def rescalable_parallelism(graph: Any) -> dict[str, int]:
    """Each keyed stage's and the sink's parallelism in a StreamingJob's `spec.job.graph` (as
    kopf hands it: plain lists and mappings; the reconcile has checked it)."""
    defaults = {kind: model.model_fields["parallelism"].default
                for kind, model in (("keyed", KeyedNode), ("sink", SinkNode))}  # fmt: skip
    return {
        str(stage["name"]): int(stage.get("parallelism", defaults[stage["kind"]]))
        for stage in graph
        if isinstance(stage, Mapping) and stage.get("kind") in defaults
    }


def _running_parallelism(status: Mapping[str, Any], stage_name: str) -> int | None:
    for stage in status.get("stages", []):
        if stage["name"] == stage_name:
            return int(stage["parallelism"])
    return None


def observed_phase(
    current: Mapping[str, Any], restarts: Restarts | None = None
) -> tuple[str, str | None, str]:
    """The CR's phase from the coordinator's status and, for a job the operator restarts when
    it fails (one with checkpoints), the restart strategy's memory; the Degraded condition's
    reason (None when not degraded) and the message."""
    phase = PHASES.get(str(current.get("phase")), "Pending")
    if current.get("rescale") and phase == "Running":
        phase = "Rescaling"
    if phase == "Pending" and current.get("restored_from") is not None:
        phase = "Recovering"  # a restarted coordinator waits for the restarted pods
    errors = "; ".join(current.get("errors") or [])
    if phase == "Failed" and restarts is not None:
        if restarts.gave_up is not None:
            return phase, "RestartsExhausted", f"{errors}; not restarted again: {restarts.gave_up}"
        if restarts.handled == current.get("incarnation"):
            return "Recovering", None, f"restarting from the latest checkpoint after: {errors}"
    if phase == "Failed":
        return phase, "JobFailed", errors
    checkpoints = current.get("checkpoints") or {}
    if checkpoints.get("degraded"):
        # Processing goes on, but a crash now would lose more than the interval: say so.
        last = checkpoints.get("last") or {}
        message = (
            f"{checkpoints.get('failures_in_a_row')} checkpoints failed in a row; the last: "
            f"{last.get('error')}"
        )
        return "Degraded", "CheckpointsFailing", message
    return phase, None, errors


def recovery_status(current: Mapping[str, Any]) -> dict[str, Any]:
    """The StreamingJob's `recoveries` from the coordinator's record of them."""
    recoveries = current.get("recoveries") or {}
    last = recoveries.get("last") or {}
    return {
        "total": int(recoveries.get("total") or 0),
        "lastCheckpoint": last.get("checkpoint"),
        "lastReason": str(last.get("reason") or ""),
        "lastSeconds": last.get("seconds"),
        # Recorded before local recoveries existed, a recovery was a global restart.
        "lastMode": last.get("mode", "global") if last else None,
    }


def _write_status(
    patch: kopf.Patch,
    status: kopf.Status,
    current: Mapping[str, Any],
    job: JobSpec,
    ready: Mapping[str, int],
    kube: KubeJob,
) -> None:
    latest = kube.events.latest
    # The parallelism each stage's step still queued in the decision takes it to.
    queued = dict(kube.executor.pending().queued)
    stages = [
        {
            "name": s["name"],
            "current": int(s["parallelism"]),
            "target": int(s["desired"]),
            # A stage's standbys are pods of its StatefulSet too, ready or not.
            "ready": min(ready.get(s["name"], 0), int(s["desired"])),
            "standbys": sum(1 for w in s.get("standbys", []) if w["index"] is None),
            "lastDecision": decision.reason if (decision := latest.get(s["name"])) else "",
            "pending": queued.get(s["name"]),
        }
        for s in current.get("stages", [])
    ]
    rescaling = current.get("rescale")
    restarts = kube.restarts if job.checkpoints is not None else None
    phase, problem, errors = observed_phase(current, restarts)
    settled = all(s["current"] == s["target"] == s["ready"] for s in stages)
    conditions = [
        condition("Ready", phase == "Running" and settled, "Running" if settled else "NotSettled"),
        condition(
            "Rescaling",
            bool(rescaling),
            "Rescaling" if rescaling else "Idle",
            f"{rescaling['stage']} {rescaling['from']}->{rescaling['to']}" if rescaling else "",
        ),
        condition("Degraded", problem is not None, problem or "SpecValid", errors),
    ]
    patch.status["phase"] = phase
    patch.status["parallelism"] = _running_parallelism(current, job.keyed.name) or 0
    patch.status["stages"] = stages
    patch.status["decisions"] = kube.events.status_decisions()
    patch.status["rescales"] = [
        {
            k: r.get(k)
            for k in (
                "id",
                "stage",
                "from",
                "to",
                "strategy",
                "options",
                "phase",
                "duration",
                "error",
            )
        }
        for r in current.get("rescales", [])[-10:]
    ]
    patch.status["recoveries"] = recovery_status(current)
    # The children reflect the generation the last reconcile saw, not one it has yet to see.
    generation = int(status.get("observedGeneration") or 0)
    patch.status["conditions"] = upsert_conditions(
        list(status.get("conditions") or []), conditions, generation, time.time()
    )
    patch.status["message"] = kube.events.last_problem or errors
    patch.status.update(kube.memory())


async def in_cluster_api() -> k8s.ApiClient:
    """An API client with the operator's service account, or the local kubeconfig."""
    from kubernetes_asyncio import config as k8s_config

    try:
        k8s_config.load_incluster_config()  # type: ignore[no-untyped-call]
    except k8s_config.ConfigException:
        await k8s_config.load_kube_config()
    return k8s.ApiClient()


SERVICE_ACCOUNT_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")


class OperatorError(RuntimeError):
    """The operator cannot start; the message says why."""


def check_credentials() -> None:
    """Fail before kopf starts when there is no way to reach a cluster."""
    if SERVICE_ACCOUNT_TOKEN.exists():
        return
    configs = os.environ.get("KUBECONFIG", str(Path.home() / ".kube" / "config"))
    if any(Path(p).is_file() for p in configs.split(os.pathsep) if p):
        return
    raise OperatorError(
        "no Kubernetes credentials: not in a pod with a service account, and no kubeconfig "
        f"at {configs} (set KUBECONFIG)"
    )


def cluster_login(**kwargs: Any) -> Any:
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


def run_operator(
    namespaces: list[str], liveness_port: int = 8080, metrics_port: int = 9100
) -> None:
    """`keyshift operator`: kopf with our handlers, standalone (one replica, no peering), a
    liveness endpoint for the kubelet and the autoscalers' metrics for Prometheus."""
    from prometheus_client import CollectorRegistry, start_http_server

    try:
        options = child_options_from_env(os.environ)
    except ChildOptionsError as exc:
        raise OperatorError(str(exc)) from exc
    check_credentials()
    config = OperatorConfig(api_client=in_cluster_api, login=cluster_login, children=options)
    settings = kopf.OperatorSettings()
    settings.peering.standalone = True
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    registry = build_registry(config)

    class _AllJobs:
        def collect(self) -> Any:
            yield from config.metrics.registry.collect()
            for exported in list(config.exported.values()):
                yield from exported.registry.collect()

    metrics = CollectorRegistry()
    metrics.register(_AllJobs())
    start_http_server(metrics_port, registry=metrics)
    try:
        asyncio.run(
            kopf.operator(
                registry=registry,
                settings=settings,
                standalone=True,
                clusterwide=not namespaces,
                namespaces=namespaces,
                liveness_endpoint=f"http://0.0.0.0:{liveness_port}/healthz",
            )
        )
    finally:
        config.close()
