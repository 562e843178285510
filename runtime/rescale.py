"""The rescale protocol, driven by the coordinator: one rescale of a keyed stage at a time.

(Requests for other stages wait meanwhile in keyshift.runtime.rescale_queue.)

A rescale is a small explicit protocol with named phases. The move is divided into subscales
(`keyshift.runtime.subscales`, DRRS): for `hot-first` and `batched`, each moves groups between one
old owner and one new owner (`batched`: `batch_groups` at a time), and those with disjoint
instances run side by side, each with its own epoch, each committed as soon as it is done; with
the option `subscales: 0`, and for the other strategies, a subscale is one global step (every
pair), one after another. For each subscale the coordinator:

1. PREPARING: tells each new owner which groups it will receive and from whom (`migrate_in`);
   it parks records of those groups until their state arrives.
2. FREEZING: tells each old owner which groups leave and to whom (`migrate_out`); from then on
   it stops applying records of those groups, forwards them in order to the new owner, answers
   on-demand fetches, and pushes the rest of their state, hottest groups first.
3. REROUTING: tells every sender (each instance of the stage upstream: a source, or the keyed
   stage before) the new assignment (`reroute`); each sends an epoch MARKER on its data streams
   to the stage, so an old owner knows when nothing routed by the old epoch can still come. An
   old owner takes a marker of a later epoch for the end of its own too, so reroutes go out in
   epoch order: one of epoch E once every subscale up to E is frozen, carrying them all.
4. MOVING: waits until every old owner reports `out_done` (all forwarded and pushed) and every
   new owner `in_done` (all state in, nothing parked).

With checkpoints on, `hot-first`, `batched` and `all-at-once` hand state over from the latest
completed checkpoint (Rhino) unless the rescale's `handover` option is 0: before the first step
(and before `all-at-once` pauses anything), PRELOADING tells each new owner to load its future
groups from that checkpoint (`preload`) while the old owners go on processing them, and waits
for each `preloaded`; every step's `migrate_in` and `migrate_out` then name the checkpoint, and
the old owners push only what changed since (whole groups where they do not know it, saying
why in `out_done`). No checkpoint starts while a rescale runs, so none completes during the
preload. A preload that failed (the checkpoint missing, corrupt or unreadable) makes every
step a direct transfer; the status says why (`handover.fallback`).

`all-at-once` pauses the senders before the first step and resumes them after the last;
`lazy` pushes state at a slow trickle so nearly everything moves by on-demand fetches. A
scale-out starts the new instances first (the host sees the desired parallelism in the status);
a scale-in moves state away first and then retires the highest indexes.
Used by `keyshift.runtime.coordinator`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from keyshift.runtime.assignment_planner import plan
from keyshift.runtime.keyspace import Assignment
from keyshift.runtime.metrics import HandoverCause
from keyshift.runtime.pacing import PushPacer
from keyshift.runtime.protocol import (
    STRATEGIES,
    Abort,
    Ack,
    AckStep,
    Command,
    HandoverReport,
    InDone,
    MigrateIn,
    MigrateOut,
    OutDone,
    PacingReport,
    Pause,
    Preload,
    Preloaded,
    PushOptions,
    PushRate,
    Reported,
    Reroute,
    RescaleReport,
    Rescaling,
    Resume,
    Strategy,
    SubscaleReport,
    SubscalesReport,
)
from keyshift.runtime.subscales import Subscale, divide, startable

log = logging.getLogger("keyshift.rescale")

DEFAULT_OPTIONS: dict[str, dict[str, float]] = {
    "hot-first": {"chunk_keys": 32768},
    "all-at-once": {"chunk_keys": 65536},
    "batched": {"chunk_keys": 32768, "batch_groups": 256},
    "lazy": {"chunk_keys": 4096, "trickle_keys_per_s": 20000},
}
# These keep records flowing, so they may also cap their push (trickle_keys_per_s, unlimited
# unless given): moving a large state then leaves an old owner CPU for its records. Or pace it
# to a latency objective (max_latency_ms), which sets the push rate itself.
CAPPABLE = ("hot-first", "batched")
# These push whole groups in the background, so a preload can spare the switch most of it
# (`lazy` moves nearly everything by fetches, which a preload does not spare).
HANDOVER = ("hot-first", "all-at-once", "batched")
HANDOVER_OPTION = "handover"  # 1 (the default): hand over from checkpoints; 0: move directly
# These divide the move into concurrent subscales (DRRS) unless the option is 0.
SUBSCALED = ("hot-first", "batched")
SUBSCALES_OPTION = "subscales"
# Options that are 1 (on, the default) or 0 (off): what each means on and off.
SWITCHES = {
    HANDOVER_OPTION: ("hand over from checkpoints", "move state directly"),
    SUBSCALES_OPTION: ("concurrent subscales", "one step of every pair after another"),
}
SUBSCALES_SHOWN = 16  # subscales a rescale's status lists (running first, then the latest done)
CAPS = ("trickle_keys_per_s", "max_latency_ms")
STEP_TIMEOUT = 30.0
MOVE_TIMEOUT = 600.0


class RescaleError(Exception):
    """A rescale that cannot start or could not finish; the message says why."""


class RescaleTimeout(RescaleError):
    """What a rescale waited for did not happen in time (nothing else went wrong)."""


class RescaleHost(Protocol):
    """What the driver needs from the coordinator (implemented by Coordinator)."""

    register_timeout: float  # how long a new instance may take to start and register

    def addresses(self, stage: str) -> dict[int, str]: ...

    def sender_count(self, stage: str) -> int: ...

    def finished(self, stage: str) -> set[int]: ...

    def send(self, stage: str, index: int, command: Command) -> None: ...

    def set_desired(self, stage: str, parallelism: int) -> None: ...

    def commit(self, stage: str, assignment: Assignment) -> None: ...

    def retire(self, stage: str, indexes: list[int]) -> None: ...

    def wait_for(
        self, predicate: Callable[[list[Reported]], bool], timeout: float, what: str
    ) -> None: ...

    def broadcast(self, stage: str, command: Command) -> None: ...

    def lost_keyed(self) -> set[int]: ...

    def latest_checkpoint(self) -> int | None:
        """The latest completed checkpoint (None: none has completed)."""
        ...

    @property
    def checkpointed(self) -> bool:
        """Whether the job takes checkpoints."""
        ...

    def sink_latencies(self) -> list[tuple[float, float]]: ...


@dataclass
class HandoverStatus:
    """A rescale's hand-over from checkpoints as it goes (HandoverReport is its report)."""

    checkpoint: int | None
    preloaded_keys: int = 0
    preloaded_bytes: int = 0
    preload_seconds: float = 0.0
    fallback: str | None = None
    cause: HandoverCause | None = None  # of the fallback, for the metric

    def fell_back(self, reason: str, cause: HandoverCause) -> None:
        self.fallback = reason if self.fallback is None else f"{self.fallback}; {reason}"
        self.cause = self.cause or cause

    def report(self, progress: dict[str, float]) -> HandoverReport:
        """`progress`: the rescale's counters; what the new owners took in at switch time is
        the bytes the switch moved (chunks, whole groups, fetch replies)."""
        return HandoverReport(
            checkpoint=self.checkpoint,
            preloaded_keys=self.preloaded_keys,
            preloaded_bytes=self.preloaded_bytes,
            preload_seconds=self.preload_seconds,
            switch_bytes=int(progress.get("bytes_in", 0)),
            delta_groups=int(progress.get("groups_changes", 0)),
            whole_groups=int(progress.get("groups_whole", 0)),
            fallback=self.fallback,
        )


