"""The coordinator's side of checkpoints and recoveries (keyshift.runtime.checkpointing's
CheckpointDriver with keyshift.runtime.coordinator's Coordinator), in this process: the
instances are played by calls to the coordinator's Register and Report, the checkpoints go to
a real store in a temporary directory.

A source that has ended is in every later checkpoint at its final position (a recovery must
not replay it); a checkpoint the job's end cuts short is abandoned, not failed; sources and
sinks are told when a checkpoint is complete; a restarted coordinator records its recovery
with the failure's reason and time.
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Any, cast

import grpc

from keyshift.runtime.checkpoint_store import CheckpointStore
from keyshift.runtime.checkpointing import CheckpointDriver, CheckpointOutcome
from keyshift.runtime.coordinator import Coordinator
from keyshift.runtime.job import parse_job
from keyshift.runtime.metrics import JOB_LABEL, MetricName
from keyshift.runtime.protocol import (
    CheckpointComplete,
    Command,
    Empty,
    KeyedCheckpointAck,
    PeerUnreachable,
    RegisterRequest,
    ReportRequest,
    SinkCheckpointAck,
    SourceCheckpointAck,
)
from tests.conftest import count_job

STAGES = {"source": 2, "counts": 1, "sink": 1}


class Gone:
    """The gRPC context of a command stream whose instance died (the one method `watch` asks
    of its context; `gone()` gives it the context's type)."""

    def is_active(self) -> bool:
        return False


def gone() -> grpc.ServicerContext:
    return cast(grpc.ServicerContext, Gone())


class Job:
    """A coordinator whose instances are played by the test."""

    def __init__(
        self, tmp_path: Path, store: CheckpointStore | None = None, keyed: int = 1, **kw: Any
    ) -> None:
        spec = parse_job(
            count_job(
                source={"parallelism": 2},
                keyed={"parallelism": keyed},
                sink={"parallelism": 1},
                checkpoints={"storage": str(tmp_path / "checkpoints"), "timeout": 5},
                # The global restart's path (these instances cannot rewind; local recovery is
                # tested with real processes in tests/test_recovery.py).
                recovery="global",
            )
        )
        self.store = store or CheckpointStore(str(tmp_path / "checkpoints"))
        self.coordinator = Coordinator(spec, 30.0, store=self.store, **kw)
        assert spec.checkpoints is not None
        self.driver = CheckpointDriver(
            self.coordinator,
            spec.checkpoints,
            self.store,
            "counts",
            threading.Event(),
        )
        self.identities = {
            (stage, index): self.coordinator.register(
                RegisterRequest(stage=stage, index=index, data_address="-")
            ).identity
            for stage, n in {**STAGES, "counts": keyed}.items()
            for index in range(n)
        }

    def whoami(self, stage: str, index: int) -> dict[str, Any]:
        return {"stage": stage, "index": index, "identity": self.identities[stage, index]}

    def report(self, stage: str, index: int, **body: Any) -> None:
        self.coordinator.report(ReportRequest(**self.whoami(stage, index), **body))

    def commands(self, stage: str, index: int) -> list[Command | None]:
        """The commands sent to an instance so far (None ends its command stream)."""
        found = []
        commands = self.coordinator.members[stage][index].commands
        while True:
            try:
                found.append(commands.get_nowait())
            except queue.Empty:
                return found

    def take(self, answer: Any) -> CheckpointOutcome:
        """Take a checkpoint on a thread while `answer(id)` plays the instances' part."""
        members = self.coordinator.checkpoint_members()
        assert members is not None
        outcome: list[CheckpointOutcome] = []
        thread = threading.Thread(target=lambda: outcome.append(self.driver.take(members)))
        thread.start()
        assert self.driver.next_id is not None
        answer(self.driver.next_id - 1)
        thread.join(timeout=10)
        return outcome[0]

    def ack_keyed_and_sink(self, checkpoint: int, offset: int) -> None:
        chains: dict[str, Any] = {"shards": [], "groups": {}}
        self.report("counts", 0, events=[KeyedCheckpointAck(id=checkpoint, chains=chains)])
        self.report("sink", 0, events=[SinkCheckpointAck(id=checkpoint, offsets={"0": offset})])


def test_an_ended_source_is_in_every_later_checkpoint_at_its_final_position(
    tmp_path: Path,
) -> None:
    job = Job(tmp_path)
    job.report("source", 1, stats={"emitted": 700}, finished=True)  # ended before

    def answer(checkpoint: int) -> None:
        job.report("source", 0, events=[SourceCheckpointAck(id=checkpoint, source=0, position=50)])
        job.ack_keyed_and_sink(checkpoint, 40)

    first = job.take(answer)
    assert first.ok, first.error
    assert job.store.load(first.id).sources == {"0": 50, "1": 700}

    def source_0_ends_meanwhile(checkpoint: int) -> None:
        job.ack_keyed_and_sink(checkpoint, 90)  # source 0's END ended the alignment
        job.report("source", 0, stats={"emitted": 120}, finished=True)

    second = job.take(source_0_ends_meanwhile)
    assert second.ok, second.error
    meta = job.store.load(second.id)
    assert (meta.sources, meta.outputs) == ({"0": 120, "1": 700}, {"0": 90})


def test_sources_and_sinks_are_told_when_a_checkpoint_is_complete(tmp_path: Path) -> None:
    job = Job(tmp_path)
    for stage, n in STAGES.items():
        for index in range(n):
            job.commands(stage, index)  # the topology

    def answer(checkpoint: int) -> None:
        for index in range(2):
            ack = SourceCheckpointAck(id=checkpoint, source=index, position=10 * (index + 1))
            job.report("source", index, events=[ack])
        job.ack_keyed_and_sink(checkpoint, 30)

    outcome = job.take(answer)
    assert outcome.ok, outcome.error
    told = CheckpointComplete(
        id=outcome.id, sources={"0": 10, "1": 20}, outputs={"sink": {"0": 30}}
    )
    for stage, index in [("source", 0), ("source", 1), ("sink", 0)]:
        assert told in job.commands(stage, index), (stage, index)
    assert not any(isinstance(c, CheckpointComplete) for c in job.commands("counts", 0))


def test_a_checkpoint_the_job_end_cuts_short_is_abandoned_not_failed(tmp_path: Path) -> None:
    job = Job(tmp_path)

    def the_job_stops(checkpoint: int) -> None:
        job.coordinator.shutdown(Empty())

    outcome = job.take(the_job_stops)
    assert outcome.abandoned and not outcome.ok
    stats = job.coordinator.checkpoints
    assert (stats.failed, stats.failures_in_a_row, stats.last) == (0, 0, None)
    assert job.store.completed() == []


def test_a_restarted_coordinator_records_its_recovery(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "checkpoints"))
    first = Job(tmp_path, store)

    def answer(checkpoint: int) -> None:
        for index in range(2):
            first.report(
                "source",
                index,
                events=[SourceCheckpointAck(id=checkpoint, source=index, position=5)],
            )
        first.ack_keyed_and_sink(checkpoint, 5)

    assert first.take(answer).ok
    list(first.coordinator.watch(first.whoami("counts", 0), gone()))
    assert first.coordinator.restart and first.coordinator.phase == "recovering"

    meta = store.latest_valid()
    assert meta is not None
    second = Job(tmp_path, store, restore=meta)  # registers everyone: the job runs again
    assert second.coordinator.phase == "running"
    second.coordinator.record_recovery()
    (entry,) = store.recoveries()
    assert entry["checkpoint"] == meta.id
    assert entry["reason"].startswith("instance counts/0") and entry["seconds"] >= 0
    status = second.coordinator.status(Empty())
    assert status.recoveries == {"total": 1, "last": entry}
    exported = second.coordinator.metrics.registry.get_sample_value(
        MetricName.RECOVERIES, {JOB_LABEL: "t"}
    )
    assert exported == 1.0
    second.coordinator.record_recovery()  # once
    assert len(store.recoveries()) == 1
    third = Job(tmp_path, store)  # a later coordinator counts the job's recoveries
    assert (
        third.coordinator.metrics.registry.get_sample_value(MetricName.RECOVERIES, {JOB_LABEL: "t"})
        == 1.0
    )


