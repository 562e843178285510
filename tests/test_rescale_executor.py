"""The RescaleExecutor both hosts share (keyshift.operator.rescale_executor) across restarts of
either side of it: which finished rescales it reports (a rescale is named by the coordinator's
incarnation and its id), when it sets the pool to the coordinator's desired parallelism, and
the migration plan it sends with every rescale.

The coordinator's status is scripted here so each restart can be produced exactly, and the pool
records what it is asked (the real pools, a StatefulSet and the local processes, are exercised
by tests/test_control_plane_restarts.py). The last test starts rescales at a real coordinator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from keyshift.operator.autoscaler import RescaleOutcome, RescaleRefused
from keyshift.operator.k8s_scaling import remembered
from keyshift.operator.rescale_executor import (
    NO_PENDING,
    CoordinatorExecutor,
    LatestStatus,
    MigrationPlan,
    PendingSteps,
    RescaleMark,
)
from keyshift.runtime.rescale import RescaleStatus
from keyshift.runtime.transport import JsonClient
from tests.conftest import count_job, running_job, wait_for
from tests.prometheus_server import free_port


@dataclass
class RecordingPool:
    calls: list[tuple[str, str, int]] = field(default_factory=list)

    def ensure(self, stage: str, parallelism: int) -> None:
        self.calls.append(("ensure", stage, parallelism))

    def shrink(self, stage: str, parallelism: int) -> None:
        self.calls.append(("shrink", stage, parallelism))

    def match(self, stage: str, parallelism: int) -> None:
        self.calls.append(("match", stage, parallelism))


def rescale(id_: int, before: int, after: int, phase: str = "done") -> dict[str, Any]:
    """A rescale as the coordinator's status lists it."""
    error = None if phase == "done" else "boom"
    made = RescaleStatus("a", id_, "counts", before, after, "hot-first", {}, phase, error=error)
    return made.report().wire()


def status(
    incarnation: str,
    rescales: list[dict[str, Any]],
    desired: int,
    running: dict[str, Any] | None = None,
    phase: str = "running",
) -> dict[str, Any]:
    return {
        "incarnation": incarnation,
        "phase": phase,
        "stages": [{"name": "src", "desired": 1}, {"name": "counts", "desired": desired}],
        "rescale": running,
        "rescales": rescales,
    }


@pytest.fixture
def nobody() -> JsonClient:
    """A client of no coordinator: these tests only read the scripted status."""
    return JsonClient(f"127.0.0.1:{free_port()}", "keyshift.Coordinator")


def executor(
    client: JsonClient, handled: RescaleMark | None = None, pending: PendingSteps = NO_PENDING
) -> tuple[CoordinatorExecutor, LatestStatus, RecordingPool]:
    latest, pool = LatestStatus(), RecordingPool()
    made = CoordinatorExecutor(
        client, pool, latest, {"counts": 256}, MigrationPlan(), handled, pending
    )
    return made, latest, pool


def test_a_new_host_without_memory_matches_the_pool_and_replays_nothing(nobody: JsonClient) -> None:
    """An operator restarted after a scale-in it never saw end: the pool goes to the
    coordinator's desired parallelism (not left at 3, its retired worker crash-looping)."""
    made, latest, pool = executor(nobody)
    assert made.finished() == []  # no status yet: nothing, not even a match
    latest.value = status("a", [rescale(1, 2, 3), rescale(2, 3, 2)], desired=2)
    assert made.finished() == []
    assert pool.calls == [("match", "src", 1), ("match", "counts", 2)]
    assert made.handled == RescaleMark("a", 2)
    pool.calls.clear()
    latest.value = status("a", [rescale(1, 2, 3), rescale(2, 3, 2), rescale(3, 2, 4)], desired=4)
    assert made.finished() == [RescaleOutcome("counts", True, "done")]
    assert pool.calls == []  # matched once; a scale-out grew the pool when it was applied