@dataclass
class SubscaleRun:
    """A subscale as it runs: its epoch, phase, the wait it is in and the addresses its
    commands name (kept: a lost instance leaves the coordinator's)."""

    subscale: Subscale
    epoch: int
    peers: dict[str, str]
    phase: str = "preparing"
    started: float = field(default_factory=time.time)
    deadline: float = 0.0  # of its phase's wait, monotonic
    frozen: bool = False  # its old owners acked `migrate_out`: it may be rerouted
    out_sent: bool = False
    told: set[int] = field(default_factory=set)  # the old owners sent its `migrate_out`
    finished: float | None = None
    bytes: int = 0  # what its new owners took in, once done

    def wait(self, phase: str, seconds: float) -> None:
        self.phase = phase
        self.deadline = time.monotonic() + seconds

    def report(self, since: float) -> SubscaleReport:
        return SubscaleReport(
            sources=sorted(self.subscale.sources),
            destinations=sorted(self.subscale.destinations),
            epoch=self.epoch,
            groups=len(self.subscale.groups),
            phase=self.phase,
            bytes=self.bytes,
            started=round(self.started - since, 3),
            seconds=round((self.finished or time.time()) - self.started, 3),
        )


def subscales_report(runs: list[SubscaleRun], count: int, since: float) -> SubscalesReport:
    """`since`: when the rescale started. Bounded: the running subscales, then the latest
    done, SUBSCALES_SHOWN at most."""
    running = [r for r in runs if r.finished is None]
    done = [r for r in runs if r.finished is not None]
    shown = (running + done[::-1])[:SUBSCALES_SHOWN]
    return SubscalesReport(
        count=count,
        done=len(done),
        running=len(running),
        shown=[r.report(since) for r in sorted(shown, key=lambda r: r.epoch)],
    )


