"""Aligned checkpoints (Chandy-Lamport barriers, as Flink's aligned checkpoints).

Three parts, one per role:

- `CheckpointDriver` runs in the coordinator: as soon as the job runs, then every `interval`
  seconds, when no rescale runs, it tells every source instance to take checkpoint N. A source
  puts a BARRIER on each of its keyed streams between two batches and acks its position
  (records emitted so far). A keyed instance aligns: once a source's barrier arrived, that
  source's later batches wait (unread, so their credits backpressure it) until every live
  source's barrier is in (a keyed stage after others aligns the same way over their
  instances, over every input of a union); then it snapshots its key groups
  (keyshift.runtime.state_checkpoint: a base or a delta per group copied out; on RocksDB a
  native checkpoint of its database, hard links, keyshift.runtime.rocksdb_checkpoint), sends
  the barrier on to the keyed stages it feeds and the sinks and goes on with its records
  while a thread of its own stores the snapshot; it acks when the upload ends (as Flink's
  asynchronous phase). A sink aligns on the keyed instances' barriers the same way, flushes
  its output log and acks the log's end offset. When every instance has acked, the driver
  writes the checkpoint's metadata (id, every keyed stage's epoch and assignment, source
  positions, output offsets, every group's chain) in one atomic write: the checkpoint is
  complete. It tells the sources and sinks so (`CheckpointComplete`): an ingest source lets go
  of the logged rows the checkpoint covers, and a sink lets readers see its output up to the
  checkpoint's offset. Then it deletes what the retained checkpoints no longer need.
- `BarrierAligner` is the alignment both keyed and sink instances do.
- `KeyedCheckpointer` is a keyed instance's side: it takes the snapshot, runs the upload,
  and remembers its last chains (or its database's stored files), so a delta is only written
  (a file only reused) on top of a checkpoint that completed.

Rescales and checkpoints never overlap: a checkpoint starts only when no rescale runs, and a
rescale request waits for the checkpoint in flight to end (Coordinator.rescale). So a barrier
never meets a migration, and every key group is wholly owned by one instance at a checkpoint.
Only aligned checkpoints exist; unaligned ones are not supported.

A checkpoint that does not complete within `timeout`, or whose storage fails, is abandoned
(its files are deleted by the next retention pass); processing goes on, and after
`degraded_after` failures in a row the job's status says `degraded`. While checkpoints fail,
the next one is tried after a pause that doubles from `interval` up to RETRY_PAUSE_LIMIT (a
store that cannot be reached costs each attempt seconds of alignment); the first to complete
brings back the normal interval.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from keyshift.runtime.checkpoint_store import (
    CheckpointError,
    CheckpointMeta,
    CheckpointStore,
    GroupChain,
    KeyedGroups,
    ShardFile,
    SinkOutputs,
    chains_from_json,
    chains_to_json,
    database_from_json,
)
from keyshift.runtime.job import CheckpointSettings
from keyshift.runtime.protocol import (
    CHECKPOINT_ACKS,
    Barrier,
    Checkpoint,
    KeyedCheckpointAck,
    Reported,
    SinkCheckpointAck,
    SourceCheckpointAck,
    checkpoint_of,
)
from keyshift.runtime.rocksdb_checkpoint import (
    native_groups,
    restore_databases,
    snapshot_database,
    upload_database,
)
from keyshift.runtime.rocksdb_state import RocksStore
from keyshift.runtime.state import KeyedState
from keyshift.runtime.state_checkpoint import read_groups, snapshot_groups, store_groups
from keyshift.runtime.storage import Backoff, retrying
from keyshift.runtime.transport import Delivery

log = logging.getLogger("keyshift.checkpoints")

FIRST_CHECKPOINT_POLL = 0.2  # seconds between looks for a running job to take a first one of
RETRY_PAUSE_LIMIT = 10.0  # the longest pause (seconds) between checkpoints while they fail


def open_store(settings: CheckpointSettings) -> CheckpointStore:
    return CheckpointStore(settings.storage, settings.storage_options)


# --- the coordinator's side -------------------------------------------------------------------


class CheckpointHost(Protocol):
    """What the driver needs from the coordinator (implemented by Coordinator)."""

    def checkpoint_members(self) -> CheckpointMembers | None:
        """The instances a checkpoint would involve (only the live sources), and mark a
        checkpoint in flight; None when none may start now (starting, draining, a rescale
        running)."""
        ...

    def checkpoint_send(self, source: int, command: Checkpoint) -> None:
        """Start `command` at the source instance of id `source`."""
        ...

    def checkpoint_assignments(self) -> dict[str, dict[str, Any]]:
        """Every keyed stage's assignment (unchanged while a checkpoint is in flight)."""
        ...

    def checkpoint_partitions(self) -> dict[str, dict[str, Any]]:
        """Every sink's output partitions' owners, by sink, the job's first sink first
        (unchanged while a checkpoint is in flight)."""
        ...

    def checkpoint_events(self, checkpoint: int, timeout: float) -> list[Reported] | None:
        """Wait until every instance in flight acked `checkpoint` (or one failed it); None on
        timeout. A source that has ended acks with its final position. CheckpointAbandoned
        when the job stops running meanwhile."""
        ...

    def checkpoint_completed(self, meta: CheckpointMeta) -> None:
        """Tell the sources and sinks that `meta`'s checkpoint is complete."""
        ...

    def checkpoint_ended(self, outcome: CheckpointOutcome) -> None: ...

    def storage_failures(self) -> list[str]:
        """The storage failures the instances report now ("<instance>: <error>"): why a
        checkpoint may not complete (a sink stalled on a full disk backpressures the job)."""
        ...


