"""The RescaleExecutor both hosts share: the coordinator's Rescale over gRPC, plus a WorkerPool
that starts workers before a scale-out needs them and removes them after a scale-in.

The coordinator refuses a worker it does not expect yet, so a scale-out asks the coordinator
first (it then waits for the new workers to register) and grows the pool right after; a
scale-in shrinks the pool only once the coordinator reports the rescale done, when the retired
workers hold no state. Local host: the pool is the job's subprocesses (`LocalJob`); Kubernetes:
the stage's StatefulSet replicas (`keyshift.operator.k8s_scaling`). What is left of a
decision it applies one rescale at a time is a `PendingSteps` value, which a host may keep
where it outlives the host (the operator: the StreamingJob's status) and hand a new executor.

The coordinator queues requests for other stages while one runs
(keyshift.runtime.rescale_queue), yet a decision is still handed over one step at a time, not
all at once: a step that fails must drop the ones after it (the coordinator's queue has no
such link between requests, and no cancel), and a queued scale-out's workers must not start
before its turn (the coordinator refuses them). So the queue serves requests from several
callers at once (a person's `keyshift rescale`, an edit of the StreamingJob, the autoscaler),
and the executor's own steps only ever wait there behind someone else's rescale.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from keyshift.operator.autoscaler import RescaleOutcome, RescaleRefused
from keyshift.runtime.job import MAX_PARALLELISM, JobSpec
from keyshift.runtime.protocol import (
    DEFAULT_STRATEGY,
    ProtocolError,
    RescaleReport,
    RescaleRequest,
    Strategy,
    finished_rescales,
    parse,
    running_rescale,
)
from keyshift.runtime.transport import JsonClient, TransportError

Status = Callable[[], Mapping[str, Any]]
# The coordinator's phases in which its desired parallelism is what the pool must run.
RECONCILED_PHASES = ("starting", "running")


def scalable_stages(
    spec: JobSpec, sink_problem: Callable[[str], str | None] | None = None
) -> dict[str, int]:
    """The stages a host rescales live, each with the most instances it can have: every keyed
    stage (up to its key groups and MAX_PARALLELISM) and every sink (up to its output
    partitions), but a sink the host says cannot move (`sink_problem(name)`, why). Sources
    stay at their partitions, set when the job starts; the map/filter stages run chained in
    their sender's processes, at its parallelism."""
    most = min(spec.max_key_groups, MAX_PARALLELISM)
    stages = {step.stage.name: most for step in spec.keyed_stages()}
    for sink in spec.sinks():
        if sink_problem is None or sink_problem(sink.name) is None:
            stages[sink.name] = sink.output_partitions
    return stages


class WorkerPool(Protocol):
    def ensure(self, stage: str, parallelism: int) -> None:
        """Have at least `parallelism` workers of `stage` running (or starting)."""
        ...

    def shrink(self, stage: str, parallelism: int) -> None:
        """Remove the workers of `stage` from index `parallelism` on: they are retired."""
        ...

    def match(self, stage: str, parallelism: int) -> None:
        """Run exactly `parallelism` workers of `stage`: the coordinator's desired one, met
        again after a restart of the host or of the coordinator."""
        ...


@dataclass(frozen=True)
class MigrationPlan:
    """How state moves in every rescale this host starts, manual or the autoscaler's."""

    strategy: Strategy = DEFAULT_STRATEGY
    options: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RescaleMark:
    """The last rescale a host has taken the outcome of: a coordinator process (its
    incarnation) and the rescale's id in it, so a restarted coordinator's ids (from 1 again)
    are new, and a restarted host knows what it has handled."""

    incarnation: str
    id: int

    def to_json(self) -> dict[str, Any]:
        return {"incarnation": self.incarnation, "id": self.id}

    @classmethod
    def from_json(cls, value: Any) -> RescaleMark:
        """Raises ValueError saying what is wrong."""
        if not isinstance(value, Mapping):
            raise ValueError(f"a rescale mark is a mapping, got {value!r}")
        incarnation, id_ = value.get("incarnation"), value.get("id")
        if not isinstance(incarnation, str) or not incarnation:
            raise ValueError(f"incarnation must be a non-empty string, got {incarnation!r}")
        if not isinstance(id_, int) or isinstance(id_, bool) or id_ < 0:
            raise ValueError(f"id must be a rescale number, got {id_!r}")
        return cls(incarnation, id_)


