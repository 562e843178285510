"""The Kubernetes host's parts for the autoscaling loop, and the one place they are wired.

WorkerPool = the stage's StatefulSet (its replicas), RescaleExecutor = the coordinator's Rescale
over gRPC (shared with the local host), MetricsSource = Prometheus when the job's settings name
one, else the instances scraped directly (pod IPs, from the coordinator's status), EventSink =
the StreamingJob's status and a Kubernetes Event per decision (posted by the kopf handlers from
what `KubeEvents` collected). Used by `keyshift.operator.k8s_operator`.
"""

from __future__ import annotations

import datetime
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kubernetes_asyncio import client as k8s
from pydantic import ValidationError

from keyshift.operator.autoscaled_job import AutoscaledJob
from keyshift.operator.autoscaler import AutoscalingLoop
from keyshift.operator.k8s_apply import apply_replicas
from keyshift.operator.k8s_children import stage_replicas, stage_set_name
from keyshift.operator.k8s_restarts import Restarts
from keyshift.operator.local_scaling import WallClock
from keyshift.operator.rescale_executor import (
    CoordinatorExecutor,
    LatestStatus,
    MigrationPlan,
    PendingSteps,
    RescaleMark,
    scalable_stages,
)
from keyshift.operator.scaling_metrics import ScrapeSource, metrics_source
from keyshift.operator.streamingjob import DecisionStatus
from keyshift.policies import make_policy
from keyshift.policies.guards import GuardState
from keyshift.policies.model import Decision
from keyshift.runtime.auth import Security
from keyshift.runtime.job import JobSpec
from keyshift.runtime.metrics import AutoscalerMetrics
from keyshift.runtime.transport import JsonClient

KEPT_DECISIONS = 10


def timestamp(at: float) -> str:
    return datetime.datetime.fromtimestamp(at, datetime.UTC).isoformat(timespec="seconds")


class StatefulSetPool:
    """Replica changes the loop asked for (from its thread), applied by the operator's event
    loop at the end of each tick (`flush`); a keyed stage's standbys run above its instances
    (`stage_replicas`)."""

    def __init__(self, name: str, namespace: str, job: JobSpec) -> None:
        self.name = name
        self.namespace = namespace
        self.job = job
        self._wanted: dict[str, int] = {}
        self._lock = threading.Lock()

    def ensure(self, stage: str, parallelism: int) -> None:
        with self._lock:
            self._wanted[stage] = max(parallelism, self._wanted.get(stage, 0))

    def shrink(self, stage: str, parallelism: int) -> None:
        with self._lock:
            self._wanted[stage] = parallelism

    def match(self, stage: str, parallelism: int) -> None:
        self.shrink(stage, parallelism)

    async def flush(self, api: k8s.ApiClient) -> list[tuple[str, int]]:
        """Apply what was asked; each stage changed and its StatefulSet's replicas."""
        with self._lock:
            wanted, self._wanted = self._wanted, {}
        applied = {
            stage: stage_replicas(self.job, stage, parallelism)
            for stage, parallelism in wanted.items()
        }
        for stage, replicas in applied.items():
            await apply_replicas(api, stage_set_name(self.name, stage), self.namespace, replicas)
        return sorted(applied.items())


@dataclass
class KubeEvents:
    """Collects what the loop decided; the kopf timer turns it into status and Events."""

    latest: dict[str, Decision] = field(default_factory=dict)
    kept: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=KEPT_DECISIONS))
    pending_actions: list[Decision] = field(default_factory=list)
    last_problem: str | None = None
    pending_problems: list[str] = field(default_factory=list)
    scalable: Mapping[str, int] = field(default_factory=dict)

    def decided(self, decisions: Sequence[Decision]) -> None:
        self.last_problem = None
        for decision in decisions:
            before = self.latest.get(decision.stage)
            self.latest[decision.stage] = decision
            if decision.stage not in self.scalable:
                continue
            if decision.action != "hold":
                self.pending_actions.append(decision)
            if decision.action != "hold" or before is None or _gist(before) != _gist(decision):
                self.kept.append(_status_entry(decision))

    def problem(self, at: float, reason: str) -> None:
        if reason != self.last_problem:
            self.pending_problems.append(reason)
        self.last_problem = reason

    def status_decisions(self) -> list[dict[str, Any]]:
        return list(self.kept)


def _status_entry(d: Decision) -> dict[str, Any]:
    """A decision as the StreamingJob status lists it (`DecisionStatus`)."""
    return {
        "time": timestamp(d.at),
        "stage": d.stage,
        "from": d.current,
        "to": d.target,
        "action": d.action,
        "reason": d.reason,
        "inputs": {k: round(v, 3) for k, v in d.inputs.items()},
    }


