"""Warm standbys (`standby: N` on a keyed stage, `keyshift.runtime.standbys`): refused when out
of bounds (by the job file and the operator); pinned to one index (Kubernetes' standbys); on the
local host pre-started beside the job, apart from its parallelism, taken by a scale-out as its
new instance (the same process), and replaced when taken or killed. Kubernetes' standbys run
against the API emulator in tests/test_k8s_operator.py."""

from __future__ import annotations

import os
import signal
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from keyshift.operator.streamingjob import StreamingJobSpec
from keyshift.runtime.job import MAX_STANDBY, JobError, parse_job
from keyshift.runtime.metrics import serve_idle
from keyshift.runtime.pipeline import Dataflow, source
from keyshift.runtime.standbys import StandbyPool
from tests.conftest import count_job, running_job, wait_for
from tests.prometheus_server import free_port


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


def test_a_pinned_standby_takes_only_its_own_index_at_once_when_wanted_or_at_a_scale_out() -> None:
    """Kubernetes' standbys: StatefulSet pods that may only ever be their ordinal."""
    pool = StandbyPool(["counts"])
    wanted = pool.offer("counts", 10, pinned=0, wanted=1)  # the job starts: instance 0 is due
    assert wanted.index == 0
    third, second = pool.offer("counts", 12, pinned=2, wanted=1), pool.offer("counts", 11, 1, 1)
    unpinned = pool.offer("counts", 13)
    pool.take("counts", range(1, 2))
    assert (second.index, third.index, unpinned.index) == (1, None, None)
    pool.take("counts", range(2, 4))  # index 3 has no pod yet: an unpinned standby takes it
    assert (third.index, unpinned.index) == (2, 3)


def test_the_operator_refuses_a_standby_count_out_of_bounds_naming_the_field() -> None:
    spec = StreamingJobSpec.model_validate(
        {"image": "x", "job": {"name": "c", "keyed": {"standby": MAX_STANDBY + 1}}}
    )
    (problem,) = spec.problems()
    assert "keyed.standby: Input should be less than or equal to 8" in problem, problem


def test_a_waiting_pod_answers_its_probes_and_frees_the_port_for_its_metrics() -> None:
    """A standby pod serves an empty /metrics (the pods' probes ask there) until it is taken;
    then the port is free for the instance's own metrics."""
    port = free_port()
    close = serve_idle("127.0.0.1", port)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            assert reply.status == 200
    finally:
        close()
    serve_idle("127.0.0.1", port)()  # bound again at once (the instance's metrics would)


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
        wait_for(lambda: local.status()["phase"] == "running", 120, "the job to run")
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