def test_a_host_with_memory_reports_what_ended_while_it_was_away(nobody: JsonClient) -> None:
    made, latest, pool = executor(nobody, RescaleMark("a", 1))
    latest.value = status("a", [rescale(1, 2, 3), rescale(2, 3, 2)], desired=2)
    assert made.finished() == [RescaleOutcome("counts", True, "done")]
    assert pool.calls == [("shrink", "counts", 2), ("match", "src", 1), ("match", "counts", 2)]
    assert made.handled == RescaleMark("a", 2)
    assert made.finished() == []  # reported once


def test_a_restarted_coordinators_ids_are_new_rescales(nobody: JsonClient) -> None:
    """Ids start at 1 again in a new coordinator process: its scale-in is acted on."""
    made, latest, pool = executor(nobody)
    latest.value = status("a", [rescale(1, 2, 3)], desired=3)
    made.finished()
    pool.calls.clear()
    latest.value = status("b", [], desired=2, phase="starting")  # restored at 2
    assert made.finished() == []
    assert pool.calls == [("match", "src", 1), ("match", "counts", 2)]
    pool.calls.clear()
    latest.value = status("b", [rescale(1, 2, 3), rescale(2, 3, 1)], desired=1)
    outcomes = made.finished()
    assert outcomes == [RescaleOutcome("counts", True, "done")] * 2
    assert pool.calls == [("shrink", "counts", 1)]
    assert made.handled == RescaleMark("b", 2)