def _gist(decision: Decision) -> tuple[str, int, str]:
    """What makes a held decision worth keeping again: a different recommendation or guard."""
    return decision.action, decision.recommended, decision.reason.rpartition("; ")[2][:20]


@dataclass
class KubeJob:
    """One StreamingJob's runtime parts in the operator: its coordinator client, the latest
    status, the pool and, with an autoscaler, the loop."""

    client: JsonClient
    latest: LatestStatus
    pool: StatefulSetPool
    executor: CoordinatorExecutor
    events: KubeEvents
    loop: AutoscalingLoop | None
    scrape: ScrapeSource | None
    finished: bool = False  # the job has ended and its workers were scaled to zero
    restarts: Restarts = field(default_factory=Restarts)

    def close(self) -> None:
        if self.scrape is not None:
            self.scrape.close()
        self.client.close()

    def memory(self) -> dict[str, Any]:
        """What a restarted operator reads back (`remembered`): the guards' state and the last
        rescale whose outcome was taken, as the StreamingJob status keeps them."""
        handled = self.executor.handled
        return {
            "guards": self.loop.state.to_json() if self.loop is not None else {},
            "handledRescale": handled.to_json() if handled is not None else None,
            "pendingRescales": self.executor.pending().to_json(),
            "restarts": self.restarts.to_json(),
        }


@dataclass(frozen=True)
class Memory:
    """The parts of a job's control state that outlive an operator process."""

    guards: GuardState | None = None
    handled: RescaleMark | None = None
    decisions: tuple[dict[str, Any], ...] = ()  # the latest, as the status lists them
    restarts: Restarts | None = None
    pending: PendingSteps = field(default_factory=PendingSteps)  # what is left of a decision


def remembered(status: Mapping[str, Any]) -> tuple[Memory, list[str]]:
    """The memory kept in a StreamingJob's status, and what could not be read back (each part
    that is unreadable starts afresh; the message says which)."""
    problems = []
    guards = handled = None
    if status.get("guards"):
        try:
            guards = GuardState.from_json(status["guards"])
        except ValueError as exc:
            problems.append(f"status.guards ignored: {exc}")
    if status.get("handledRescale"):
        try:
            handled = RescaleMark.from_json(status["handledRescale"])
        except ValueError as exc:
            problems.append(f"status.handledRescale ignored: {exc}")
    decisions: tuple[dict[str, Any], ...] = ()
    if status.get("decisions"):
        try:
            decisions = tuple(
                DecisionStatus.model_validate(d).model_dump(by_alias=True)
                for d in status["decisions"]
            )
        except (ValidationError, TypeError) as exc:
            problems.append(f"status.decisions ignored: {exc}")
    pending = PendingSteps()
    if status.get("pendingRescales") is not None:
        try:
            pending = PendingSteps.from_json(status["pendingRescales"])
        except ValueError as exc:
            problems.append(f"status.pendingRescales ignored: {exc}")
    restarts = None
    if status.get("restarts"):
        try:
            restarts = Restarts.from_json(status["restarts"])
        except ValueError as exc:
            problems.append(f"status.restarts ignored: {exc}")
    return Memory(guards, handled, decisions, restarts, pending), problems


def kube_job(
    name: str,
    namespace: str,
    job: AutoscaledJob,
    coordinator: str,
    exported: AutoscalerMetrics,
    plan: MigrationPlan,
    memory: Memory,
    security: Security,
    sink_problem: Callable[[str], str | None] | None = None,
) -> KubeJob:
    """Wire the parts for one StreamingJob, going on from `memory`; `security` holds the job's
    token for its calls; `sink_problem(name)`, why a sink cannot be rescaled live here (then
    the autoscaler leaves that sink alone)."""
    client = JsonClient(coordinator, "keyshift.Coordinator", security)
    latest = LatestStatus()
    pool = StatefulSetPool(name, namespace, job)
    scalable = scalable_stages(job, sink_problem)
    executor = CoordinatorExecutor(
        client, pool, latest, scalable, plan, memory.handled, memory.pending
    )
    kept = deque(memory.decisions, maxlen=KEPT_DECISIONS)
    events = KubeEvents(kept=kept, scalable=scalable)
    restarts = memory.restarts or Restarts()
    settings = job.autoscaler
    if settings is None:
        return KubeJob(client, latest, pool, executor, events, None, None, restarts=restarts)
    clock = WallClock()
    source, scrape = metrics_source(job, settings.prometheus_url, latest, clock, namespace)
    loop = AutoscalingLoop(
        settings, source, make_policy(settings), executor, events, clock, exported,
        memory.guards, job.dataflow().chained(),
    )  # fmt: skip
    return KubeJob(client, latest, pool, executor, events, loop, scrape, restarts=restarts)