@dataclass
class RescaleStatus:
    # (incarnation, id) names a rescale across coordinator restarts: ids start at 1 again in
    # every coordinator process, and a host must not take a new rescale for one it has seen.
    incarnation: str
    id: int
    stage: str
    from_parallelism: int
    to_parallelism: int
    strategy: Strategy
    options: dict[str, float]
    phase: str = "requested"
    started: float = field(default_factory=time.time)
    finished: float | None = None
    error: str | None = None
    epoch: int | None = None
    groups_to_move: int = 0
    groups_moved: int = 0
    steps: int = 0
    progress: dict[str, float] = field(default_factory=dict)
    replaced: int | None = None  # the queued request of the same stage this one replaced
    handover: HandoverStatus | None = None
    pacer: PushPacer | None = None
    subscales: int = 0  # how many the move is divided into
    runs: list[SubscaleRun] = field(default_factory=list)  # those started, in order

    def report(self) -> RescaleReport:
        return RescaleReport(
            incarnation=self.incarnation,
            id=self.id,
            stage=self.stage,
            from_parallelism=self.from_parallelism,
            to_parallelism=self.to_parallelism,
            strategy=self.strategy,
            options=dict(self.options),
            phase=self.phase,
            started=self.started,
            finished=self.finished,
            duration=(self.finished or time.time()) - self.started,
            error=self.error,
            epoch=self.epoch,
            groups_to_move=self.groups_to_move,
            groups_moved=self.groups_moved,
            steps=self.steps,
            progress=dict(self.progress),
            mb_per_s=transfer_rates(self.progress),
            replaced=self.replaced,
            handover=self.handover.report(self.progress) if self.handover else None,
            pacing=None if self.pacer is None else pacing_report(self.pacer),
            subscales=(
                subscales_report(self.runs, self.subscales, self.started)
                if self.subscales
                else None
            ),
        )


def pacing_report(pacer: PushPacer) -> PacingReport:
    worst = pacer.worst_p99_s
    return PacingReport(
        objective_ms=pacer.objective_s * 1000,
        worst_p99_ms=None if worst is None else round(worst * 1000, 1),
        met=pacer.met(),
        keys_per_s=list(pacer.rates),
    )


def transfer_rates(progress: dict[str, float]) -> dict[str, float | None]:
    """MB/s of state at each end of a move (out: old owners, in: new owners): the bytes an end
    moved over the time its moves spent moving them, summed over its instances; None until an
    end has finished a move."""
    rates: dict[str, float | None] = {}
    for end in ("out", "in"):
        ms = progress.get(f"ms_{end}", 0.0)
        rates[end] = round(progress.get(f"bytes_{end}", 0.0) / 1e3 / ms, 3) if ms else None
    return rates


