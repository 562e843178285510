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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kubernetes_asyncio import client as k8s

from keyshift.operator.autoscaler import AutoscalingLoop
from keyshift.operator.k8s_children import stage_set_name
from keyshift.operator.local_scaling import WallClock
from keyshift.operator.rescale_executor import CoordinatorExecutor, LatestStatus
from keyshift.operator.scaling_metrics import ScrapeSource, metrics_source
from keyshift.policies import make_policy
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
    loop at the end of each tick (`flush`)."""

    def __init__(self, name: str, namespace: str) -> None:
        self.name = name
        self.namespace = namespace
        self._wanted: dict[str, int] = {}
        self._lock = threading.Lock()

    def ensure(self, stage: str, parallelism: int) -> None:
        with self._lock:
            self._wanted[stage] = max(parallelism, self._wanted.get(stage, 0))

    def shrink(self, stage: str, parallelism: int) -> None:
        with self._lock:
            self._wanted[stage] = parallelism

    async def flush(self, api: k8s.ApiClient) -> list[tuple[str, int]]:
        with self._lock:
            wanted, self._wanted = self._wanted, {}
        apps = k8s.AppsV1Api(api)
        for stage, replicas in wanted.items():
            await apps.patch_namespaced_stateful_set(
                stage_set_name(self.name, stage), self.namespace, {"spec": {"replicas": replicas}}
            )
        return sorted(wanted.items())


@dataclass
class KubeEvents:
    """Collects what the loop decided; the kopf timer turns it into status and Events."""

    latest: dict[str, Decision] = field(default_factory=dict)
    kept: deque[Decision] = field(default_factory=lambda: deque(maxlen=KEPT_DECISIONS))
    pending_actions: list[Decision] = field(default_factory=list)
    last_problem: str | None = None
    pending_problems: list[str] = field(default_factory=list)
    scalable: frozenset[str] = frozenset()

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
                self.kept.append(decision)

    def problem(self, at: float, reason: str) -> None:
        if reason != self.last_problem:
            self.pending_problems.append(reason)
        self.last_problem = reason

    def status_decisions(self) -> list[dict[str, Any]]:
        return [
            {
                "time": timestamp(d.at),
                "stage": d.stage,
                "from": d.current,
                "to": d.target,
                "action": d.action,
                "reason": d.reason,
                "inputs": {k: round(v, 3) for k, v in d.inputs.items()},
            }
            for d in self.kept
        ]


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

    def close(self) -> None:
        if self.scrape is not None:
            self.scrape.close()
        self.client.close()


def kube_job(
    name: str,
    namespace: str,
    job: JobSpec,
    coordinator: str,
    exported: AutoscalerMetrics,
    security: Security,
) -> KubeJob:
    """Wire the parts for one StreamingJob; `security` holds the job's token for its calls."""
    client = JsonClient(coordinator, "keyshift.Coordinator", security)
    latest = LatestStatus()
    pool = StatefulSetPool(name, namespace)
    scalable = frozenset({job.keyed.name})
    executor = CoordinatorExecutor(client, pool, latest, scalable)
    events = KubeEvents(scalable=scalable)
    settings = job.autoscaler
    if settings is None:
        return KubeJob(client, latest, pool, executor, events, None, None)
    clock = WallClock()
    source, scrape = metrics_source(job, settings.prometheus_url, latest, clock)
    loop = AutoscalingLoop(
        settings, source, make_policy(settings), executor, events, clock, exported
    )
    return KubeJob(client, latest, pool, executor, events, loop, scrape)