@dataclass(frozen=True)
class CheckpointMembers:
    """The instances one checkpoint involves: source ids (`JobSpec.source_id`, unique across
    the job's sources), each keyed stage's instance indexes, each sink's instance indexes."""

    sources: set[int]
    keyed: dict[str, set[int]]
    sinks: dict[str, set[int]]


class CheckpointAbandoned(CheckpointError):
    """The job stopped running (finished, or is stopping) before the checkpoint completed:
    not a failure of the checkpoint."""


@dataclass
class CheckpointOutcome:
    id: int
    ok: bool
    started: float  # wall clock
    seconds: float
    error: str | None = None
    abandoned: bool = False
    written: int = 0  # bytes of new shards
    full: int = 0  # bytes of all shards the checkpoint names
    groups: int = 0

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class CheckpointStats:
    """The status the coordinator shows: the latest outcomes and the failure streak."""

    last_completed: CheckpointOutcome | None = None
    last: CheckpointOutcome | None = None
    failures_in_a_row: int = 0
    completed: int = 0
    failed: int = 0
    in_flight: int | None = None
    degraded: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "completed": self.completed,
            "failed": self.failed,
            "failures_in_a_row": self.failures_in_a_row,
            "degraded": self.degraded,
            "in_flight": self.in_flight,
            "last": self.last.to_json() if self.last else None,
            "last_completed": self.last_completed.to_json() if self.last_completed else None,
        }