def options_for(strategy: str, given: dict[str, Any] | None) -> dict[str, float]:
    """The strategy's options with defaults; unknown or non-positive options are errors."""
    if strategy not in STRATEGIES:
        raise RescaleError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    options = dict(DEFAULT_OPTIONS[strategy])
    takes = sorted(
        {
            *options,
            *(CAPS if strategy in CAPPABLE else []),
            *([HANDOVER_OPTION] if strategy in HANDOVER else []),
            *([SUBSCALES_OPTION] if strategy in SUBSCALED else []),
        }
    )
    for name, value in (given or {}).items():
        if name not in takes:
            raise RescaleError(f"option {name!r} does not apply to {strategy}; it takes {takes}")
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if name in SWITCHES:
            if not number or value not in (0, 1):
                on, off = SWITCHES[name]
                raise RescaleError(
                    f"option {name!r} must be 1 ({on}, the default) or 0 ({off}), got {value!r}"
                )
        elif not number or value <= 0:
            raise RescaleError(f"option {name!r} must be a positive number, got {value!r}")
        options[name] = float(value)
    if all(cap in options for cap in CAPS):
        raise RescaleError(
            "options 'max_latency_ms' and 'trickle_keys_per_s' exclude each other: a rescale "
            "paced to a latency objective sets its push rate itself"
        )
    return options


def step_acked(
    step: AckStep, epoch: int, expected: set[tuple[str, int]], at_least: bool = False
) -> Callable[..., bool]:
    def check(events: list[Reported]) -> bool:
        got = {
            (r.stage, r.index)
            for r in events
            if isinstance(r.event, Ack)
            and r.event.step == step
            and (r.event.epoch >= epoch if at_least else r.event.epoch == epoch)
        }
        return expected <= got

    return check


def moves_reported(
    kind: type[OutDone] | type[InDone], epoch: int, expected: set[int]
) -> Callable[..., bool]:
    def check(events: list[Reported]) -> bool:
        got = {r.index for r in events if isinstance(r.event, kind) and r.event.epoch == epoch}
        return expected <= got

    return check