@dataclass(frozen=True)
class PendingSteps:
    """What is left of a decision's rescales: the one started last whose end has not been seen
    (its mark and stage), and those to start after it, in order. A host keeps it where it
    outlives the host (the StreamingJob's status), so a restarted one goes on with it."""

    started: RescaleMark | None = None
    stage: str | None = None  # the started one's
    queued: tuple[tuple[str, int], ...] = ()

    def __bool__(self) -> bool:
        return self.started is not None or bool(self.queued)

    def to_json(self) -> dict[str, Any]:
        return {
            "started": None if self.started is None else {**self.started.to_json(),
                                                          "stage": self.stage},
            "queued": [{"stage": stage, "parallelism": n} for stage, n in self.queued],
        }  # fmt: skip

    @classmethod
    def from_json(cls, value: Any) -> PendingSteps:
        """Raises ValueError saying what is wrong."""
        if not isinstance(value, Mapping):
            raise ValueError(f"pending rescales are a mapping, got {value!r}")
        started, stage = None, None
        if value.get("started") is not None:
            started = RescaleMark.from_json(value["started"])
            stage = value["started"].get("stage")
            if not isinstance(stage, str) or not stage:
                raise ValueError(f"the started rescale's stage must be a name, got {stage!r}")
        queued = value.get("queued", [])
        if not isinstance(queued, list):
            raise ValueError(f"queued must be a list, got {queued!r}")
        steps = []
        for step in queued:
            name = step.get("stage") if isinstance(step, Mapping) else None
            n = step.get("parallelism") if isinstance(step, Mapping) else None
            if not isinstance(name, str) or not name:
                raise ValueError(f"a queued rescale's stage must be a name, got {step!r}")
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"a queued rescale's parallelism must be >= 1, got {step!r}")
            steps.append((name, n))
        return cls(started, stage, tuple(steps))


NO_PENDING = PendingSteps()