class CheckpointDriver:
    """Starts checkpoints periodically and completes them; one at a time."""

    def __init__(
        self,
        host: CheckpointHost,
        settings: CheckpointSettings,
        store: CheckpointStore,
        keyed_stage: str,
        stop: threading.Event,
        last_completed: int | None = None,
        next_id: int | None = 1,
    ) -> None:
        """`keyed_stage`: the first keyed stage, whose owners and groups the metadata keeps as
        `assignment` and `groups` (those of the later ones go in its `later`). `next_id` None:
        not known (storage could not list the checkpoints taken before)."""
        self.host = host
        self.settings = settings
        self.store = store
        self.keyed_stage = keyed_stage
        self.stop = stop
        # A restored job builds deltas on top of its checkpoint, and numbers the next ones
        # after every checkpoint ever taken (ids are never reused).
        self.last_completed = last_completed
        self.next_id = next_id

    def run(self) -> None:
        # A job that has no checkpoint yet takes its first as soon as it runs: until one
        # completes, a crash has nothing to go back to.
        wait = FIRST_CHECKPOINT_POLL if self.last_completed is None else self.settings.interval
        interval = self.settings.interval
        backoff = Backoff(interval, max(interval, RETRY_PAUSE_LIMIT))
        while not self.stop.wait(wait):
            members = self.host.checkpoint_members()
            if members is None:
                continue
            outcome = self.take(members)
            if outcome.ok or outcome.abandoned:
                backoff.reset()
                wait = interval
            else:
                wait = backoff.failed()

    def take(self, members: CheckpointMembers) -> CheckpointOutcome:
        started, t0 = time.time(), time.monotonic()
        if self.next_id is None:
            # Numbering from 1 could overwrite the checkpoints of an earlier run (and retention
            # would then keep those): none is taken until they can be listed.
            try:
                self.next_id = max(self.store.completed(), default=0) + 1
            except CheckpointError as exc:
                error = f"cannot list the checkpoints taken before: {exc}"
                log.error("no checkpoint taken: %s", error)
                outcome = CheckpointOutcome(0, False, started, time.monotonic() - t0, error)
                self.host.checkpoint_ended(outcome)
                return outcome
        checkpoint = self.next_id
        self.next_id += 1
        command = Checkpoint(id=checkpoint, previous=self.last_completed)
        for source in sorted(members.sources):
            self.host.checkpoint_send(source, command)
        outcome = CheckpointOutcome(checkpoint, False, started, 0.0)
        try:
            events = self.host.checkpoint_events(checkpoint, self.settings.timeout)
            if events is None:
                failing = "; ".join(self.host.storage_failures())
                raise CheckpointError(
                    f"not complete within {self.settings.timeout:g} s"
                    + (f" (storage failing: {failing})" if failing else "")
                )
            failed = [(r.instance, why) for r in events if (why := _error_of(r))]
            if failed:
                raise CheckpointError(f"{failed[0][0]}: {failed[0][1]}")
            meta = self._metadata(checkpoint, started, events)
            self.store.commit(meta)
            self.host.checkpoint_completed(meta)
            outcome.ok = True
            outcome.written = meta.written
            outcome.full = meta.size()
            outcome.groups = len(meta.groups) + sum(len(p.groups) for p in meta.later.values())
            self.last_completed = checkpoint
            try:
                self.store.retain(self.settings.retain)
            except CheckpointError as exc:  # the checkpoint is complete; cleanup can wait
                log.warning("retention after checkpoint %d failed: %s", checkpoint, exc)
        except CheckpointAbandoned as exc:
            outcome.error, outcome.abandoned = str(exc), True
            log.info("checkpoint %d abandoned: %s", checkpoint, exc)
        except CheckpointError as exc:
            outcome.error = str(exc)
            log.error("checkpoint %d failed: %s", checkpoint, exc)
        outcome.seconds = time.monotonic() - t0
        self.host.checkpoint_ended(outcome)
        return outcome

    def _metadata(self, checkpoint: int, started: float, events: list[Reported]) -> CheckpointMeta:
        groups: dict[str, dict[int, GroupChain]] = {}
        databases: dict[str, dict[str, ShardFile]] = {}
        sources: dict[str, Any] = {}
        outputs: dict[str, dict[str, int]] = {}
        keyed_marks: dict[str, list[int | None]] = {}
        instance_marks: dict[str, dict[str, int]] = {}
        written = 0
        for reported in events:
            event = reported.event
            if isinstance(event, SourceCheckpointAck):
                sources[str(event.source)] = event.position
            elif isinstance(event, KeyedCheckpointAck):
                groups.setdefault(reported.stage, {}).update(chains_from_json(event.chains))
                written += event.written
                keyed_marks.setdefault(reported.stage, []).append(event.watermark)
                if event.watermark is not None:
                    marks = instance_marks.setdefault(reported.stage, {})
                    marks[str(reported.index)] = event.watermark
                if event.writer is not None and event.database is not None:
                    databases[event.writer] = database_from_json(event.database)
            elif isinstance(event, SinkCheckpointAck):
                # By partition: each has one owner.
                outputs.setdefault(reported.stage, {}).update(event.offsets)
        assignments = self.host.checkpoint_assignments()
        first = self.keyed_stage
        partitions = self.host.checkpoint_partitions()
        first_sink = next(iter(partitions))
        # A stage's watermark is its slowest instance's; none while one has none.
        watermarks = {
            stage: min(m for m in marks if m is not None)
            for stage, marks in keyed_marks.items()
            if None not in marks
        }
        return CheckpointMeta(
            id=checkpoint,
            created=started,
            epochs={stage: int(a["epoch"]) for stage, a in assignments.items()},
            assignment=assignments[first],
            sources=sources,
            outputs=outputs.get(first_sink, {}),
            groups=groups.get(first, {}),
            written=written,
            databases=databases,
            later={
                stage: KeyedGroups(a, groups.get(stage, {}))
                for stage, a in assignments.items()
                if stage != first
            },
            watermarks=watermarks,
            instance_watermarks=instance_marks,
            partitions=partitions[first_sink],
            later_sinks={
                sink: SinkOutputs(outputs.get(sink, {}), owners)
                for sink, owners in partitions.items()
                if sink != first_sink
            },
        )