class RescaleDriver:
    """Runs one rescale to completion (or failure) on the coordinator's behalf."""

    def __init__(
        self,
        host: RescaleHost,
        status: RescaleStatus,
        keyed_stage: str,
        upstream: tuple[str, ...],
        current: Assignment,
        group_load: np.ndarray,
    ) -> None:
        """`upstream`: the stages whose instances send to `keyed_stage` (the source, keyed
        stages): they are rerouted, paused and resumed."""
        self.host = host
        self.status = status
        self.keyed = keyed_stage
        self.senders = upstream
        self.current = current
        self.group_load = group_load
        self.target = current.owners  # every group's owner once the rescale is done (planned)
        self.epoch = current.epoch  # the latest a subscale was given
        self.rerouted = current.epoch  # the latest the senders were sent
        self.handover: int | None = None  # the checkpoint the subscales hand over from
        objective = status.options.get("max_latency_ms")
        if objective is not None:
            status.pacer = PushPacer(objective / 1000, status.options["chunk_keys"])

    def run(self) -> None:
        status = self.status
        # Keyed instances stay up while a rescale runs, even once every sender has ended.
        self.host.broadcast(self.keyed, Rescaling(active=True))
        try:
            self._run()
            status.phase = "done"
        except RescaleError as exc:
            status.error = str(exc)
            log.error("rescale %d failed: %s", status.id, exc)
            lost = self.host.lost_keyed()
            if lost:
                try:
                    status.error += "; " + self._recover(lost)
                except RescaleError as again:
                    status.error += f"; recovery failed too: {again}"
            status.phase = "failed"
        finally:
            status.finished = time.time()
            ended = [f"{stage}/{i}" for stage, i in sorted(self._finished_senders())]
            self.host.broadcast(self.keyed, Rescaling(active=False, ended=ended))

    def _phase(self, phase: str) -> None:
        self.status.phase = phase
        log.info("rescale %d: %s", self.status.id, phase)

    def _run(self) -> None:
        status = self.status
        old_p, new_p = status.from_parallelism, status.to_parallelism
        if new_p > old_p:
            self._phase("starting-instances")
            self.host.set_desired(self.keyed, new_p)
            try:
                self.host.wait_for(
                    lambda _events: len(self.host.addresses(self.keyed)) >= new_p,
                    self.host.register_timeout,
                    f"new instances {self.keyed}/{old_p}..{new_p - 1} to register",
                )
            except RescaleTimeout:
                # Nothing has moved: the stage stays at its width, and the new instances that
                # did register leave (else the host would go on starting the missing ones). A
                # loss meanwhile is not this: the recovery that follows gives the lost
                # instance's groups to the new width.
                self.host.set_desired(self.keyed, old_p)
                started = sorted(set(self.host.addresses(self.keyed)) - set(range(old_p)))
                if started:
                    self.host.retire(self.keyed, started)
                raise
        self.target = target = plan(self.current.owners, new_p, self.group_load)
        moving = np.flatnonzero(target != self.current.owners)
        status.groups_to_move = len(moving)
        # Hot groups first: each subscale, and each old owner's push, go in order of load.
        subscales = divide(
            self.current.owners,
            target,
            self.group_load,
            int(status.options["batch_groups"]) if status.strategy == "batched" else None,
            per_pair=status.strategy in SUBSCALED
            and status.options.get(SUBSCALES_OPTION, 1.0) == 1.0,
        )
        handover = self._preload(target, moving)
        paused = status.strategy == "all-at-once"
        if paused:
            self._broadcast_senders(Pause(epoch=self.current.epoch))
        try:
            self._move(subscales, handover)
        finally:
            if paused:
                self._phase("resuming")
                self._broadcast_senders(Resume(epoch=self.current.epoch))
        if new_p < old_p:
            self._phase("retiring")
            # Lowered first: a host keeps instances 0..desired-1 running, and must not start a
            # retired one again in the moment after it left.
            self.host.set_desired(self.keyed, new_p)
            self.host.retire(self.keyed, list(range(new_p, old_p)))

    def _preload(self, target: np.ndarray, moving: np.ndarray) -> int | None:
        """Have the new owners load their future groups from the latest completed checkpoint;
        the checkpoint the steps hand over from, or None (a direct transfer)."""
        status = self.status
        wanted = status.options.get(HANDOVER_OPTION, 1.0) == 1.0
        if not self.host.checkpointed or status.strategy not in HANDOVER or not wanted:
            return None
        checkpoint = self.host.latest_checkpoint()
        status.handover = report = HandoverStatus(checkpoint)
        if checkpoint is None:
            report.fell_back("no checkpoint had completed: the state moved directly", "none")
            return None
        if not len(moving):
            return None
        by_owner: dict[int, list[int]] = {}
        for group in moving.tolist():
            by_owner.setdefault(int(target[group]), []).append(group)
        self._phase("preloading")
        for owner, groups in by_owner.items():
            self.host.send(self.keyed, owner, Preload(checkpoint=checkpoint, groups=sorted(groups)))
        got: dict[int, Preloaded] = {}

        def preloaded(events: list[Reported]) -> bool:
            for r in events:
                event = r.event
                if isinstance(event, Preloaded) and event.checkpoint == checkpoint:
                    got[r.index] = event
            return set(got) >= set(by_owner)

        self.host.wait_for(
            preloaded, MOVE_TIMEOUT, f"new owners to preload checkpoint {checkpoint}"
        )
        report.preloaded_keys = sum(e.keys for e in got.values())
        report.preloaded_bytes = sum(e.bytes for e in got.values())
        report.preload_seconds = max(e.seconds for e in got.values())
        failed = sorted((i, e.error) for i, e in got.items() if e.error is not None)
        if failed:
            index, error = failed[0]
            report.fell_back(
                f"the preload from checkpoint {checkpoint} failed at {self.keyed}/{index}: "
                f"{error}; the state moved directly",
                "preload",
            )
            return None
        return checkpoint

    def _broadcast_senders(self, command: Pause | Resume | Reroute) -> None:
        """Send a command to the senders and wait for their acks; a sender that has ended
        sends nothing more, so it needs no command (its END also ends the old epoch)."""
        for stage, index in self._sender_set():
            self.host.send(stage, index, command)
        self.host.wait_for(
            self._senders_acked(command.type, command.epoch),
            STEP_TIMEOUT,
            f"senders {list(self.senders)} to {command.type}",
        )

    def _sender_set(self) -> set[tuple[str, int]]:
        return {(s, i) for s in self.senders for i in range(self.host.sender_count(s))}

    def _senders_acked(
        self, step: AckStep, epoch: int, at_least: bool = False
    ) -> Callable[[list[Reported]], bool]:
        """Whether every sender that has not ended acked `step` of `epoch` (`at_least`: of
        `epoch` or a later one)."""

        def done(events: list[Reported]) -> bool:
            expected = self._sender_set() - self._finished_senders()
            return step_acked(step, epoch, expected, at_least)(events)

        return done

    def _finished_senders(self) -> set[tuple[str, int]]:
        return {(stage, i) for stage in self.senders for i in self.host.finished(stage)}

    def _recover(self, lost: set[int]) -> str:
        """After an instance died mid-move: keep every group whose state survives where it is,
        or give it back to its old owner; groups whose state died move to survivors empty.
        Every subscale that started goes on: those whose old owners were not told to freeze
        yet are told now (their new owners' moves in wait for them), and the abort takes the
        lost instance out of all of them."""
        self._phase("recovering")
        current = self.current.owners
        runs = [r for r in self.status.runs if r.finished is None]
        owners = current.copy()
        for run in runs:
            groups = run.subscale.groups
            owners[groups] = self.target[groups]
        for run in runs:
            if not run.out_sent:
                self._freeze(run, lost)
        died = np.isin(owners, list(lost))
        owners[died] = current[died]  # back to the old owner, with what it has not handed over
        gone = np.isin(owners, list(lost))

        # The instances a scale-out started may still be registering: they take a share too.
        wanted = set(range(max(self.status.from_parallelism, self.status.to_parallelism))) - lost
        try:
            self.host.wait_for(
                lambda _events: wanted <= set(self.host.addresses(self.keyed)),
                self.host.register_timeout,
                f"instances {sorted(wanted)} to take the lost instances' key groups",
            )
        except RescaleError:
            if not set(self.host.addresses(self.keyed)) - lost:
                raise
        alive = sorted(set(self.host.addresses(self.keyed)) - lost)
        if gone.any():
            owners[gone] = np.asarray(alive, dtype=np.int32)[np.arange(gone.sum()) % len(alive)]
        # Survivors take up every group of a lost instance they now own before any sender
        # routes a record of it there: those whose state died, and those given back to their
        # old owner, whose move out may have handed all of it over and closed already (its
        # `out_done` in) while the new owner died before its `in_done`.
        adopt = {
            str(i): g.tolist() for i in alive if len(g := np.flatnonzero(died & (owners == i)))
        }
        epoch = max(self.epoch, self.current.epoch)
        recovered = Assignment(epoch + 1, owners)
        senders = set().union(*(r.subscale.sources for r in runs))
        receivers = set().union(*(r.subscale.destinations for r in runs))
        participants = (senders | receivers | {int(i) for i in adopt}) - lost
        self.host.broadcast(self.keyed, Abort(epoch=epoch, lost=sorted(lost), adopt=adopt))
        self.host.wait_for(
            step_acked("abort", epoch, {(self.keyed, i) for i in participants}),
            STEP_TIMEOUT,
            "survivors to abandon the moves to and from the lost instance",
        )
        reroute = Reroute(
            stage=self.keyed,
            epoch=recovered.epoch,
            assignment=recovered.to_json(),
            keyed={str(i): a for i, a in self.host.addresses(self.keyed).items() if i not in lost},
            lost=sorted(lost),
        )
        self._broadcast_senders(reroute)
        self.host.wait_for(
            lambda events: all(
                moves_reported(OutDone, r.epoch, r.told - lost)(events)
                and moves_reported(InDone, r.epoch, r.subscale.destinations - lost)(events)
                for r in runs
            ),
            MOVE_TIMEOUT,
            "the survivors' moves to finish",
        )
        self.current = recovered
        self.host.commit(self.keyed, recovered)
        self.host.set_desired(self.keyed, max(alive) + 1)
        return (
            f"recovered at parallelism {len(alive)}: {int(gone.sum())} key groups lost their "
            f"state with instance(s) {sorted(lost)}, the rest stay where their state is"
        )

    # -- the subscales -------------------------------------------------------------------

    def _move(self, subscales: list[Subscale], handover: int | None) -> None:
        """Run the subscales, those with free instances side by side (`startable`), each
        through its phases on its own; each one's groups are committed when it is done."""
        status = self.status
        concurrent = (
            status.strategy in SUBSCALED and status.options.get(SUBSCALES_OPTION, 1.0) == 1.0
        )
        status.subscales = len(subscales)
        waiting = list(subscales)
        self.handover = handover
        if status.pacer is not None:
            status.pacer.start(time.time())
        while waiting or self._running():
            chosen = startable(waiting, [r.subscale for r in self._running()], concurrent)
            for i in chosen:
                self._start(waiting[i])
            waiting = [sub for i, sub in enumerate(waiting) if i not in chosen]
            first = min(self._running(), key=lambda r: r.deadline)
            self.host.wait_for(
                self._progressed,
                max(0.0, first.deadline - time.monotonic()),
                f"subscale {self._name(first)} ({first.phase})",
            )

    def _running(self) -> list[SubscaleRun]:
        return [r for r in self.status.runs if r.finished is None]

    def _name(self, run: SubscaleRun) -> str:
        pairs = ", ".join(f"{s}->{d}" for s, d in run.subscale.pairs)
        return f"{self.keyed} {pairs} of epoch {run.epoch}"

    def _start(self, subscale: Subscale) -> None:
        """PREPARING: each new owner parks records of its coming groups until they are in."""
        self.epoch += 1
        self.status.epoch = self.epoch
        self.status.steps += 1
        peers = {str(i): a for i, a in self.host.addresses(self.keyed).items()}
        run = SubscaleRun(subscale, self.epoch, peers)
        run.wait("preparing", STEP_TIMEOUT)
        self.status.runs.append(run)
        incoming: dict[int, dict[str, list[int]]] = {}
        for (src, dst), groups in subscale.pairs.items():
            incoming.setdefault(dst, {})[str(src)] = sorted(groups.tolist())
        for dst, groups_in in incoming.items():
            command = MigrateIn(
                epoch=run.epoch, groups=groups_in, peers=peers, handover=self.handover
            )
            self.host.send(self.keyed, dst, command)
        self._phase("preparing")

    def _freeze(self, run: SubscaleRun, lost: Collection[int] = ()) -> None:
        """FREEZING: each old owner stops applying the leaving groups' records, forwards them
        and pushes their state (`lost`: instances gone; in a recovery, the pairs they are in
        are not started: their groups stay with, or go back to, their old owners)."""
        status, pacer = self.status, self.status.pacer
        push = PushOptions(
            chunk_keys=int(status.options["chunk_keys"]),
            trickle_keys_per_s=(
                status.options.get("trickle_keys_per_s") if pacer is None else pacer.rate_keys_per_s
            ),
        )
        outgoing: dict[int, dict[str, list[int]]] = {}
        for (src, dst), groups in run.subscale.pairs.items():
            if src not in lost and dst not in lost:
                outgoing.setdefault(src, {})[str(dst)] = sorted(groups.tolist())
        for src, groups_out in outgoing.items():
            run.told.add(src)
            command = MigrateOut(
                epoch=run.epoch,
                groups=groups_out,
                peers=run.peers,
                sources=sum(self.host.sender_count(stage) for stage in self.senders),
                push=push,
                handover=self.handover,
            )
            self.host.send(self.keyed, src, command)
        run.out_sent = True
        run.wait("freezing", STEP_TIMEOUT)

    def _progressed(self, events: list[Reported]) -> bool:
        """Take every running subscale as far as the events allow; whether any moved on (the
        driver then starts what may start, and waits on the new deadlines)."""
        changed = False
        for run in self._running():
            changed |= self._advance(run, events)
        changed |= self._reroute()
        self._pace()
        running = self._running()
        if running:
            self.status.phase = running[0].phase
        return changed

    def _advance(self, run: SubscaleRun, events: list[Reported]) -> bool:
        epoch, keyed = run.epoch, self.keyed
        if run.phase == "preparing":
            if not step_acked("migrate_in", epoch, {(keyed, d) for d in run.subscale.destinations})(
                events
            ):
                return False
            self._freeze(run)
            return True
        if run.phase == "freezing":
            if run.frozen or not step_acked(
                "migrate_out", epoch, {(keyed, s) for s in run.subscale.sources}
            )(events):
                return False
            run.frozen = True
            return True
        if run.phase == "rerouting":
            if not self._senders_acked("reroute", epoch, at_least=True)(events):
                return False
            run.wait("moving", MOVE_TIMEOUT)
            return True
        if not (
            moves_reported(OutDone, epoch, run.subscale.sources)(events)
            and moves_reported(InDone, epoch, run.subscale.destinations)(events)
        ):
            return False
        self._done(run, events)
        return True

    def _reroute(self) -> bool:
        """REROUTING: every sender gets the assignment with the frozen subscales' groups at
        their new owners. Epochs go up in the order subscales start, so a subscale waits for
        every one started before it to be frozen: an old owner takes a sender's marker of its
        epoch or a later one as the end of the old routing, which must then include it."""
        upto = self.rerouted
        for run in sorted(self._running(), key=lambda r: r.epoch):
            if run.epoch <= self.rerouted:
                continue
            if not run.frozen:
                break
            upto = run.epoch
        if upto == self.rerouted:
            return False
        owners = self.current.owners.copy()
        for run in self._running():
            if run.epoch <= upto:
                groups = run.subscale.groups
                owners[groups] = self.target[groups]
        self.rerouted = upto
        reroute = Reroute(
            stage=self.keyed,
            epoch=upto,
            assignment=Assignment(upto, owners).to_json(),
            keyed={str(i): a for i, a in self.host.addresses(self.keyed).items()},
        )
        for stage, index in self._sender_set():
            self.host.send(stage, index, reroute)
        for run in self._running():
            if run.phase == "freezing" and run.epoch <= upto:
                run.wait("rerouting", STEP_TIMEOUT)
        return True

    def _done(self, run: SubscaleRun, events: list[Reported]) -> None:
        """MOVING is over for this subscale: its groups are committed at their new owners."""
        status = self.status
        groups = run.subscale.groups
        owners = self.current.owners.copy()
        owners[groups] = self.target[groups]
        self.current = Assignment(max(self.current.epoch, run.epoch), owners)
        self.host.commit(self.keyed, self.current)
        status.groups_moved += len(groups)
        run.phase = "done"
        run.finished = time.time()
        for r in events:
            event = r.event
            if isinstance(event, InDone) and event.epoch == run.epoch:
                run.bytes += int(event.stats.get("bytes_in", 0))
            if isinstance(event, OutDone) and event.epoch == run.epoch and event.fallback:
                assert status.handover is not None  # a fallback names the hand-over's
                status.handover.fell_back(event.fallback, "changes")
        if status.pacer is not None:
            status.pacer.finish(self.host.sink_latencies())

    def _pace(self) -> None:
        """With a latency objective, the old owners' push rate follows the sinks' p99."""
        pacer = self.status.pacer
        if pacer is None:
            return
        rate = pacer.decide(time.time(), self.host.sink_latencies())
        if rate is None:
            return
        alive = set(self.host.addresses(self.keyed))  # a lost one takes none
        for run in self._running():
            if run.out_sent:
                for src in run.subscale.sources & alive:
                    self.host.send(self.keyed, src, PushRate(epoch=run.epoch, keys_per_s=rate))
