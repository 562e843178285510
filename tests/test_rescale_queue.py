"""Rescales queued behind the running one (keyshift.runtime.rescale_queue and the coordinator's
Rescale): a real Coordinator served in this process, its instances played over the real control
calls by the test, so what runs and what waits is decided by the test, not by timing. The
rescale that runs is a scale-out whose new instance the test never starts: it runs until the
coordinator's registration timeout, which the test sets short when it wants it to end.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from keyshift.operator.autoscaler import RescaleOutcome
from keyshift.operator.cli import describe_rescale, rescale_accepted
from keyshift.operator.rescale_executor import CoordinatorExecutor, LatestStatus
from keyshift.runtime.coordinator import Coordinator
from keyshift.runtime.job import parse_job
from keyshift.runtime.protocol import (
    InDone,
    OutDone,
    ReportRequest,
    RescaleRequest,
    queued_rescales,
)
from keyshift.runtime.rescale import RescaleStatus
from keyshift.runtime.rescale_queue import MAX_QUEUED, QueueFull, RescaleQueue
from keyshift.runtime.transport import JsonClient, RequestRefused, TransportError
from tests.conftest import count_job, served, wait_for
from tests.test_rescale_executor import RecordingPool
from tests.test_rescale_recovery import ScaleOut, join, moving_scale_out

SERVICE = "keyshift.Coordinator"


def two_stage_job(**overrides: Any) -> Coordinator:
    """A count job whose keyed stage and sink can both be rescaled (the sink writes 4
    partitions), every stage at one instance."""
    job = count_job(keyed={"parallelism": 1}, sink={"parallelism": 1, "partitions": 4}, **overrides)
    return Coordinator(parse_job(job), 30.0)


def rescale(client: JsonClient, stage: str, parallelism: int) -> dict[str, Any]:
    return client.call("Rescale", RescaleRequest(stage=stage, parallelism=parallelism).wire())


@contextmanager
def played_job(**overrides: Any) -> Iterator[tuple[Coordinator, JsonClient]]:
    """`two_stage_job` served and running, every instance played (none answers a command)."""
    coordinator = two_stage_job(**overrides)
    with served(coordinator) as address:
        played = [join(address, stage, 0) for stage in ("source", "counts", "sink")]
        client = JsonClient(address, SERVICE)
        try:
            wait_for(lambda: coordinator.phase == "running", 10, "the job to run")
            yield coordinator, client
        finally:
            client.close()
            for instance in played:
                instance.client.close()


@pytest.fixture
def two_stage() -> Iterator[tuple[Coordinator, str]]:
    coordinator = two_stage_job()
    with served(coordinator) as address:
        yield coordinator, address


def history(client: JsonClient) -> list[tuple[int, str, str]]:
    return [(r["id"], r["stage"], r["phase"]) for r in client.call("Status")["rescales"]]


def finish(move: ScaleOut) -> None:
    """End the played scale-out of `counts`: all moved."""
    move.old.report(OutDone(epoch=move.migrate_out.epoch, stats={}))
    move.new.report(InDone(epoch=move.migrate_in.epoch, stats={}))


def test_a_request_for_another_stage_is_queued_replaced_and_started_when_the_first_ends(
    two_stage: tuple[Coordinator, str],
) -> None:
    coordinator, address = two_stage
    with moving_scale_out(coordinator, address) as move:
        client = move.client
        first = client.call("Status")["rescale"]
        queued = rescale(client, "sink", 2)
        assert queued["phase"] == "queued" and queued["id"] == first["id"] + 1
        assert queued["replaced"] is None
        again = rescale(client, "sink", 3)
        assert again["phase"] == "queued" and again["replaced"] == queued["id"]
        status = client.call("Status")
        assert [r.id for r in queued_rescales(status)] == [again["id"]]
        (replaced,) = status["rescales"]
        assert replaced["id"] == queued["id"] and replaced["phase"] == "replaced"
        assert f"replaced by rescale {again['id']}" in replaced["error"]
        # The stage that moves now is refused, not queued, and so are bad requests.
        with pytest.raises(RequestRefused, match=f"rescale {first['id']} of stage counts is"):
            rescale(client, "counts", 3)
        with pytest.raises(TransportError, match="must be an integer from 1 to 4"):
            rescale(client, "sink", 5)
        with pytest.raises(TransportError, match="stage 'source' is a source"):
            rescale(client, "source", 2)
        assert [r.id for r in queued_rescales(client.call("Status"))] == [again["id"]]
        assert coordinator.desired["sink"] == 1  # nothing of it started yet
        finish(move)
        # The queued one starts as the first ends: its new instances are wanted.
        wait_for(lambda: coordinator.desired["sink"] == 3, 10, "the queued rescale to start")
        status = client.call("Status")
        assert status["rescale"]["id"] == again["id"] and status["queued"] == []
        assert status["rescale"]["started"] >= status["rescales"][-1]["finished"]
        assert history(client) == [
            (queued["id"], "sink", "replaced"),
            (first["id"], "counts", "done"),
        ]


def test_a_queued_request_that_cannot_start_any_more_fails_with_the_reason(
    two_stage: tuple[Coordinator, str],
) -> None:
    coordinator, address = two_stage
    with moving_scale_out(coordinator, address) as move:
        queued = rescale(move.client, "sink", 2)
        source = move.source
        finished = ReportRequest(stage="source", index=0, identity=source.identity, finished=True)
        source.client.call("Report", finished.wire())
        finish(move)
        wait_for(lambda: len(history(move.client)) == 2, 10, "both rescales to end")
        last = move.client.call("Status")["rescales"][-1]
        assert last["id"] == queued["id"] and last["phase"] == "failed"
        error = "not started: sources source-0 of job t have ended; the job is finishing"
        assert last["error"] == error
        assert coordinator.desired["sink"] == 1


@pytest.mark.parametrize("end", ["drain", "shutdown"])
def test_draining_and_shutting_down_drop_what_waits(end: str) -> None:
    with played_job() as (coordinator, client):
        running = rescale(client, "counts", 2)
        queued = rescale(client, "sink", 2)
        if end == "drain":
            assert client.call("Drain")["phase"] == "running"  # once the running rescale ends
            with pytest.raises(RequestRefused, match="job t is draining"):
                rescale(client, "sink", 2)
        else:
            client.call("Shutdown")
        assert coordinator.rescale_queue.waiting() == []
        (dropped,) = ended(coordinator, queued["id"])
        assert dropped.phase == "failed"
        reason = "asked to drain" if end == "drain" else "shut down"
        assert dropped.error == f"not started: the job was {reason}"
        if end == "shutdown":
            # The running one ends too, at once: not when its new instance's registration
            # times out (30 s here), nor never, as in a process that outlives the coordinator.
            (stopped,) = wait_for(lambda: ended(coordinator, running["id"]), 10, "its end")
            assert stopped.phase == "failed" and stopped.error is not None
            assert "the job is stopping, while waiting for new instances" in stopped.error


def ended(coordinator: Coordinator, id_: int) -> list[RescaleStatus]:
    return [r for r in coordinator.rescale_history if r.id == id_]


def test_a_recovery_from_a_checkpoint_drops_what_waits(tmp_path: Path) -> None:
    """A checkpointed job that loses an instance restarts from its checkpoint: the restarted
    coordinator knows nothing of the queue, so it is dropped with the reason first."""
    checkpoints = {"storage": str(tmp_path), "interval": 3600}
    with played_job(checkpoints=checkpoints) as (coordinator, client):
        rescale(client, "counts", 2)
        queued = rescale(client, "sink", 2)
        sink = coordinator.members["sink"][0]
        sink.commands.put(None)  # its command stream ends: the process is gone
        wait_for(lambda: coordinator.restart, 10, "the job to restart from its checkpoint")
        (dropped,) = [r for r in coordinator.rescale_history if r.id == queued["id"]]
        assert dropped.phase == "failed" and dropped.error is not None
        assert "restarts from its latest checkpoint" in dropped.error
        assert coordinator.rescale_queue.waiting() == []


def status_of(stage: str, id_: int) -> RescaleStatus:
    return RescaleStatus("x", id_, stage, 1, 2, "hot-first", {})


def test_the_queue_is_bounded_and_keeps_one_request_per_stage() -> None:
    waiting = RescaleQueue()
    for n in range(MAX_QUEUED):
        assert waiting.put(status_of(f"s{n}", n)) is None
    with pytest.raises(QueueFull, match=f"{MAX_QUEUED} rescales wait already"):
        waiting.put(status_of("another", 99))
    # A stage that waits already is replaced in its place, full or not.
    newer = status_of("s3", 100)
    older = waiting.put(newer)
    assert older is not None and older.id == 3 and older.phase == "replaced"
    assert [s.id for s in waiting.waiting()] == [0, 1, 2, 100, 4, 5, 6, 7]
    first = waiting.pop()
    assert first is not None and first.id == 0
    dropped = waiting.drop("why")
    assert len(dropped) == MAX_QUEUED - 1 and len(waiting) == 0
    assert {(s.phase, s.error) for s in dropped} == {("failed", "not started: why")}
    assert waiting.pop() is None


def test_the_hosts_step_queued_behind_another_rescale_gets_its_workers_when_it_starts(
    two_stage: tuple[Coordinator, str],
) -> None:
    """The executor's step waits behind a rescale someone else started: its new workers are
    not started before its turn (the coordinator would refuse them), but as it starts."""
    coordinator, address = two_stage
    with moving_scale_out(coordinator, address) as move:
        latest, pool = LatestStatus(), RecordingPool()
        made = CoordinatorExecutor(move.client, pool, latest, {"counts": 256, "sink": 4})
        made.apply([("sink", 3)])
        latest.value = move.client.call("Status")
        assert made.finished() == []
        assert pool.calls == [("ensure", "counts", 2)]  # the running scale-out's, not the sink's
        pool.calls.clear()
        assert made.running() == "counts"  # the guards hold every stage meanwhile
        finish(move)
        wait_for(lambda: coordinator.desired["sink"] == 3, 10, "the queued rescale to start")
        latest.value = move.client.call("Status")
        assert made.finished() == [RescaleOutcome("counts", True, "done")]
        assert pool.calls == [("ensure", "sink", 3)]
        assert made.running() == "sink"


def test_the_cli_says_whether_a_request_runs_or_waits() -> None:
    running = RescaleStatus("x", 4, "users", 2, 3, "hot-first", {}, "starting-instances")
    assert rescale_accepted(running.report()) == "started rescale 4: users -> 3"
    queued = RescaleStatus("x", 6, "out", 2, 4, "hot-first", {}, "queued", replaced=5)
    assert rescale_accepted(queued.report()) == (
        "queued rescale 6: out -> 4 (it starts when the rescales before it end: see "
        "`keyshift status`); it replaces queued rescale 5 of out"
    )

    why = "replaced by rescale 6 of its stage before it started"
    waited = RescaleStatus("x", 5, "out", 2, 3, "hot-first", {}, "replaced", error=why)
    assert describe_rescale(waited.report()) == (
        "rescale 5 of out -> 3: replaced; replaced by rescale 6 of its stage before it started"
    )
