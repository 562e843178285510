"""Warm standbys (`standby: N` on a keyed stage, `keyshift.runtime.standbys`): refused when out
of bounds; on the local host pre-started beside the job, apart from its parallelism, taken by a
scale-out as its new instance (the same process), and replaced when taken or killed."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from keyshift.runtime.job import MAX_STANDBY, JobError, parse_job
from keyshift.runtime.pipeline import Dataflow, source
from keyshift.runtime.standbys import StandbyPool
from tests.conftest import count_job, running_job, wait_for


@pytest.mark.parametrize(
    ("standby", "reason"),
    [(-1, "greater than or equal to 0"), (MAX_STANDBY + 1, "less than or equal to 8")],
)
def test_a_standby_count_out_of_bounds_is_refused(standby: int, reason: str) -> None:
    with pytest.raises(JobError, match=reason):
        parse_job(count_job(keyed={"standby": standby}))


def test_the_python_api_and_a_graph_job_set_standbys_and_refuse_bad_ones() -> None:
    def flow(standby: int) -> Any:
        counts = source("events").key_by("key").count(name="counts", standby=standby)
        return Dataflow("t", counts.sink_log(name="out"))

    (step,) = flow(2).build().keyed_stages()
    assert step.stage.standby == 2
    with pytest.raises(JobError, match="standby"):
        flow(-1).build()


def test_a_scale_out_takes_standbys_in_order_for_its_new_indexes_only() -> None:
    pool = StandbyPool(["counts"])
    first, second = pool.offer("counts", 11), pool.offer("counts", 12)
    pool.take("counts", range(1, 1))  # a scale-in: nothing taken
    assert [s.index for s in pool.status("counts")] == [None, None]
    pool.take("counts", range(1, 2))
    assert (first.index, second.index) == (1, None)
    pool.registered("counts", 1)
    assert [(s.pid, s.index) for s in pool.status("counts")] == [(12, None)]
    pool.leave(second)
    assert pool.status("counts") == []
    with pytest.raises(KeyError):
        pool.offer("other", 13)


def stage_status(local: Any) -> dict[str, Any]:
    status: dict[str, Any] = local.status()
    local.ensure_instances(status)
    keyed: dict[str, Any] = status["stages"][1]
    return keyed


def waiting_pid(local: Any) -> int:
    """The pid of the stage's one standby once it waits at the coordinator."""
    standbys = wait_for(lambda: stage_status(local)["standbys"], 30, "a standby to wait")
    (standby,) = standbys
    assert standby["index"] is None
    pid: int = standby["pid"]
    return pid


@pytest.mark.live
def test_a_scale_out_takes_the_standby_process_and_a_new_standby_replaces_it(
    tmp_path: Path,
) -> None:
    job = count_job(
        source={"config": {"kind": "generator", "keys": 500, "seed": 1, "profile": {"rate": 500}}},
        keyed={"parallelism": 1, "standby": 1},
        sink={"parallelism": 1},
    )
    with running_job(tmp_path, job) as local:
        wait_for(lambda: local.status()["phase"] == "running", 30, "the job to run")
        standby = waiting_pid(local)
        keyed = stage_status(local)
        assert keyed["parallelism"] == 1 and [i["index"] for i in keyed["instances"]] == [0]

        os.kill(standby, signal.SIGKILL)  # a dead standby is replaced, the job goes on
        standby = wait_for(lambda: (p := waiting_pid(local)) != standby and p, 30, "a new one")
        assert local.status()["phase"] == "running"

        assert local.client is not None
        local.client.call("Rescale", {"stage": "counts", "parallelism": 2})
        wait_for(lambda: stage_status(local)["parallelism"] == 2, 60, "the new instance")
        done = wait_for(lambda: (s := local.status())["rescales"] and s, 60, "the scale-out")
        assert done["rescales"][0]["phase"] == "done", done["rescales"]
        instances = stage_status(local)["instances"]
        assert [(i["index"], i["pid"]) for i in instances][1] == (1, standby)
        assert local.instances["counts/1"].pid == standby
        replacement = wait_for(lambda: waiting_pid(local) != standby, 30, "a new standby")
        assert replacement