class CoordinatorExecutor:
    """Starts a rescale at the job's coordinator, then the workers a scale-out needs: the
    coordinator refuses a worker before it expects one. Reads progress from the status. A
    decision's rescales run one after another: the next starts in the `finished` call that
    sees the one before it done (the coordinator takes one rescale at a time per job); one
    that fails ends the decision, and what it dropped is said in its outcome.

    `handled` is the last rescale a predecessor took the outcome of (a restarted host reads it
    back from where it kept it): the rescales after it are reported; without one, what ended
    before this executor existed counts as handled. Whenever it meets a coordinator process
    for the first time (its own start, a coordinator restart), it sets the pool to the
    coordinator's desired parallelism once no rescale runs: what ended while nobody watched
    (a scale-in, a restore to a checkpoint's parallelism) is not left to crash-loop."""

    def __init__(
        self,
        client: JsonClient,
        pool: WorkerPool,
        status: Status,
        scalable: Mapping[str, int],
        plan: MigrationPlan = MigrationPlan(),
        handled: RescaleMark | None = None,
        pending: PendingSteps = NO_PENDING,
    ) -> None:
        self.client = client
        self.pool = pool
        self.status = status
        self.scalable = scalable
        self.plan = plan
        self.handled = handled
        self._incarnation: str | None = None
        self._reconcile = True
        # The rescale this executor (or the host before it) started last whose end the status
        # has not shown yet, with its stage, and the rest of its decision's rescales, to start
        # one by one.
        self._started: tuple[RescaleMark, str] | None = (
            (pending.started, pending.stage or "") if pending.started is not None else None
        )
        self._queued: deque[tuple[str, int]] = deque(pending.queued)

    def pending(self) -> PendingSteps:
        """What is left of the decision being applied (empty once it is done)."""
        if self._started is None:
            return PendingSteps(queued=tuple(self._queued))
        mark, stage = self._started
        return PendingSteps(mark, stage, tuple(self._queued))

    def apply(self, steps: Sequence[tuple[str, int]]) -> None:
        if not steps:
            return
        self._start(*steps[0])
        self._queued = deque(steps[1:])

    def _start(self, stage: str, parallelism: int) -> None:
        request = RescaleRequest(
            stage=stage,
            parallelism=parallelism,
            strategy=self.plan.strategy,
            options=dict(self.plan.options),
        )
        try:
            reply = self.client.call("Rescale", request.wire(), timeout=10.0)
        except TransportError as exc:
            raise RescaleRefused(str(exc)) from None
        try:
            report = parse(RescaleReport, reply)
        except ProtocolError as exc:
            # Started, yet unreadable: the next steps cannot know when it ends.
            self.pool.ensure(stage, parallelism)
            self._queued.clear()
            raise RescaleRefused(f"started, but its reply is unreadable: {exc}") from None
        self._started = (RescaleMark(report.incarnation, report.id), report.stage)
        # One queued behind another's rescale (a manual one) gets its workers when it starts
        # (`_match_pool`): the coordinator refuses them until then.
        if report.phase != "queued":
            self.pool.ensure(stage, parallelism)

    def running(self) -> str | None:
        rescale = running_rescale(self.status())
        if rescale is not None:
            return rescale.stage
        # Started by this executor, but the status fetched last is older than the start.
        if self._started is not None:
            return self._started[1]
        return self._queued[0][0] if self._queued else None

    def finished(self) -> list[RescaleOutcome]:
        status = self.status()
        incarnation = status.get("incarnation")
        if not isinstance(incarnation, str):
            return []  # no status from a coordinator yet
        history = finished_rescales(status)
        if incarnation != self._incarnation:
            if self._incarnation is None and self.handled is None:
                last = max((r.id for r in history), default=0)
                self.handled = RescaleMark(incarnation, last)
            started_here = self._started is None or self._started[0].incarnation == incarnation
            if self._incarnation is not None or not started_here:
                # A restarted coordinator (restored to a checkpoint's parallelism) ends what
                # was started of a decision, also while the host was down; the loop decides
                # again on what it finds.
                self._started = None
                self._queued.clear()
            self._incarnation = incarnation
            self._reconcile = True
        outcomes = []
        for rescale in history:
            if self.handled is not None and (
                self.handled.incarnation == incarnation and rescale.id <= self.handled.id
            ):
                # Its outcome was taken before (by a host before this one): if it is the one
                # started last, the decision goes on only if it succeeded.
                if self._ends_started(rescale) and rescale.phase != "done":
                    self._queued.clear()
                continue
            self.handled = RescaleMark(incarnation, rescale.id)
            mine = self._ends_started(rescale)
            if rescale.phase == "replaced" and not mine:
                continue  # someone else's request, asked again before it started: no outcome
            ok = rescale.phase == "done"
            if ok and rescale.to_parallelism < rescale.from_parallelism:
                self.pool.shrink(rescale.stage, rescale.to_parallelism)
            detail = rescale.error or rescale.phase
            if mine and not ok and self._queued:
                dropped = ", ".join(f"{stage}→{n}" for stage, n in self._queued)
                detail += f"; not started after it: {dropped}"
                self._queued.clear()
            outcomes.append(RescaleOutcome(rescale.stage, ok, detail))
        self._match_pool(status)
        # After matching the pool to `status`, which is older than the next step's start.
        if self._started is None and self._queued and running_rescale(status) is None:
            outcomes += self._start_next()
        return outcomes

    def _ends_started(self, rescale: RescaleReport) -> bool:
        """Whether `rescale` is the one this executor started last (which has now ended)."""
        started = self._started
        if started is None or started[0] != RescaleMark(rescale.incarnation, rescale.id):
            return False
        self._started = None
        return True

    def _start_next(self) -> list[RescaleOutcome]:
        """Start the decision's next rescale: a refused one is its failed outcome, and the
        ones after it are dropped."""
        stage, parallelism = self._queued.popleft()
        try:
            self._start(stage, parallelism)
        except RescaleRefused as exc:
            dropped = "".join(f"; not started after it: {s}→{n}" for s, n in self._queued)
            self._queued.clear()
            return [RescaleOutcome(stage, False, f"not started: {exc}{dropped}")]
        return []

    def _match_pool(self, status: Mapping[str, Any]) -> None:
        """A running scale-out gets its new workers now (the host that asked for them may
        have died before starting them, or it waited in the coordinator's queue); when
        reconciling, every stage's pool at the coordinator's desired parallelism, once no
        rescale runs (a scale-in's retiring workers still hold state)."""
        if status.get("phase") not in RECONCILED_PHASES:
            return
        running = running_rescale(status)
        if running is not None:
            if running.to_parallelism > running.from_parallelism:
                self.pool.ensure(running.stage, running.to_parallelism)
            return
        if not self._reconcile:
            return
        for stage in status.get("stages", []):
            self.pool.match(stage["name"], int(stage["desired"]))
        self._reconcile = False


class LatestStatus:
    """The coordinator status the run loop fetched last; the parts read it instead of asking
    the coordinator again."""

    def __init__(self) -> None:
        self.value: Mapping[str, Any] = {"stages": []}

    def __call__(self) -> Mapping[str, Any]:
        return self.value
