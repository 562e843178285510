"""The coordinator: one per job. Holds the graph, every keyed stage's assignment and the sink's
partition owners (each by epoch), registers instances, publishes the topology, drives rescales
(keyshift.runtime.rescale, keyshift.runtime.sink_rescale; those asked for while one runs wait in
keyshift.runtime.rescale_queue) and draining, and reports status over gRPC.

Started as a process by a host (`python -m keyshift.runtime.coordinator`); instances and the
host's client talk to it through the JSON control service `keyshift.Coordinator`.
"""

from __future__ import annotations

import argparse
import hmac
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from keyshift.runtime.auth import AuthError, Security
from keyshift.runtime.checkpoint_store import CheckpointError, CheckpointMeta, CheckpointStore
from keyshift.runtime.checkpointing import (
    CheckpointAbandoned,
    CheckpointDriver,
    CheckpointMembers,
    CheckpointOutcome,
    CheckpointStats,
    acked,
    open_store,
)
from keyshift.runtime.identity import Identity, Issuer
from keyshift.runtime.job import (
    MAX_PARALLELISM,
    IngestSource,
    JobError,
    JobSpec,
    load_job,
    local_recovery,
)
from keyshift.runtime.keyspace import Assignment
from keyshift.runtime.lifecycle import allow_user_code, die_with_parent
from keyshift.runtime.local_recovery import LocalRecovery, refusal
from keyshift.runtime.metrics import UNAUTHENTICATED, CoordinatorMetrics
from keyshift.runtime.protocol import (
    CHECKPOINT_ACKS,
    Checkpoint,
    CheckpointComplete,
    Command,
    Drain,
    DrainReply,
    Empty,
    InDone,
    InstanceCall,
    InstanceStatus,
    OutDone,
    PeerUnreachable,
    ProtocolError,
    RegisterReply,
    RegisterRequest,
    Reported,
    ReportRequest,
    RescaleReport,
    RescaleRequest,
    Rescaling,
    Retire,
    Rewind,
    Rewound,
    SourceCheckpointAck,
    StageRole,
    StageStatus,
    StandbyAssignment,
    StandbyRequest,
    StatusReply,
    Stop,
    Topology,
    checkpoint_of,
    handles,
    parse,
)
from keyshift.runtime.rescale import (
    RescaleDriver,
    RescaleError,
    RescaleStatus,
    RescaleTimeout,
    options_for,
)
from keyshift.runtime.rescale_queue import QueueFull, RescaleQueue
from keyshift.runtime.restart_strategy import recorded_failures
from keyshift.runtime.sink_rescale import SinkRescaleDriver
from keyshift.runtime.sink_router import partition_owners
from keyshift.runtime.standbys import StandbyPool
from keyshift.runtime.storage import retrying
from keyshift.runtime.transport import ControlError, PortInUseError, json_handler, start_server

log = logging.getLogger("keyshift.coordinator")
SERVICE = "keyshift.Coordinator"
RESTART_EXIT_CODE = 75  # "start me again with --restore": an instance was lost
CLIENT_CALLS = 16  # calls at once from hosts, the operator, the autoscaler and the CLI


@dataclass
class InstanceRecord:
    stage: str
    index: int
    data_address: str
    metrics_address: str
    pid: int
    identity: Identity
    commands: queue.Queue[Command | None] = field(default_factory=queue.Queue)
    stats: dict[str, Any] = field(default_factory=dict)
    finished: bool = False
    retiring: bool = False
    watching: bool = False
    last_report: float = field(default_factory=time.monotonic)
    lost: bool = False  # taken as lost (died, or silent too long); it is not lost twice

    @property
    def name(self) -> str:
        return f"{self.stage}/{self.index}"