def test_the_pool_is_not_matched_while_a_rescale_runs_nor_after_the_job_ends(
    nobody: JsonClient,
) -> None:
    made, latest, pool = executor(nobody)
    # A scale-in in flight: its retiring workers hold state until it ends.
    latest.value = status("a", [], desired=2, running=rescale(1, 3, 2, "moving"))
    assert made.finished() == [] and pool.calls == []
    latest.value = status("a", [rescale(1, 3, 2, "failed")], desired=3)
    assert made.finished() == [RescaleOutcome("counts", False, "boom")]
    assert pool.calls == [("match", "src", 1), ("match", "counts", 3)]
    # A scale-out in flight gets its workers at once; a finished job is left to its host.
    made, latest, pool = executor(nobody)
    latest.value = status("a", [], desired=4, running=rescale(1, 2, 4, "starting-instances"))
    made.finished()
    assert pool.calls == [("ensure", "counts", 4)]
    made, latest, pool = executor(nobody)
    latest.value = status("a", [], desired=4, phase="finished")
    made.finished()
    assert pool.calls == []


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (None, "a mapping"),
        ({"incarnation": "", "id": 1}, "incarnation must be a non-empty string"),
        ({"incarnation": "a", "id": "1"}, "id must be a rescale number"),
        ({"incarnation": "a", "id": -1}, "id must be a rescale number"),
    ],
)
def test_a_bad_rescale_mark_is_refused_with_the_reason(value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RescaleMark.from_json(value)
    assert RescaleMark.from_json({"incarnation": "a", "id": 3}) == RescaleMark("a", 3)


def test_an_unreadable_memory_in_the_status_starts_that_part_afresh() -> None:
    kept = {"guards": {"counts": {"failures": "many"}},
            "handledRescale": {"incarnation": "a", "id": 4}}  # fmt: skip
    memory, problems = remembered(kept)
    assert memory.guards is None and memory.handled == RescaleMark("a", 4)
    assert problems == ["status.guards ignored: stage 'counts': failures must be a count, got "
                        "'many'"]  # fmt: skip
    decision = {"time": "2026-01-01T00:00:00+00:00", "stage": "counts", "from": 2, "to": 3,
                "action": "scale_up", "reason": "r", "inputs": {"busy": 0.9}}  # fmt: skip
    memory, problems = remembered({"decisions": [decision]})
    assert memory.decisions == (decision,) and problems == []
    memory, problems = remembered({"decisions": [{**decision, "to": "many"}]})
    assert memory.decisions == () and problems[0].startswith("status.decisions ignored")
    memory, problems = remembered({"handledRescale": {"id": 4}})
    assert memory.handled is None and "status.handledRescale ignored" in problems[0]
    assert remembered({}) == (type(memory)(), [])


@pytest.mark.live
@pytest.mark.slow
def test_the_plan_travels_with_every_rescale_to_the_coordinator(tmp_path: Path) -> None:
    """A real coordinator gets the strategy and options; a plan it refuses changes nothing."""
    job = count_job(source={"config": {"kind": "generator", "keys": 500, "profile": {"rate": 500}}})
    with running_job(tmp_path, job) as local:
        assert local.client is not None
        wait_for(lambda: local.status()["phase"] == "running", 60, "the job to run")
        latest = LatestStatus()
        plan = MigrationPlan("batched", {"batch_groups": 64, "chunk_keys": 1000})
        made = CoordinatorExecutor(local.client, local, latest, {"counts": 256}, plan)
        made.apply([("counts", 3)])
        done = wait_for(
            lambda: (s := local.status())["rescales"] and s["rescales"][-1], 90, "the rescale"
        )
        assert done["phase"] == "done", done["error"]
        assert done["strategy"] == "batched"
        assert done["options"] == {"batch_groups": 64.0, "chunk_keys": 1000.0}
        # The options change what the driver does: subscales of at most 64 moving groups,
        # each between one old and one new owner (two old owners: one part-filled batch more).
        assert done["groups_to_move"] > 256
        batches = math.ceil(done["groups_to_move"] / 64)
        assert batches <= done["steps"] <= batches + 1, done
        assert done["subscales"]["count"] == done["steps"] == done["subscales"]["done"]
        assert all(s["groups"] <= 64 for s in done["subscales"]["shown"]), done
        refused = CoordinatorExecutor(
            local.client, local, latest, {"counts": 256},
            MigrationPlan("lazy", {"batch_groups": 64}),
        )  # fmt: skip
        with pytest.raises(RescaleRefused, match="'batch_groups' does not apply to lazy"):
            refused.apply([("counts", 2)])
        after = local.status()
        assert len(after["rescales"]) == 1 and after["rescale"] is None
        assert after["stages"][1]["desired"] == 3


@pytest.mark.live
def test_a_decisions_rescales_run_one_after_another_and_a_refused_one_ends_it(
    tmp_path: Path,
) -> None:
    """A real coordinator of a chain of two keyed stages: the executor starts the second
    stage's rescale once the first's is done; a step the coordinator refuses is that stage's
    failed outcome, and the steps after it are not started."""
    source = {"kind": "generator", "keys": 500, "profile": {"rate": 500}}
    job = {
        "name": "pair",
        "graph": [
            {"name": "src", "kind": "source", "config": source},
            {"name": "a", "kind": "keyed", "input": "src", "key_by": "key",
             "operator": {"kind": "process", "function": "tests.job_fns:track"}},
            {"name": "b", "kind": "keyed", "input": "a", "key_by": "key",
             "operator": {"kind": "process", "function": "tests.job_fns:nest"}},
            {"name": "out", "kind": "sink", "input": "b", "config": {"kind": "log"}},
        ],
    }  # fmt: skip
    with running_job(tmp_path, job) as local:
        assert local.client is not None
        wait_for(lambda: local.status()["phase"] == "running", 60, "the job to run")
        latest = LatestStatus()
        made = CoordinatorExecutor(local.client, local, latest, {"a": 256, "b": 256})
        outcomes: list[RescaleOutcome] = []

        def ended(n: int) -> bool:
            latest.value = local.status()
            outcomes.extend(made.finished())
            return len(outcomes) >= n

        made.apply([("a", 2), ("b", 2), ("nope", 2), ("a", 1)])
        assert made.running() == "a"  # started, though the status read last is older
        wait_for(lambda: ended(1), 60, "a's rescale")
        assert made.running() == "b"
        wait_for(lambda: ended(3), 60, "b's rescale, and the next step refused")
        assert outcomes[:2] == [RescaleOutcome(s, True, "done") for s in ("a", "b")]
        failed = outcomes[2]
        assert (failed.stage, failed.ok) == ("nope", False), failed
        assert failed.detail.startswith("not started: ") and "nope" in failed.detail, failed
        assert failed.detail.endswith("; not started after it: a→1"), failed
        assert made.running() is None
        assert [(r["stage"], r["to"]) for r in local.status()["rescales"]] == [("a", 2), ("b", 2)]
        stages = {s["name"]: s["desired"] for s in local.status()["stages"]}
        assert (stages["a"], stages["b"]) == (2, 2)


def test_a_restarted_host_goes_on_with_the_pending_steps_of_a_decision(
    nobody: JsonClient,
) -> None:
    """The host before it started counts→3 (rescale 3) and queued b→2: this one waits for
    rescale 3 to end and then starts b (at no coordinator here: refused, the failed outcome
    names it, which shows it was taken up)."""
    pending = PendingSteps(RescaleMark("a", 3), "counts", (("b", 2),))
    made, latest, _ = executor(nobody, RescaleMark("a", 2), pending)
    assert made.running() == "counts" and made.pending() == pending
    latest.value = status("a", [rescale(2, 2, 1)], desired=3, running=rescale(3, 2, 3, "moving"))
    assert made.finished() == [] and made.pending() == pending
    latest.value = status("a", [rescale(2, 2, 1), rescale(3, 2, 3)], desired=3)
    outcomes = made.finished()
    assert outcomes[0] == RescaleOutcome("counts", True, "done")
    assert (outcomes[1].stage, outcomes[1].ok) == ("b", False), outcomes
    assert outcomes[1].detail.startswith("not started: ")
    assert not made.pending() and made.running() is None


def test_pending_steps_end_with_a_restarted_coordinator_or_a_failed_step(
    nobody: JsonClient,
) -> None:
    """A coordinator restarted while the host was down has ended the decision (restored to a
    checkpoint); a started step that failed before the host took its outcome ends it too."""
    pending = PendingSteps(RescaleMark("a", 3), "counts", (("b", 2),))
    made, latest, _ = executor(nobody, RescaleMark("a", 2), pending)
    latest.value = status("b", [], desired=2)
    assert made.finished() == [] and not made.pending()
    made, latest, _ = executor(nobody, RescaleMark("a", 3), pending)
    latest.value = status("a", [rescale(3, 2, 3, "failed")], desired=2)
    assert made.finished() == [] and not made.pending() and made.running() is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([], "a mapping"),
        ({"started": {"incarnation": "a", "id": 1}}, "stage must be a name"),
        ({"queued": {"stage": "b"}}, "queued must be a list"),
        ({"queued": [{"stage": "", "parallelism": 2}]}, "stage must be a name"),
        ({"queued": [{"stage": "b", "parallelism": 0}]}, "parallelism must be >= 1"),
        ({"queued": [{"stage": "b", "parallelism": True}]}, "parallelism must be >= 1"),
    ],
)
def test_unreadable_pending_steps_are_refused_with_the_reason(value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PendingSteps.from_json(value)
    memory, problems = remembered({"pendingRescales": value})
    assert not memory.pending and problems[0].startswith("status.pendingRescales ignored")


def test_pending_steps_read_back_as_written() -> None:
    pending = PendingSteps(RescaleMark("a", 3), "counts", (("b", 2), ("counts", 1)))
    assert PendingSteps.from_json(pending.to_json()) == pending
    memory, problems = remembered({"pendingRescales": pending.to_json()})
    assert memory.pending == pending and problems == []
    assert PendingSteps.from_json(PendingSteps().to_json()) == PendingSteps()


def test_someone_elses_replaced_request_is_no_outcome_but_the_hosts_own_ends_its_decision(
    nobody: JsonClient,
) -> None:
    """A request that waited in the coordinator's queue and was replaced by a newer one of
    its stage did nothing: not a failure to back off from, unless it was this host's step,
    whose decision then ends (its next steps were planned with it)."""
    made, latest, _ = executor(nobody, RescaleMark("a", 1))
    latest.value = status("a", [rescale(2, 2, 3, "replaced"), rescale(3, 2, 4)], desired=4)
    assert made.finished() == [RescaleOutcome("counts", True, "done")]
    pending = PendingSteps(RescaleMark("a", 5), "counts", (("b", 2),))
    made, latest, _ = executor(nobody, RescaleMark("a", 4), pending)
    latest.value = status("a", [rescale(5, 2, 3, "replaced")], desired=2)
    (outcome,) = made.finished()
    assert (outcome.stage, outcome.ok) == ("counts", False)
    assert outcome.detail == "boom; not started after it: b→2"
    assert not made.pending() and made.running() is None
