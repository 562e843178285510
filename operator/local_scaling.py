"""The local host's parts for the autoscaling loop, and the one place they are wired together.

WorkerPool = subprocesses (`LocalJob`), RescaleExecutor = the coordinator's Rescale over gRPC,
MetricsSource = a real Prometheus server when the job's settings name one, else direct scraping
of the instances, EventSink = the run's console, a decisions log (JSON lines) and the live view.
`keyshift run` builds it with `local_autoscaler` and polls it from its status loop; it also keeps
a Prometheus file-based service discovery list current when asked to (`TargetsFile`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from keyshift.operator.autoscaler import AutoscalingLoop
from keyshift.operator.rescale_executor import (
    CoordinatorExecutor,
    LatestStatus,
    MigrationPlan,
    WorkerPool,
    scalable_stages,
)
from keyshift.operator.scaling_metrics import ScrapeSource, members_of, metrics_source
from keyshift.policies import make_policy
from keyshift.policies.model import Decision
from keyshift.policies.settings import AutoscalerSettings
from keyshift.runtime.job import JobSpec
from keyshift.runtime.metrics import AutoscalerMetrics
from keyshift.runtime.transport import JsonClient


class WallClock:
    """Seconds since the epoch: the time base Prometheus uses too."""

    def now(self) -> float:
        return time.time()


class RunEvents:
    """The run's record of the loop: every decision in a JSON-lines file (for the report),
    actions and problems printed as they happen, the latest decision per stage for the view."""

    def __init__(self, path: Path, say: Callable[[str], None]) -> None:
        self.path = path
        self.say = say
        self.latest: dict[str, Decision] = {}
        self.problems: list[tuple[float, str]] = []
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")

    def decided(self, decisions: Sequence[Decision]) -> None:
        with self.path.open("a") as out:
            for decision in decisions:
                out.write(json.dumps(decision.to_json()) + "\n")
                self.latest[decision.stage] = decision
                if decision.action != "hold":
                    self.say(f"autoscaler: {decision.reason}")

    def problem(self, at: float, reason: str) -> None:
        with self.path.open("a") as out:
            out.write(json.dumps({"at": at, "problem": reason}) + "\n")
        if not self.problems or self.problems[-1][1] != reason:
            self.say(f"autoscaler: {reason}")
        self.problems.append((at, reason))


class TargetsFile:
    """A Prometheus file_sd list of the job's metrics endpoints, rewritten (atomically) when
    instances come and go."""

    def __init__(self, path: Path, extra: Sequence[str] = ()) -> None:
        self.path = path
        self.extra = list(extra)
        self._written: list[str] | None = None

    def update(self, status: Mapping[str, Any]) -> None:
        addresses = sorted(
            {a for group in members_of(status).values() for a in group.values()} | set(self.extra)
        )
        if addresses == self._written:
            return
        # No target labels: the series carry their own `keyshift_job`.
        body = [{"targets": addresses, "labels": {}}]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(body))
        os.replace(tmp, self.path)
        self._written = addresses


class LocalAutoscaler:
    """The loop with the local host's parts; `poll(status)` from the run's status loop."""

    def __init__(
        self,
        loop: AutoscalingLoop,
        events: RunEvents,
        latest: LatestStatus,
        metrics_port: int,
        scrape: ScrapeSource | None,
    ) -> None:
        self.loop = loop
        self.events = events
        self.latest = latest
        self.metrics_port = metrics_port
        self._scrape = scrape

    def poll(self, status: Mapping[str, Any]) -> list[Decision]:
        self.latest.value = status
        if status.get("phase") != "running":
            return []
        return self.loop.poll()

    def close(self) -> None:
        if self._scrape is not None:
            self._scrape.close()


def local_autoscaler(
    spec: JobSpec,
    settings: AutoscalerSettings,
    client: JsonClient,
    pool: WorkerPool,
    log_dir: Path,
    say: Callable[[str], None],
    host: str = "127.0.0.1",
) -> LocalAutoscaler:
    """Wire the loop for a job run on this machine."""
    clock = WallClock()
    exported = AutoscalerMetrics(spec.name)
    metrics_port = exported.serve(host, 0)
    events = RunEvents(log_dir / "decisions.jsonl", say)
    latest = LatestStatus()

    source, scrape = metrics_source(spec, settings.prometheus_url, latest, clock)
    plan = MigrationPlan(settings.strategy)  # a job file's one place for the loop's strategy
    executor = CoordinatorExecutor(client, pool, latest, scalable_stages(spec), plan)
    loop = AutoscalingLoop(
        settings, source, make_policy(settings), executor, events, clock, exported,
        chained=spec.dataflow().chained(),
    )  # fmt: skip
    return LocalAutoscaler(loop, events, latest, metrics_port, scrape)
