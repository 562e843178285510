"""The RescaleExecutor both hosts share: the coordinator's Rescale over gRPC, plus a WorkerPool
that starts workers before a scale-out needs them and removes them after a scale-in.

The coordinator refuses a worker it does not expect yet, so a scale-out asks the coordinator
first (it then waits for the new workers to register) and grows the pool right after; a
scale-in shrinks the pool only once the coordinator reports the rescale done, when the retired
workers hold no state. Local host: the pool is the job's subprocesses (`LocalJob`); Kubernetes:
the stage's StatefulSet replicas (`keyshift.operator.k8s_scaling`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from keyshift.operator.autoscaler import RescaleOutcome, RescaleRefused
from keyshift.runtime.transport import JsonClient, TransportError

Status = Callable[[], Mapping[str, Any]]


class WorkerPool(Protocol):
    def ensure(self, stage: str, parallelism: int) -> None:
        """Have at least `parallelism` workers of `stage` running (or starting)."""
        ...

    def shrink(self, stage: str, parallelism: int) -> None:
        """Remove the workers of `stage` from index `parallelism` on: they are retired."""
        ...


class CoordinatorExecutor:
    """Starts a rescale at the job's coordinator, then the workers a scale-out needs: the
    coordinator refuses a worker before it expects one. Reads progress from the status."""

    def __init__(
        self, client: JsonClient, pool: WorkerPool, status: Status, scalable: frozenset[str]
    ) -> None:
        self.client = client
        self.pool = pool
        self.status = status
        self.scalable = scalable
        self._reported: set[int] | None = None

    def apply(self, stage: str, parallelism: int, strategy: str) -> None:
        try:
            self.client.call(
                "Rescale",
                {"stage": stage, "parallelism": parallelism, "strategy": strategy},
                timeout=10.0,
            )
        except TransportError as exc:
            raise RescaleRefused(str(exc)) from None
        self.pool.ensure(stage, parallelism)

    def running(self) -> str | None:
        rescale = self.status().get("rescale")
        return str(rescale["stage"]) if rescale else None

    def finished(self) -> list[RescaleOutcome]:
        history = self.status().get("rescales", [])
        if self._reported is None:
            # What ended before this executor existed (an operator restart, a re-reconcile) was
            # handled by its predecessor: replaying a scale-in would shrink a pool grown since.
            self._reported = {r["id"] for r in history}
            return []
        outcomes = []
        for rescale in history:
            if rescale["id"] in self._reported:
                continue
            self._reported.add(rescale["id"])
            ok = rescale["phase"] == "done"
            if ok and rescale["to"] < rescale["from"]:
                self.pool.shrink(rescale["stage"], rescale["to"])
            detail = rescale.get("error") or rescale["phase"]
            outcomes.append(RescaleOutcome(rescale["stage"], ok, str(detail)))
        return outcomes


class LatestStatus:
    """The coordinator status the run loop fetched last; the parts read it instead of asking
    the coordinator again."""

    def __init__(self) -> None:
        self.value: Mapping[str, Any] = {"stages": []}

    def __call__(self) -> Mapping[str, Any]:
        return self.value