def _error_of(reported: Reported) -> str | None:
    event = reported.event
    return event.error if isinstance(event, CHECKPOINT_ACKS) else None


def acked(events: Iterable[Reported], checkpoint: int, members: CheckpointMembers) -> bool:
    """Whether every member has acked `checkpoint`, or one of them failed it."""
    sources: set[int] = set()
    keyed: dict[str, set[int]] = {}
    sinks: dict[str, set[int]] = {}
    for reported in events:
        if checkpoint_of(reported) != checkpoint:
            continue
        if _error_of(reported):
            return True
        event = reported.event
        if isinstance(event, SourceCheckpointAck):
            sources.add(event.source)
        elif isinstance(event, KeyedCheckpointAck):
            keyed.setdefault(reported.stage, set()).add(reported.index)
        elif isinstance(event, SinkCheckpointAck):
            sinks.setdefault(reported.stage, set()).add(reported.index)
    return (
        sources >= members.sources
        and all(sinks.get(stage, set()) >= wanted for stage, wanted in members.sinks.items())
        and all(keyed.get(stage, set()) >= wanted for stage, wanted in members.keyed.items())
    )


# --- the instances' side ----------------------------------------------------------------------


@dataclass
class BarrierAligner:
    """Aligns one checkpoint's barriers from a set of upstream senders.

    While aligning, deliveries from senders whose barrier is in are held, unread and with their
    credits kept, so those senders are backpressured instead of buffered without bound.
    """

    barrier: Barrier | None = None
    arrived: set[str] = field(default_factory=set)
    held: deque[Delivery] = field(default_factory=deque)

    def holds(self, sender: str) -> bool:
        return self.barrier is not None and sender in self.arrived

    def hold(self, delivery: Delivery) -> None:
        self.held.append(delivery)

    def arrive(self, sender: str, barrier: Barrier) -> None:
        if self.barrier is not None and barrier.id != self.barrier.id:
            raise CheckpointProtocolError(
                f"barrier {barrier.id} from {sender} while aligning {self.barrier.id}"
            )
        self.barrier = barrier
        self.arrived.add(sender)

    def aligned(self, live: AbstractSet[str]) -> bool:
        """True once every live sender's barrier is in (ended senders send no more)."""
        return self.barrier is not None and live <= self.arrived

    def finish(self) -> list[Delivery]:
        """End the alignment; the held deliveries, to be processed next, in order."""
        held = list(self.held)
        self.barrier, self.arrived, self.held = None, set(), deque()
        return held


