"""Failing checkpoints on the coordinator's side (keyshift.runtime.checkpointing's
CheckpointDriver with a real Coordinator whose instances are played by the test, as in
tests/test_checkpoint_driver.py): while checkpoints fail the driver pauses longer and longer
between them, up to its limit, and goes back to the interval after one completes; a checkpoint
that times out names the storage failures the instances report (a sink stalled on a full disk);
a coordinator that could not list the checkpoints taken before takes none until it can (so it
never reuses an earlier run's ids)."""

from __future__ import annotations

import threading
from pathlib import Path

from keyshift.runtime.checkpoint_store import CheckpointMeta
from keyshift.runtime.checkpointing import (
    FIRST_CHECKPOINT_POLL,
    RETRY_PAUSE_LIMIT,
    CheckpointDriver,
)
from keyshift.runtime.protocol import KeyedCheckpointAck
from tests.test_checkpoint_driver import Job


class Waits(threading.Event):
    """The driver's stop event, recording each pause it takes; set after `limit` of them."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.pauses: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        assert timeout is not None
        self.pauses.append(timeout)
        if len(self.pauses) >= self.limit:
            self.set()
        return self.is_set()


def test_failing_checkpoints_are_retried_after_growing_pauses(tmp_path: Path) -> None:
    job = Job(tmp_path)
    stop = Waits(limit=9)
    settings = job.driver.settings.model_copy(update={"interval": 0.5})
    driver = CheckpointDriver(job.coordinator, settings, job.store, "counts", stop)
    failures = 0

    def storage_fails() -> None:
        nonlocal failures
        while not stop.is_set():
            checkpoint = job.coordinator.checkpoints.in_flight
            if checkpoint is not None:
                error = KeyedCheckpointAck(id=checkpoint, error="cannot write: down")
                job.report("counts", 0, events=[error])
                failures += 1
            threading.Event().wait(0.01)

    player = threading.Thread(target=storage_fails, daemon=True)
    player.start()
    driver.run()
    player.join(timeout=10)
    first, *retries = stop.pauses
    assert first == FIRST_CHECKPOINT_POLL
    assert retries == [
        0.5,
        1.0,
        2.0,
        4.0,
        8.0,
        RETRY_PAUSE_LIMIT,
        RETRY_PAUSE_LIMIT,
        RETRY_PAUSE_LIMIT,
    ]
    status = job.coordinator.checkpoints
    assert status.degraded and status.failed == len(retries) and failures >= len(retries)
    assert status.last is not None and "cannot write: down" in str(status.last.error)


def test_a_checkpoint_that_times_out_names_the_failing_storage(tmp_path: Path) -> None:
    job = Job(tmp_path)
    job.report("sink", 0, stats={"storage_error": "cannot write out/x: No space left on device"})
    outcome = job.take(lambda checkpoint: None)  # nobody acks: the sink is stalled
    assert not outcome.ok
    assert outcome.error == (
        "not complete within 5 s (storage failing: sink/0: cannot write out/x: "
        "No space left on device)"
    )


def test_no_checkpoint_is_numbered_before_the_earlier_ones_can_be_listed(tmp_path: Path) -> None:
    job = Job(tmp_path)
    job.store.commit(CheckpointMeta(7, 0.0))  # an earlier run's
    storage = tmp_path / "checkpoints"
    storage.rename(tmp_path / "away")
    storage.write_text("the storage is down")
    driver = CheckpointDriver(
        job.coordinator, job.driver.settings, job.store, "counts", threading.Event(), next_id=None
    )
    members = job.coordinator.checkpoint_members()
    assert members is not None
    outcome = driver.take(members)
    assert not outcome.ok and "cannot list the checkpoints taken before" in str(outcome.error)
    assert job.coordinator.checkpoints.failed == 1
    storage.unlink()
    (tmp_path / "away").rename(storage)
    members = job.coordinator.checkpoint_members()
    assert members is not None
    assert driver.take(members).id == 8  # (nobody acks it: it times out)