class Coordinator:
    """The job's control state; every method is called from gRPC threads under one lock."""

    def __init__(
        self,
        spec: JobSpec,
        register_timeout: float,
        restore: CheckpointMeta | None = None,
        store: CheckpointStore | None = None,
        secret: bytes | None = None,
        failures_since: float | None = None,
    ) -> None:
        """`store` (a checkpointed job's) keeps the record of recoveries; `restore` is the
        checkpoint this coordinator goes on from, after a crash; `secret` (the job's) is what
        the instances' identities are derived from; `failures_since` (wall clock) when the run
        began, whose recorded failures the restart strategy counts (by default: from this
        start on a fresh one, the whole record on a restore)."""
        self.spec = spec
        self.identities = Issuer(spec.name, secret)
        self.store = store
        self.restored_from = restore.id if restore is not None else None
        self.recoveries: list[dict[str, Any]] = []
        self._recovery_pending = restore is not None and store is not None
        self.restart = False  # set when the job must start again from its checkpoint
        self.gave_up: str | None = None  # why the restart strategy fails the job for good
        self.register_timeout = register_timeout
        self.started = time.time()
        if failures_since is None:
            failures_since = 0.0 if restore is not None else self.started
        self.failures_since = failures_since
        self.incarnation = uuid.uuid4().hex[:12]  # this process; with an id, names a rescale
        self._phase = "starting"
        self.errors: list[str] = []
        # Every keyed stage's key groups' owners, by epoch.
        self.assignments = {
            step.stage.name: Assignment.contiguous(spec.max_key_groups, step.stage.parallelism)
            for step in spec.keyed_stages()
        }
        self.desired = {s.name: s.parallelism for s in spec.stages()}
        # Per sink, which of its instances owns each output partition, by epoch.
        self.partitions = {
            sink.name: partition_owners(sink.output_partitions, sink.parallelism)
            for sink in spec.sinks()
        }
        if restore is not None:
            # The job goes on from the checkpoint: every keyed stage's owners, and so as many
            # instances as it had then (a rescale may have changed them since the job began).
            for name in self.assignments:
                assignment = Assignment.from_json(restore.of_stage(name).assignment)
                self.assignments[name] = assignment
                self.desired[name] = assignment.parallelism
            for sink in self.partitions:
                owners = restore.of_sink(sink).partitions
                if owners:
                    self.partitions[sink] = Assignment.from_json(owners)
                    self.desired[sink] = self.partitions[sink].parallelism
        self.members: dict[str, dict[int, InstanceRecord]] = {s.name: {} for s in spec.stages()}
        # Instances a rescale retired, until one of the same name registers: the topology
        # names them, so that receivers wait for the LEAVE that ends what they sent.
        self.retired: set[str] = set()
        # Local recovery (keyshift.runtime.local_recovery): the generation of the data streams,
        # one more per rewind; the recovery under way; which layout (owners of the keyed
        # stages' groups and of the sinks' partitions) the latest completed checkpoint holds,
        # and the checkpoint in flight: a rewind in place needs the layout unchanged since.
        self.generation = 0
        self._local: LocalRecovery | None = None
        self._layout_in_flight = ""
        self._checkpointed_layout = (restore.id, self._layout()) if restore is not None else None
        self.standbys = StandbyPool([s.stage.name for s in spec.keyed_stages() if s.stage.standby])
        self._drain_requested = False
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._events: list[Reported] = []
        self._abort: str | None = None
        self._lost_keyed: set[int] = set()
        self.lost: list[str] = []  # instances lost and recovered from; their hosts let them go
        self.rescale_status: RescaleStatus | None = None
        self.rescale_queue = RescaleQueue()  # requests waiting for the running one to end
        self.rescale_history: list[RescaleStatus] = []
        self._rescale_ids = 0  # ids in this coordinator process, queued and replaced included
        self._group_rates = GroupRates(spec.max_key_groups)
        self.checkpoints = CheckpointStats()
        self._checkpoint_events: list[Reported] = []
        self._checkpoint_members: CheckpointMembers | None = None
        self.stopped = threading.Event()
        self.metrics = CoordinatorMetrics(spec.name)
        self.metrics.set_phase(self._phase)
        if store is not None:
            try:
                self.recoveries = store.recoveries()
            except CheckpointError as exc:
                log.error("cannot read the record of recoveries: %s", exc)
        last = self.recoveries[-1] if self.recoveries else {}
        self.metrics.recovered(
            len(self.recoveries), last.get("seconds"), last.get("mode") == "local"
        )
        for stage in spec.stages():
            self.metrics.set_parallelism(stage.name, stage.parallelism)

    @property
    def assignment(self) -> Assignment:
        """The first keyed stage's assignment (what a checkpoint records and Status's epoch)."""
        return self.assignments[self.spec.keyed.name]

    def upstream_of(self, stage: str) -> tuple[str, ...]:
        """The stages whose instances send to keyed stage `stage`."""
        return self.spec.keyed_step(stage).inputs

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        self._phase = value
        self.metrics.set_phase(value)

    # -- helpers -------------------------------------------------------------------------

    def _records(self) -> list[InstanceRecord]:
        return [r for stage in self.members.values() for r in stage.values()]

    def _all_registered(self) -> bool:
        return all(set(self.members[name]) >= set(range(n)) for name, n in self.desired.items())

    def _fail(self, message: str) -> None:
        if message not in self.errors:
            log.error("%s", message)
            self.errors.append(message)
            # A host may restart a failed job from its checkpoint (the operator's restart
            # strategy): the recovery is then recorded with this reason and timed from now.
            self._note_failure(message)
        self.phase = "failed"
        self._local = None  # a local recovery under way ends with the job
        self._drop_queued(f"the job failed: {message}")
        for record in self._records():
            record.commands.put(Stop(reason=message))

    def _note_failure(self, message: str, at: float | None = None) -> None:
        """Say in the checkpoint storage (a checkpointed job's) why the job stops, for the
        record of the recovery that may follow (timed from `at`, by default now)."""
        if self.store is None:
            return
        try:
            self.store.note_failure(message, time.time() if at is None else at)
        except CheckpointError as exc:  # the recovery is only timed from later
            log.error("cannot note the failure: %s", exc)

    def _restart_to_recover(self, message: str, failed_at: float | None = None) -> None:
        """Stop every instance and exit with RESTART_EXIT_CODE: the host (the local host, or
        Kubernetes restarting the pods) starts the job again from its latest checkpoint. The
        recovery is timed from `failed_at` (wall clock; by default now)."""
        log.error("%s; restarting the job from its latest checkpoint", message)
        self._note_failure(message, failed_at)
        self.errors.append(message)
        self.phase = "recovering"
        self.restart = True
        # The restarted coordinator knows nothing of them: a recovery drops what waits.
        self._drop_queued("the job restarts from its latest checkpoint")
        for record in self._records():
            record.commands.put(Stop(reason=f"recovering: {message}"))
        self.stopped.set()

    def _topology(self) -> Topology:
        stages = {
            name: {str(i): r.data_address for i, r in sorted(members.items())}
            for name, members in self.members.items()
        }
        assignments = {name: a.to_json() for name, a in self.assignments.items()}
        partitions = {sink: owners.to_json() for sink, owners in self.partitions.items()}
        return Topology(
            stages=stages,
            assignments=assignments,
            partitions=partitions,
            retired=sorted(self.retired),
        )

    def _broadcast_topology(self) -> None:
        topology = self._topology()
        for record in self._records():
            record.commands.put(topology)

    # -- RescaleHost ---------------------------------------------------------------------

    def addresses(self, stage: str) -> dict[int, str]:
        with self._lock:
            return {i: r.data_address for i, r in self.members[stage].items()}

    def sender_count(self, stage: str) -> int:
        with self._lock:
            return self.desired[stage]

    def finished(self, stage: str) -> set[int]:
        with self._lock:
            return {i for i, r in self.members[stage].items() if r.finished}

    def finished_sources(self) -> set[int]:
        """The source ids (`JobSpec.source_id`) of the source instances that have ended."""
        with self._lock:
            return {s for s, r in self._source_records().items() if r.finished}

    def _source_records(self) -> dict[int, InstanceRecord]:
        """Every source instance, of every source, by its source id."""
        return {
            self.spec.source_id(step.stage.name, index): record
            for step in self.spec.source_steps()
            for index, record in self.members[step.stage.name].items()
        }

    def send(self, stage: str, index: int, command: Command) -> None:
        with self._lock:
            self.members[stage][index].commands.put(command)

    def set_desired(self, stage: str, parallelism: int) -> None:
        with self._changed:
            # A scale-out's new instances are standbys first: they only need to register.
            self.standbys.take(stage, range(self.desired[stage], parallelism))
            self.desired[stage] = parallelism
            self._changed.notify_all()

    def broadcast(self, stage: str, command: Command) -> None:
        with self._lock:
            for record in self.members[stage].values():
                record.commands.put(command)

    def commit(self, stage: str, assignment: Assignment) -> None:
        with self._lock:
            self.assignments[stage] = assignment
            self.metrics.set_parallelism(stage, assignment.parallelism)
            self._broadcast_topology()

    def commit_partitions(self, sink: str, owners: Assignment) -> None:
        with self._lock:
            self.partitions[sink] = owners
            self.metrics.set_parallelism(sink, owners.parallelism)
            self._broadcast_topology()

    def retire(self, stage: str, indexes: list[int]) -> None:
        with self._lock:
            for index in indexes:
                record = self.members[stage][index]
                record.retiring = True
                record.commands.put(Retire())
        self.wait_for(
            lambda _events: not any(i in self.members[stage] for i in indexes),
            30.0,
            f"instances {indexes} of {stage} to retire",
        )

    def wait_for(
        self, predicate: Callable[[list[Reported]], bool], timeout: float, what: str
    ) -> None:
        deadline = time.monotonic() + timeout
        with self._changed:
            while not predicate(self._events):
                if self._abort:
                    abort, self._abort = self._abort, None
                    raise RescaleError(f"{abort} while waiting for {what}")
                if self.stopped.is_set():
                    # Nothing a stopping coordinator waits for comes: the rescale ends now, not
                    # at its timeout (and in a process that hosts it, its thread with it).
                    raise RescaleError(f"the job is stopping, while waiting for {what}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RescaleTimeout(f"timed out after {timeout:.0f} s waiting for {what}")
                self._changed.wait(min(remaining, 0.5))

    # -- RPCs ----------------------------------------------------------------------------

    def register(self, request: RegisterRequest) -> RegisterReply:
        with self._changed:
            stage, index = request.stage, request.index
            if stage not in self.desired or not 0 <= index < self.desired[stage]:
                raise ControlError(
                    f"no instance {stage}/{index} in job {self.spec.name}",
                    grpc.StatusCode.NOT_FOUND,
                )
            if index in self.members[stage]:
                raise ControlError(f"instance {stage}/{index} is already registered")
            if self._local is not None and f"{stage}/{index}" in self._local.replacing:
                # A lost instance's replacement restores the checkpoint the others rewind to,
                # once it is picked (after the checkpoint in flight ends).
                while self._local is not None and self._local.checkpoint is None:
                    self._changed.wait(0.1)
                if self._local is None:
                    raise ControlError("the local recovery failed; the job restarts")
            elif self.phase not in ("starting", "running"):
                raise ControlError(f"job is {self.phase}; registration closed")
            record = InstanceRecord(
                stage=stage,
                index=index,
                data_address=request.data_address,
                metrics_address=request.metrics_address,
                pid=request.pid,
                identity=self.identities.issue(f"{stage}/{index}"),
            )
            self.members[stage][index] = record
            self.retired.discard(record.name)
            self.standbys.registered(stage, index)
            log.info("registered %s at %s", record.name, record.data_address)
            if self.phase == "starting" and self._all_registered():
                self.phase = "running"
                self._broadcast_topology()
                if self._drain_requested:
                    self._start_draining()
            elif self.phase == "running":
                self._broadcast_topology()
                if self.rescale_status is not None:
                    record.commands.put(Rescaling(active=True))
            self._changed.notify_all()
            return RegisterReply(
                job=self.spec.model_dump(mode="json"),
                restore=self.restored_from,
                identity=record.identity.to_json(),
                generation=self.generation,
            )

    def standby(self, body: dict[str, Any], context: grpc.ServicerContext) -> Any:
        """A standby's stream: held open while it waits; its one message is the index a
        scale-out gave it. It ends without one when the job stops running."""
        try:
            request = parse(StandbyRequest, body)
        except ProtocolError as exc:
            raise ControlError(str(exc), grpc.StatusCode.INVALID_ARGUMENT) from None
        with self._changed:
            if request.stage not in self.standbys.waiting:
                raise ControlError(
                    f"stage {request.stage!r} of job {self.spec.name} keeps no standbys",
                    grpc.StatusCode.NOT_FOUND,
                )
            standby = self.standbys.offer(
                request.stage, request.pid, request.index, self.desired[request.stage]
            )
            log.info("standby of %s waiting (pid %d)", request.stage, request.pid)
            while (
                standby.index is None
                and context.is_active()
                and (self.phase in ("starting", "running") or self._local is not None)
            ):
                self._changed.wait(0.5)
            index = standby.index
            if index is None:
                self.standbys.leave(standby)
        if index is not None:
            yield StandbyAssignment(index=index).wire()

    def watch(self, body: dict[str, Any], context: grpc.ServicerContext) -> Any:
        try:
            call = parse(InstanceCall, body)
        except ProtocolError as exc:
            raise ControlError(str(exc), grpc.StatusCode.INVALID_ARGUMENT) from None
        with self._lock:
            record = self.members.get(call.stage, {}).get(call.index)
            if record is None:
                raise ControlError("watch before register", grpc.StatusCode.FAILED_PRECONDITION)
            self._check_identity(record, call)
            record.watching = True
        try:
            while context.is_active():
                try:
                    command = record.commands.get(timeout=0.5)
                except queue.Empty:
                    continue
                if command is None:
                    return
                yield command.wire()
        finally:
            self._lost(record)

    def _check_identity(self, record: InstanceRecord, call: InstanceCall) -> None:
        """Refuse a call that does not carry the identity `record`'s registrant was issued."""
        presented = Identity.from_json(call.identity)
        if presented is None or not hmac.compare_digest(
            presented.credential, record.identity.credential
        ):
            UNAUTHENTICATED.refused(SERVICE)
            log.warning("refused a call in the name of %s: not its identity", record.name)
            raise ControlError(
                f"not the identity issued to instance {record.name}",
                grpc.StatusCode.UNAUTHENTICATED,
            )

    def sink_latencies(self) -> list[tuple[float, float]]:
        """Every sink's instances' recent (emitted at, worst latency) samples, from their
        reports."""
        with self._lock:
            return [
                (float(at), float(latency))
                for sink in self.partitions
                for record in self.members[sink].values()
                for at, latency in record.stats.get("latency_recent", [])
            ]

    def lost_keyed(self) -> set[int]:
        with self._lock:
            return set(self._lost_keyed)

    @property
    def checkpointed(self) -> bool:
        return self.spec.checkpoints is not None

    def latest_checkpoint(self) -> int | None:
        with self._lock:
            last = self.checkpoints.last_completed
            return last.id if last is not None else self.restored_from

    def _lost(
        self, record: InstanceRecord, why: str = "its process died or stopped answering"
    ) -> None:
        with self._changed:
            record.watching = False
            if record.lost:
                return
            if record.retiring and record.finished:
                del self.members[record.stage][record.index]
                self.retired.add(record.name)
                self._broadcast_topology()
            elif (
                self.rescale_status is not None
                and record.stage == self.rescale_status.stage
                and record.stage in self.assignments  # a sink instance's output has no copy
                and not record.finished
                and self.phase == "running"
                # With checkpoints, the host restarts the job from the last one instead: going
                # on without the lost instance's state would lose it.
                and self.spec.checkpoints is None
            ):
                # Mid-rescale, the driver recovers: the job goes on with the survivors.
                message = (
                    f"instance {record.name} (pid {record.pid}) was lost during rescale "
                    f"{self.rescale_status.id}: {why}"
                )
                record.lost = True
                log.error("%s", message)
                self.errors.append(message)
                self.lost.append(record.name)
                self._lost_keyed.add(record.index)
                del self.members[record.stage][record.index]
                self._abort = message
            elif self._local is not None and self.phase == "recovering":
                record.lost = True
                self._local_failed(
                    self._local, f"instance {record.name} (pid {record.pid}) was lost too: {why}"
                )
            elif not record.finished and self.phase not in ("failed", "stopping", "recovering"):
                message = f"instance {record.name} (pid {record.pid}) was lost: {why}"
                record.lost = True
                if self.spec.checkpoints is None:
                    self._fail(message)
                elif (refused := self._local_refusal(record)) is not None:
                    if local_recovery(self.spec):
                        log.warning("not recovered locally: %s", refused)
                    self._restart_to_recover(message)
                else:
                    self._start_local_recovery(record, message)
                self._abort = message
            self._changed.notify_all()

    # -- local recovery (keyshift.runtime.local_recovery) ----------------------------------

    def _layout(self) -> str:
        """Who owns what: every keyed stage's assignment and every sink's partition owners."""
        return json.dumps(self._topology().model_dump(include={"assignments", "partitions"}),
                          sort_keys=True)  # fmt: skip

    def _local_refusal(self, lost: InstanceRecord) -> str | None:
        """Why `lost` is not recovered locally, if it is not (called with the lock held)."""
        return refusal(
            enabled=local_recovery(self.spec),
            keyed=lost.stage in self.assignments,
            phase=self.phase,
            rescaling=self.rescale_status is not None,
            draining=self._drain_requested,
            finished=any(r.finished for r in self._records()),
            ingest=any(
                isinstance(step.stage.config, IngestSource) for step in self.spec.source_steps()
            ),
        )

    def _start_local_recovery(self, lost: InstanceRecord, message: str) -> None:
        """Replace `lost` alone and rewind every other instance in place, on a thread of its
        own, after the restart strategy's delay; or fail the job for good when the strategy
        gives up (called with the lock held)."""
        decision = self.spec.restart.decide(
            recorded_failures(self.recoveries, self.failures_since), time.time()
        )
        if decision.delay is None:
            log.error("%s; not restarted again: %s", message, decision.why)
            self.gave_up = decision.why  # the hosts say it with the error
            self._fail(message)
            return
        log.error(
            "%s; replacing it in %.1f s (%s) and rewinding the others to the latest checkpoint",
            message, decision.delay, decision.why,
        )  # fmt: skip
        self._note_failure(message)
        del self.members[lost.stage][lost.index]
        self.lost.append(lost.name)
        # A waiting standby replaces it, started already (else the host starts a process).
        self.standbys.take(lost.stage, range(lost.index, lost.index + 1))
        self.generation += 1
        recovery = LocalRecovery(
            generation=self.generation,
            reason=message,
            replacing={lost.name: lost.pid},
            survivors={r.name for r in self._records()},
            delay=decision.delay,
        )
        self._local = recovery
        self.phase = "recovering"
        threading.Thread(
            target=self._recover_locally, args=(recovery,), name="local-recovery", daemon=True
        ).start()

    def _local_failed(self, recovery: LocalRecovery, why: str) -> None:
        """Fall back to the global restart, timed from the first loss (lock held)."""
        if self._local is not recovery:
            return  # it ended already
        self._local = None
        self.phase = "running"  # what the global restart starts from
        self._restart_to_recover(
            f"{recovery.reason}\n  and the local recovery failed: {why}", recovery.failed_at
        )

    def _recover_locally(self, recovery: LocalRecovery) -> None:
        with self._changed:
            # A checkpoint in flight ends first (abandoned: the job does not run): the rewind
            # goes to the latest one that completed, and none completes after it.
            while self._checkpoint_members is not None:
                if self._local is not recovery:
                    return
                if time.monotonic() > recovery.deadline:
                    self._local_failed(recovery, "the checkpoint in flight did not end")
                    return
                self._changed.wait(0.1)
            if self._local is not recovery:
                return
            checkpoint = self.latest_checkpoint()
            if checkpoint is None:
                self._local_failed(recovery, "no checkpoint has completed yet")
                return
            if self._checkpointed_layout != (checkpoint, self._layout()):
                self._local_failed(
                    recovery, f"the stages were rescaled since checkpoint {checkpoint}"
                )
                return
            recovery.checkpoint = checkpoint
            self.restored_from = checkpoint  # what the replacements restore
            rewind = Rewind(generation=recovery.generation, checkpoint=checkpoint)
            for record in self._records():
                record.commands.put(rewind)
            self._changed.notify_all()
            while not recovery.complete({r.name for r in self._records()}, time.monotonic()):
                if self._local is not recovery:
                    return
                if time.monotonic() > recovery.deadline:
                    missing = sorted(recovery.survivors - recovery.rewound)
                    self._local_failed(
                        recovery,
                        f"timed out: not rewound {missing}, or the replacement not registered",
                    )
                    return
                self._changed.wait(0.1)
            self._local = None
            self.phase = "running"
            self._broadcast_topology()
            if self._drain_requested:
                self._start_draining()
            self._changed.notify_all()
        self._record_recovery(checkpoint, recovery.failed_at, "local")

    def _peer_unreachable(self, reporter: InstanceRecord, event: PeerUnreachable) -> None:
        """A keyed instance could not reach its peer: the peer is lost, and that is the reason
        recorded (a dead process is mostly noticed first by its command stream breaking; this
        is the same loss noticed by a peer, never a failure of the one that noticed it)."""
        peer = self.members[reporter.stage].get(event.peer)
        if peer is None or peer is reporter:
            return  # lost and let go already, or retired
        self._lost(peer, f"{reporter.name} could not reach it: {event.error}")
        peer.commands.put(None)  # ends its command stream, should it still be open

    def report(self, request: ReportRequest) -> Empty:
        with self._changed:
            record = self.members.get(request.stage, {}).get(request.index)
            if record is None:
                raise ControlError("report before register", grpc.StatusCode.FAILED_PRECONDITION)
            self._check_identity(record, request)
            # A periodic report gathered before the loop ended may arrive after the finished
            # one: the finished report's stats are final (what the sources emitted, say).
            if request.finished or not record.finished:
                record.stats = dict(request.stats)
            record.last_report = time.monotonic()
            if request.metrics_address:
                record.metrics_address = request.metrics_address
            if request.group_hits is not None:
                self._group_rates.update(
                    record.stage, record.name, request.group_hits, time.monotonic()
                )
            for event in request.events:
                reported = Reported(record.stage, record.index, event)
                if isinstance(event, PeerUnreachable):
                    self._peer_unreachable(record, event)
                elif isinstance(event, Rewound):
                    if self._local is not None and event.generation == self._local.generation:
                        self._local.rewound.add(record.name)
                elif isinstance(event, CHECKPOINT_ACKS):
                    self._checkpoint_events.append(reported)
                else:
                    self._events.append(reported)
            if request.error:
                self._fail(f"instance {record.name} failed: {request.error}")
            if request.finished:
                record.finished = True
                active = [r for r in self._records() if not r.retiring]
                if self._all_registered() and all(r.finished for r in active):
                    self.phase = "finished"
            self._changed.notify_all()
            return Empty()

    def _start_draining(self) -> None:
        self.phase = "draining"
        for record in self._source_records().values():
            record.commands.put(Drain())

    def drain(self, request: Empty) -> DrainReply:
        """Stop the sources; the rest of the job finishes what is in flight, then ends."""
        with self._lock:
            if self.phase == "running" and self.rescale_status is None:
                self._start_draining()
            elif self.phase in ("starting", "running") or self._local is not None:
                # Honoured once every instance is registered, the running rescale has
                # finished and a local recovery has ended; the rescales waiting behind it
                # would only delay the end.
                self._drain_requested = True
                self._drop_queued("the job was asked to drain")
            return DrainReply(phase=self.phase)

    def rescale(self, request: RescaleRequest) -> RescaleReport:
        """Start a rescale of a keyed stage or of a sink, or queue it while another stage
        moves (keyshift.runtime.rescale_queue); a request for the stage that moves now is
        refused."""
        with self._lock:
            stage = request.stage
            sink = self.spec.sink_stage(stage) if stage in self.partitions else None
            if stage not in self.assignments and sink is None:
                raise ControlError(*self._not_rescalable(stage))
            parallelism = request.parallelism
            if sink is not None:
                most = sink.output_partitions
                bound = f"the sink writes {most} output partitions (its `partitions`)"
            else:
                most = min(self.spec.max_key_groups, MAX_PARALLELISM)
                bound = (
                    f"the maximum parallelism is {MAX_PARALLELISM}, and a stage cannot have more "
                    f"instances than its max_key_groups, {self.spec.max_key_groups}"
                )
            if not 1 <= parallelism <= most:
                raise ControlError(
                    f"parallelism of stage {stage!r} must be an integer from 1 to {most} "
                    f"({bound}), got {parallelism!r}",
                    grpc.StatusCode.INVALID_ARGUMENT,
                )
            if sink is not None and request.options:
                raise ControlError(
                    f"options {sorted(request.options)} do not apply to the sink: it has no state "
                    "to move, only whole output partitions",
                    grpc.StatusCode.INVALID_ARGUMENT,
                )
            strategy = request.strategy
            try:
                options = options_for(strategy, request.options)
            except RescaleError as exc:
                raise ControlError(str(exc), grpc.StatusCode.INVALID_ARGUMENT) from None
            problem = self._cannot_rescale()
            if problem is not None:
                raise ControlError(problem)
            running = self.rescale_status
            if running is not None and running.stage == stage:
                # Queued, it would be planned from a parallelism the running move may still
                # change (a failed scale-out recovers at another width).
                raise ControlError(
                    f"rescale {running.id} of stage {stage} is still running ({running.phase}); "
                    "a request for the stage that moves is refused, not queued: ask again "
                    "when it ends"
                )
            if running is None:
                self._wait_for_checkpoint()  # before an id is given: it may refuse
            self._rescale_ids += 1
            status = RescaleStatus(
                incarnation=self.incarnation,
                id=self._rescale_ids,
                stage=stage,
                from_parallelism=self.desired[stage],
                to_parallelism=parallelism,
                strategy=strategy,
                options=options,
            )
            if running is None:
                self._start_rescale(status)
                return status.report()
            try:
                replaced = self.rescale_queue.put(status)
            except QueueFull as exc:
                self._rescale_ids -= 1
                raise ControlError(str(exc), grpc.StatusCode.RESOURCE_EXHAUSTED) from None
            if replaced is not None:
                status.replaced = replaced.id
                self._ended(replaced)
            log.info(
                "rescale %d of %s queued behind rescale %d of %s",
                status.id, stage, running.id, running.stage,
            )  # fmt: skip
            return status.report()

    def _cannot_rescale(self) -> str | None:
        """Why the job cannot start a rescale now, if it cannot."""
        if self._drain_requested:
            return f"job {self.spec.name} is draining; a rescale needs a running job"
        if self.phase != "running":
            return f"job is {self.phase}; a rescale needs a running job"
        ended = [self.spec.source_instance(s) for s in sorted(self.finished_sources())]
        if ended:
            names = ", ".join(f"{stage}-{index}" for stage, index in ended)
            return f"sources {names} of job {self.spec.name} have ended; the job is finishing"
        return None

    def _start_rescale(self, status: RescaleStatus) -> None:
        """Run `status`'s rescale on a thread of its own (called with the lock held)."""
        self._wait_for_checkpoint()
        stage = status.stage
        # A queued one starts from the width its stage has now, and is timed from now.
        status.from_parallelism = self.desired[stage]
        status.started = time.time()
        status.phase = "requested"
        self.rescale_status = status
        self._events.clear()
        self._abort = None
        self._lost_keyed = set()
        driver: RescaleDriver
        if stage in self.partitions:
            driver = SinkRescaleDriver(
                self, status, stage, self.spec.sink_inputs(stage), self.partitions[stage]
            )
        else:
            driver = RescaleDriver(
                self, status, stage, self.upstream_of(stage), self.assignments[stage],
                self._group_rates.rates(stage),
            )  # fmt: skip
        self.metrics.rescale_started(stage)
        threading.Thread(target=self._run_rescale, args=(driver,), daemon=True).start()

    def _start_queued(self) -> None:
        """Start the first queued rescale that still can (called with the lock held, when none
        runs): one that cannot any more ends failed, with the reason."""
        while self.rescale_status is None and (status := self.rescale_queue.pop()) is not None:
            problem = self._cannot_rescale()
            if problem is None:
                try:
                    self._start_rescale(status)
                    continue
                except ControlError as exc:
                    problem = str(exc)
            status.phase = "failed"
            status.error = f"not started: {problem}"
            status.finished = time.time()
            self._ended(status)

    def _drop_queued(self, reason: str) -> None:
        for status in self.rescale_queue.drop(reason):
            self._ended(status)

    def _ended(self, status: RescaleStatus) -> None:
        """Record a rescale that ended without running (replaced, dropped, not startable)."""
        log.warning("rescale %d of %s %s: %s", status.id, status.stage, status.phase, status.error)
        self.metrics.rescale_finished(status.stage, status.strategy, status.phase)
        self.rescale_history.append(status)

    def _not_rescalable(self, stage: str) -> tuple[str, grpc.StatusCode]:
        """Why `stage` is not rescaled live: a source, a stateless stage, or no such stage."""
        refused = grpc.StatusCode.INVALID_ARGUMENT
        if stage in {step.stage.name for step in self.spec.source_steps()}:
            return (
                f"stage {stage!r} is a source: its parallelism is bounded by its partitions and "
                "set when the job starts; only the keyed stages and the sinks are rescaled live",
                refused,
            )
        graph = self.spec.dataflow()
        node = next((n for n in graph.nodes if n.name == stage), None)
        if node is None:
            return f"job {self.spec.name} has no stage {stage!r}", grpc.StatusCode.NOT_FOUND
        runner = graph.runner_of(stage)
        return (
            f"stage {stage!r} is a stateless {node.role} chained into the processes of stage "
            f"{runner.name!r}: it runs at {runner.name!r}'s parallelism, so rescale "
            f"{runner.name!r} instead",
            refused,
        )

    def _wait_for_checkpoint(self) -> None:
        """A rescale waits for the checkpoint in flight: the two never overlap (called with
        the lock held; the checkpoint ends by its own timeout at the latest)."""
        settings = self.spec.checkpoints
        deadline = time.monotonic() + (settings.timeout + 5.0 if settings else 0.0)
        while self._checkpoint_members is not None:
            if time.monotonic() > deadline:
                raise ControlError("a checkpoint is still being taken; try again")
            self._changed.wait(0.2)

    # -- CheckpointHost --------------------------------------------------------------------

    def checkpoint_members(self) -> CheckpointMembers | None:
        with self._lock:
            if self.phase != "running" or self._drain_requested or self.rescale_status:
                return None
            members = CheckpointMembers(
                sources={s for s, r in self._source_records().items() if not r.finished},
                keyed={name: set(self.members[name]) for name in self.assignments},
                sinks={sink: set(self.members[sink]) for sink in self.partitions},
            )
            if not members.sources:
                return None  # the sources are done: nothing will move past a barrier
            self._checkpoint_members = members
            self._layout_in_flight = self._layout()
            self._checkpoint_events.clear()
            return members

    def checkpoint_send(self, source: int, command: Checkpoint) -> None:
        with self._lock:
            self.checkpoints.in_flight = command.id
            self._source_records()[source].commands.put(command)

    def checkpoint_assignments(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {name: a.to_json() for name, a in self.assignments.items()}

    def checkpoint_partitions(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {sink: owners.to_json() for sink, owners in self.partitions.items()}

    def checkpoint_events(self, checkpoint: int, timeout: float) -> list[Reported] | None:
        deadline = time.monotonic() + timeout
        with self._changed:
            members = self._checkpoint_members
            assert members is not None
            while True:
                if self.phase not in ("running", "draining"):
                    raise CheckpointAbandoned(f"the job is {self.phase}")
                # A source that ended before it saw the command sends no barrier: its END
                # ends the alignment downstream, and all it emitted is in the checkpoint.
                ended = self._ended_source_positions()
                waiting = replace(members, sources=members.sources - set(ended))
                if acked(self._checkpoint_events, checkpoint, waiting):
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._changed.wait(min(remaining, 0.5))
            events = [r for r in self._checkpoint_events if checkpoint_of(r) == checkpoint]
            positioned = {
                r.event.source for r in events if isinstance(r.event, SourceCheckpointAck)
            }
            for source, position in ended.items():
                if source not in positioned:
                    ack = SourceCheckpointAck(id=checkpoint, source=source, position=position)
                    events.append(Reported(*self.spec.source_instance(source), ack))
            return events

    def _ended_source_positions(self) -> dict[int, int]:
        """The final positions of the source instances that have ended, by source id (a
        recovery must not replay them from the start)."""
        return {
            s: int(r.stats["emitted"])
            for s, r in self._source_records().items()
            if r.finished and "emitted" in r.stats
        }

    def checkpoint_completed(self, meta: CheckpointMeta) -> None:
        command = CheckpointComplete(
            id=meta.id,
            sources={k: int(v) for k, v in meta.sources.items()},
            outputs={sink: meta.of_sink(sink).outputs for sink in self.partitions},
        )
        with self._lock:
            for record in [
                *self._source_records().values(),
                *(r for sink in self.partitions for r in self.members[sink].values()),
            ]:
                record.commands.put(command)

    def checkpoint_ended(self, outcome: CheckpointOutcome) -> None:
        with self._changed:
            stats = self.checkpoints
            stats.in_flight = None
            self._checkpoint_members = None
            self._changed.notify_all()
            if outcome.abandoned:
                return
            stats.last = outcome
            if outcome.ok:
                self._checkpointed_layout = (outcome.id, self._layout_in_flight)
                stats.completed += 1
                stats.failures_in_a_row = 0
                stats.last_completed = outcome
            else:
                stats.failed += 1
                stats.failures_in_a_row += 1
            settings = self.spec.checkpoints
            stats.degraded = bool(settings) and stats.failures_in_a_row >= (
                settings.degraded_after if settings else 0
            )
            self.metrics.checkpoint_ended(outcome)

    def storage_failures(self) -> list[str]:
        with self._lock:
            return [
                f"{r.name}: {r.stats['storage_error']}"
                for r in self._records()
                if r.stats.get("storage_error")
            ]

    def _run_rescale(self, driver: RescaleDriver) -> None:
        driver.run()
        with self._lock:
            driver.status.progress = self._progress(live=False)
            status = driver.status
            self.metrics.rescale_finished(status.stage, status.strategy, status.phase)
            if status.handover is not None:
                handover = status.handover.report(status.progress)
                self.metrics.handover_finished(
                    status.stage, handover.preloaded_bytes, handover.switch_bytes,
                    status.handover.cause,
                )  # fmt: skip
            self.rescale_history.append(driver.status)
            self.rescale_status = None
            self._start_queued()
            if self.rescale_status is None and self._drain_requested and self.phase == "running":
                self._start_draining()

    def _progress(self, live: bool = True) -> dict[str, float]:
        """The rescale's counters: finished moves (their done events) plus running ones."""
        totals: Counter[str] = Counter()
        for reported in self._events:
            if isinstance(reported.event, OutDone | InDone):
                totals.update(reported.event.stats)
        moving = self.rescale_status.stage if live and self.rescale_status else None
        for record in self.members[moving].values() if moving else ():
            totals.update(record.stats.get("migration", {}))
        return {k: float(v) for k, v in totals.items()}

    def status(self, request: Empty) -> StatusReply:
        roles: dict[str, StageRole] = {
            **{step.stage.name: "source" for step in self.spec.source_steps()},
            **{sink.name: "sink" for sink in self.spec.sinks()},
        }
        with self._lock:
            stages = []
            for stage in self.spec.stages():
                role = roles.get(stage.name, "keyed")
                instances = [
                    InstanceStatus(
                        index=i,
                        address=r.data_address,
                        metrics=r.metrics_address,
                        pid=r.pid,
                        finished=r.finished,
                        retiring=r.retiring,
                        stats=r.stats,
                    )
                    for i, r in sorted(self.members[stage.name].items())
                ]
                stages.append(
                    StageStatus(
                        name=stage.name,
                        role=role,
                        parallelism=len(instances),
                        desired=self.desired[stage.name],
                        instances=instances,
                        standbys=self.standbys.status(stage.name),
                    )
                )
            rescale = None
            if self.rescale_status is not None:
                self.rescale_status.progress = self._progress()
                rescale = self.rescale_status.report()
            return StatusReply(
                job=self.spec.name,
                incarnation=self.incarnation,
                phase=self.phase,
                errors=list(self.errors),
                epoch=self.assignment.epoch,
                uptime=time.time() - self.started,
                stages=stages,
                rescale=rescale,
                queued=[r.report() for r in self.rescale_queue.waiting()],
                lost=list(self.lost),
                replacing=self._replacing(),
                rescales=[r.report() for r in self.rescale_history[-20:]],
                checkpoints=self.checkpoints.to_json() if self.spec.checkpoints else None,
                restored_from=self.restored_from,
                recoveries={
                    "total": len(self.recoveries),
                    "last": self.recoveries[-1] if self.recoveries else None,
                },
                gave_up=self.gave_up,
            )

    def _replacing(self) -> dict[str, int]:
        """The instances the hosts are to start again: once the local recovery's delay has
        passed (lock held)."""
        local = self._local
        if local is None or time.monotonic() < local.due:
            return {}
        return dict(local.replacing)

    def shutdown(self, request: Empty) -> Empty:
        with self._changed:
            if self.phase not in ("failed", "finished"):
                self.phase = "stopping"
            self._drop_queued("the job was shut down")
            for record in self._records():
                record.commands.put(Stop(reason="shutdown"))
                record.commands.put(None)
            self.stopped.set()
            self._changed.notify_all()
        return Empty()

    def record_recovery(self) -> None:
        """Once a restored job runs again, add its recovery to the record (called from the
        main loop: storage I/O stays off the RPC threads)."""
        with self._lock:
            if not self._recovery_pending or self.phase != "running":
                return
            self._recovery_pending = False
        if self.restored_from is not None:  # pending only with a checkpoint and a store
            self._record_recovery(self.restored_from, self.started, "global")

    def _record_recovery(self, checkpoint: int, started: float, mode: str) -> None:
        """Add a recovery (`mode`: local or global) from `checkpoint` to the record, timed
        from the failure noted (else from `started`), now that the job runs again."""
        store = self.store
        if store is None:
            return
        try:
            entry = store.record_recovery(checkpoint, started, time.time(), mode)
        except CheckpointError as exc:
            log.error("cannot record the recovery: %s", exc)
            return
        log.info("recovered (%s) from checkpoint %d in %.2f s", mode, checkpoint, entry["seconds"])
        with self._lock:
            self.recoveries.append(entry)
            self.metrics.recovered(len(self.recoveries), entry["seconds"], mode == "local")

    def check_heartbeats(self) -> None:
        """Take an instance that has not reported for `heartbeat_timeout` as lost: a hung
        process, or one on a node that is gone, whose command stream may look open for long."""
        timeout = self.spec.heartbeat_timeout
        with self._lock:
            if self.phase not in ("running", "draining"):
                return
            now = time.monotonic()
            silent = [
                r
                for r in self._records()
                if not (r.finished or r.lost) and now - r.last_report > timeout
            ]
        for record in silent:
            self._lost(record, f"it sent no report for {timeout:g} s (hung, or its node is gone)")
            record.commands.put(None)  # ends its command stream, should it still be open

    def check_registration(self) -> None:
        with self._lock:
            if self.phase != "starting":
                return
            if time.time() - self.started < self.register_timeout:
                return
            missing = [
                f"{name}/{i}"
                for name, n in self.desired.items()
                for i in range(n)
                if i not in self.members[name]
            ]
            self._fail(
                f"instances {', '.join(missing)} did not register within "
                f"{self.register_timeout:.0f} s"
            )

    def handler(self) -> grpc.GenericRpcHandler[Any, Any]:
        return json_handler(
            SERVICE,
            {
                "Register": handles(RegisterRequest, self.register),
                "Report": handles(ReportRequest, self.report),
                "Drain": handles(Empty, self.drain),
                "Rescale": handles(RescaleRequest, self.rescale),
                "Status": handles(Empty, self.status),
                "Shutdown": handles(Empty, self.shutdown),
            },
            {"Watch": self.watch, "Standby": self.standby},
        )


class GroupRates:
    """Per-group record rates of each keyed stage, from its instances' cumulative hit counts."""

    def __init__(self, groups: int) -> None:
        self.groups = groups
        self._last: dict[str, tuple[float, np.ndarray]] = {}
        self._rates: dict[str, dict[str, np.ndarray]] = {}

    def update(self, stage: str, instance: str, sparse: dict[str, int], now: float) -> None:
        hits = np.zeros(self.groups, dtype=np.float64)
        if sparse:
            hits[np.fromiter((int(g) for g in sparse), dtype=np.int64)] = list(sparse.values())
        previous = self._last.get(instance)
        if previous is not None and now > previous[0]:
            rates = np.maximum(hits - previous[1], 0) / (now - previous[0])
            self._rates.setdefault(stage, {})[instance] = rates
        self._last[instance] = (now, hits)

    def rates(self, stage: str) -> np.ndarray:
        """Recent records/s per group of `stage` (groups that moved count where they are now)."""
        total = np.zeros(self.groups)
        for rates in self._rates.get(stage, {}).values():
            total += rates
        return total


def max_calls(spec: JobSpec) -> int:
    """The most calls the coordinator serves at once: per instance its command stream and two
    reports (the periodic one and a protocol step's), with each keyed stage at the most a
    rescale may take it to (the sink: its partitions); a stream per standby; and a few for the
    hosts' and the CLI's calls."""
    keyed = len(spec.keyed_stages())
    sinks = sum(sink.output_partitions for sink in spec.sinks())
    standbys = sum(step.stage.standby for step in spec.keyed_stages())
    sources = sum(step.stage.parallelism for step in spec.source_steps())
    instances = sources + sinks + keyed * MAX_PARALLELISM + standbys
    return 3 * instances + CLIENT_CALLS


def _write_ready(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _restore_point(store: CheckpointStore) -> tuple[CheckpointMeta | None, int]:
    """The latest valid checkpoint (the newer, corrupt ones discarded) and the next id."""
    next_checkpoint = max(store.completed(), default=0) + 1
    restore = store.latest_valid()
    if restore is not None:
        store.discard_after(restore.id)
    return restore, next_checkpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="keyshift-coordinator")
    parser.add_argument("--job", required=True, help="job YAML file")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--metrics-port", type=int, default=0)
    parser.add_argument("--ready-file", type=Path, help="where to write the bound ports as JSON")
    parser.add_argument("--register-timeout", type=float, default=30.0)
    parser.add_argument(
        "--failures-since",
        type=float,
        help="when the run began (seconds since the epoch): the restart strategy counts the "
        "recorded failures from then",
    )
    parser.add_argument(
        "--restore",
        action="store_true",
        help="go on from the job's latest valid checkpoint (after a crash), if there is one",
    )
    args = parser.parse_args(argv)
    die_with_parent()
    allow_user_code()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        spec = load_job(args.job)
        security = Security.from_env()
    except (JobError, AuthError) as exc:
        print(exc, file=sys.stderr)
        return 2
    restore = None
    store = None
    next_checkpoint: int | None = 1
    if spec.checkpoints is not None:
        try:
            store = open_store(spec.checkpoints)
            if args.restore:
                # Going on without the checkpoint would repeat or lose records: storage that
                # cannot be reached now is waited for, and an error of any other kind ends it.
                restore, next_checkpoint = retrying(
                    partial(_restore_point, store), "reading the checkpoints to restore from"
                )
            else:
                next_checkpoint = max(store.completed(), default=0) + 1
        except CheckpointError as exc:
            if args.restore:
                print(f"coordinator: cannot read checkpoints: {exc}", file=sys.stderr)
                return 1
            # A fresh start runs without checkpoint storage: each checkpoint fails visibly
            # (numbered once the storage can list the ones taken before).
            log.error("checkpoint storage is unusable (%s); the job runs, checkpoints fail", exc)
            next_checkpoint = None
        if args.restore:
            log.info("restoring from checkpoint %s", restore.id if restore else "(none)")
    coordinator = Coordinator(
        spec, args.register_timeout, restore, store, security.secret, args.failures_since
    )
    try:
        server, port = start_server(
            f"{args.host}:{args.port}",
            [coordinator.handler()],
            max_calls=max_calls(spec),
            security=security,
        )
        metrics_port = coordinator.metrics.serve(args.host, args.metrics_port)
    except (PortInUseError, OSError, AuthError) as exc:
        print(f"coordinator: {exc}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: coordinator.stopped.set())
    log.info("coordinator of job %s listening on %s:%d", spec.name, args.host, port)
    if args.ready_file:
        _write_ready(
            args.ready_file, {"port": port, "metrics_port": metrics_port, "pid": os.getpid()}
        )
    if spec.checkpoints is not None:
        driver = CheckpointDriver(
            coordinator,
            spec.checkpoints,
            open_store(spec.checkpoints),
            spec.keyed.name,
            coordinator.stopped,
            last_completed=restore.id if restore is not None else None,
            next_id=next_checkpoint,
        )
        threading.Thread(target=driver.run, name="checkpoints", daemon=True).start()
    while not coordinator.stopped.wait(0.2):
        coordinator.check_registration()
        coordinator.check_heartbeats()
        coordinator.record_recovery()
    if coordinator.restart:
        time.sleep(0.5)  # let the instances' command streams carry the stop
    server.stop(grace=1.0)
    return RESTART_EXIT_CODE if coordinator.restart else 0


if __name__ == "__main__":
    sys.exit(main())