class CheckpointProtocolError(RuntimeError):
    """Barriers that do not follow the protocol (a bug, not bad input)."""


class KeyedCheckpointer:
    """A keyed instance's checkpoints: snapshot its groups (shards, or its RocksDB database
    natively) in the keyed loop, store them beside it, and remember what the next checkpoint
    may build on."""

    def __init__(self, settings: CheckpointSettings, writer: str) -> None:
        self.settings = settings
        self.writer = writer
        self.store: CheckpointStore | None = None
        self.last_id: int | None = None
        self.last_chains: dict[int, GroupChain] = {}
        # The files of this instance's database at its last checkpoint (native checkpoints).
        self.last_files: dict[str, ShardFile] = {}
        # The checkpoint at whose barrier the state's change marks were last cleared: the marks
        # are what changed since it (a hand-over from it sends only them). None: not known.
        self.marks_since: int | None = None
        self._upload: _Upload | None = None

    def checkpoint_store(self) -> CheckpointStore:
        """The store, opened once (also for a hand-over's preload)."""
        if self.store is None:
            self.store = open_store(self.settings)
        return self.store

    def restore(self, meta: CheckpointMeta, state: KeyedState, owned: np.ndarray) -> int:
        """Load the owned groups' state from a checkpoint (after a crash); the keys restored.
        The next checkpoint writes deltas on top of this one."""
        store = self.checkpoint_store()
        chains = {g: meta.groups[g] for g in np.flatnonzero(owned).tolist() if g in meta.groups}
        held = native_groups(chains)
        if held and not isinstance(state, RocksStore):
            raise CheckpointError(
                f"checkpoint {meta.id} holds key groups in RocksDB databases; this keyed "
                "stage's state backend is not rocksdb, and cannot restore them"
            )
        shard_chains = {g: c for g, c in chains.items() if c.database is None}
        schema = state.snapshot_groups([]).schema
        # Storage that cannot be reached now is waited for: the job cannot go on without it.
        rows = retrying(
            lambda: read_groups(store, shard_chains, schema), f"restoring from checkpoint {meta.id}"
        )
        state.restore(rows)
        restored = int(rows.num_rows)
        if held:
            assert isinstance(state, RocksStore)
            restored += restore_databases(store, meta, state, held)
        state.clear_changes()
        self.marks_since = meta.id
        self.last_id = meta.id
        self.last_chains = chains
        # The restored database is a new one: none of its files are stored yet.
        self.last_files = {}
        return restored

    def start(
        self,
        barrier: Barrier,
        state: KeyedState,
        owned: np.ndarray,
        watermark: int | None = None,
    ) -> None:
        """Snapshot the owned groups for the barrier's checkpoint, here in the keyed loop, and
        store the snapshot on a thread of its own; `finished` or `wait` give the ack (with
        `error` when the storage failed: the job goes on, and the next checkpoint writes
        everything again), which carries `watermark`, the stage's at the barrier. One upload
        at a time: the caller waits for a running one first."""
        if self._upload is not None:
            raise CheckpointProtocolError(
                f"checkpoint {barrier.id} started while {self._upload.checkpoint}'s upload runs"
            )
        checkpoint = barrier.id
        t0 = time.monotonic()
        groups = np.flatnonzero(owned).tolist()
        complete = barrier.previous is not None and barrier.previous == self.last_id
        future: Future[_Stored] = Future()
        try:
            if isinstance(state, RocksStore):
                store = self._native(checkpoint, state, groups, complete)
            else:
                store = self._shards(checkpoint, state, groups, complete)
        except CheckpointError as exc:
            # The marks may or may not have been cleared: what changed since any checkpoint
            # is not known until the next one.
            self.marks_since = None
            ack = KeyedCheckpointAck(id=checkpoint, error=str(exc), watermark=watermark)
            future.set_result(_Stored(ack))
        else:
            self.marks_since = checkpoint
            stamp = {"snapshot_seconds": time.monotonic() - t0, "watermark": watermark}
            threading.Thread(
                target=_store_in_background,
                args=(future, checkpoint, store, t0, stamp),
                name=f"checkpoint-{checkpoint}-upload",
                daemon=True,  # a stopping instance does not wait for it: the checkpoint fails
            ).start()
        self._upload = _Upload(checkpoint, future)

    def finished(self) -> KeyedCheckpointAck | None:
        """The ack of the checkpoint whose upload has ended since the last call, if any."""
        if self._upload is None or not self._upload.future.done():
            return None
        return self.wait()

    def wait(self) -> KeyedCheckpointAck | None:
        """Wait for the running upload, if any, to end; its ack. What the next checkpoint may
        build on is only updated here, on the keyed loop's thread."""
        upload, self._upload = self._upload, None
        if upload is None:
            return None
        stored = upload.future.result()  # a bug in the upload raises here, in the loop
        if stored.ack.error is not None:
            self.last_id = None
        else:
            self.last_id = upload.checkpoint
            self.last_chains = stored.chains
            self.last_files = stored.files
        return stored.ack

    def _shards(
        self, checkpoint: int, state: KeyedState, groups: list[int], complete: bool
    ) -> Callable[[], _Stored]:
        snapshot = snapshot_groups(
            state, groups, self.last_chains if complete else {}, complete, self.settings.max_chain
        )
        store, writer = self.checkpoint_store(), self.writer

        def upload() -> _Stored:
            written = store_groups(store, checkpoint, writer, snapshot)
            ack = KeyedCheckpointAck(
                id=checkpoint,
                chains=chains_to_json(written.chains),
                written=written.shard.size if written.shard else 0,
                base_groups=written.base_groups,
                delta_groups=written.delta_groups,
            )
            return _Stored(ack, written.chains)

        return upload

    def _native(
        self, checkpoint: int, state: RocksStore, groups: list[int], complete: bool
    ) -> Callable[[], _Stored]:
        local = snapshot_database(state, checkpoint)
        # The checkpoint itself needs no marks (it is the whole database); a hand-over from it
        # needs what changed since.
        state.clear_changes()
        store, writer = self.checkpoint_store(), self.writer
        previous = self.last_files if complete else {}

        def upload() -> _Stored:
            written = upload_database(store, checkpoint, writer, local, previous)
            chains = {g: GroupChain((), writer) for g in groups}
            ack = KeyedCheckpointAck(
                id=checkpoint,
                chains=chains_to_json(chains),
                writer=writer,
                database={name: asdict(f) for name, f in written.files.items()},
                written=written.written,
                reused=written.reused,
                base_groups=len(groups),
            )
            return _Stored(ack, chains, written.files)

        return upload


@dataclass(frozen=True)
class _Stored:
    """What an upload ends with: the ack, and what the next checkpoint may build on."""

    ack: KeyedCheckpointAck
    chains: dict[int, GroupChain] = field(default_factory=dict)
    files: dict[str, ShardFile] = field(default_factory=dict)


@dataclass(frozen=True)
class _Upload:
    checkpoint: int
    future: Future[_Stored]


def _store_in_background(
    future: Future[_Stored],
    checkpoint: int,
    store: Callable[[], _Stored],
    t0: float,
    stamp: dict[str, Any],
) -> None:
    """Run an upload; its ack gets `stamp` (the snapshot's seconds, the watermark) and the
    seconds from the barrier until the upload ended."""
    try:
        stored = store()
    except CheckpointError as exc:
        stored = _Stored(KeyedCheckpointAck(id=checkpoint, error=str(exc)))
    except BaseException as exc:  # a bug: raised again in the keyed loop by `wait`
        future.set_exception(exc)
        return
    update = {**stamp, "seconds": time.monotonic() - t0}
    future.set_result(replace(stored, ack=stored.ack.model_copy(update=update)))