def test_an_instance_silent_past_the_heartbeat_timeout_is_lost(tmp_path: Path) -> None:
    """A hung process, or one on a node that is gone, keeps its command stream open: its
    silence makes it lost. With checkpoints the job restarts from the latest one (and the
    failure is noted for the recovery's record); without, it fails."""
    job = Job(tmp_path)
    coordinator = job.coordinator
    coordinator.check_heartbeats()
    assert coordinator.phase == "running"  # everyone reported at registration
    coordinator.members["counts"][0].last_report -= coordinator.spec.heartbeat_timeout + 1
    coordinator.check_heartbeats()
    assert coordinator.restart and coordinator.phase == "recovering"
    (error,) = coordinator.errors
    assert error.startswith("instance counts/0") and "sent no report for 15 s" in error
    assert None in job.commands("counts", 0)  # its command stream is ended
    list(coordinator.watch(job.whoami("counts", 0), gone()))  # and once it ends...
    assert coordinator.errors == [error]  # ...it is not lost a second time

    spec = parse_job(count_job(keyed={"parallelism": 1}, sink={"parallelism": 1}))
    plain = Coordinator(spec, 30.0)
    for stage, index in [("source", 0), ("counts", 0), ("sink", 0)]:
        plain.register(RegisterRequest(stage=stage, index=index, data_address="-"))
    plain.members["sink"][0].last_report -= spec.heartbeat_timeout + 1
    plain.check_heartbeats()
    assert plain.phase == "failed" and "instance sink/0" in plain.errors[0]


def test_a_peer_a_keyed_instance_cannot_reach_is_lost_with_that_reason(tmp_path: Path) -> None:
    """A survivor's failed state fetch mid-move names the instance that is gone: the
    coordinator takes that one as lost and restarts the job from its checkpoint, the failure
    noted with the true reason (not the survivor's, and not "the coordinator was lost")."""
    job = Job(tmp_path, keyed=2)
    coordinator = job.coordinator
    unreachable = PeerUnreachable(peer=0, error="a state fetch failed: Connection refused")
    job.report("counts", 1, events=[unreachable])
    assert coordinator.restart and coordinator.phase == "recovering"
    (error,) = coordinator.errors
    assert error.startswith("instance counts/0") and "counts/1 could not reach it" in error
    assert "Connection refused" in error
    assert None in job.commands("counts", 0)  # its command stream is ended
    job.report("counts", 1, events=[unreachable])  # noticed again, or by its stream breaking
    list(coordinator.watch(job.whoami("counts", 0), gone()))
    assert coordinator.errors == [error]
    entry = job.store.record_recovery(1, 0.0, 1.0)
    assert entry["reason"] == error
