"""`keyshift rescale` and `keyshift status` against a job started with `keyshift run`."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from tests.conftest import (
    KEYSHIFT,
    REPO,
    children_of,
    cli,
    coordinators_of,
    count_job,
    status_of,
    wait_for,
    write_job,
)

pytestmark = pytest.mark.live


def keyshift(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [KEYSHIFT, *args], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )


def test_rescale_a_running_job_by_name(tmp_path: Path) -> None:
    job = count_job(
        name="clicks-cli",
        source={"config": {"kind": "generator", "keys": 5000, "profile": {"rate": 10_000}}},
        keyed={"name": "counts", "parallelism": 1},
        sink={"config": {"kind": "log", "path": str(tmp_path / "out")}},
    )
    with cli(["run", str(write_job(tmp_path, job)), "--no-view"]) as run:
        wait_for(lambda: len(children_of(run.pid)) == 4, 30, "the job's processes")
        wait_for(lambda: status_of("clicks-cli").get("phase") == "running", 30, "the job to run")
        out = keyshift("rescale", "clicks-cli", "counts", "3")
        assert out.returncode == 0, out.stdout + out.stderr
        assert "1->3 (hot-first): done" in out.stdout
        status = json.loads(keyshift("status", "clicks-cli").stdout)
        assert status["stages"][1]["parallelism"] == 3
        # Without concurrent subscales (one per pair of instances) a batched move takes one
        # step per batch of all its groups, which shows that both options got through.
        out = keyshift("rescale", "clicks-cli", "counts", "2", "--strategy", "batched",
                       "--option", "batch_groups=500", "--option", "subscales=0")  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr
        assert "3->2 (batched): done" in out.stdout
        # The options reached the coordinator's driver: one step per 500 moving groups.
        found = re.search(r"in (\d+) step\(s\); (\d+)/(\d+) groups", out.stdout)
        assert found is not None, out.stdout
        steps, to_move = int(found[1]), int(found[3])
        assert to_move > 500 and steps == math.ceil(to_move / 500), out.stdout
        os.kill(run.pid, signal.SIGINT)
        output, _ = run.communicate(timeout=60)
    assert run.returncode == 0, output
    assert "rescale 1 of counts 1->3" in output and "rescale 2 of counts 3->2" in output


def test_rescale_errors_are_clear(tmp_path: Path) -> None:
    out = keyshift("rescale", "no-such-job", "counts", "2")
    assert out.returncode == 2 and "no running job named 'no-such-job'" in out.stdout
    out = keyshift("rescale", "x", "counts", "2", "--option", "batch_groups")
    assert out.returncode == 2 and "NAME=NUMBER" in out.stdout
    out = keyshift("rescale", "x", "counts", "2", "--strategy", "teleport")
    assert out.returncode == 2 and "invalid choice" in out.stderr
    out = keyshift("status", "127.0.0.1:1")
    assert out.returncode == 1 and "unreachable" in out.stdout


def test_a_coordinator_restart_during_the_wait_is_reported_not_taken_for_the_rescale(
    tmp_path: Path,
) -> None:
    """The coordinator dies in the middle of a slow rescale; `keyshift run` restarts it from
    the latest checkpoint, without the rescale. The waiting `keyshift rescale` sees a new
    coordinator process (another incarnation, whose rescale ids start again at 1) and says so,
    exit 1, instead of waiting for, or reporting, a rescale of the new one."""
    job = count_job(
        name="restarted",
        # 2k records/s over a million keys: thousands of keys have state by the first
        # checkpoint and a record seldom meets one again, so fetch on demand cannot finish the
        # move early (over 2k keys it fetched nearly all in ~4 s; zipf left only a few keys).
        source={"config": {"kind": "generator", "keys": 1_000_000, "distribution": "uniform",
                           "profile": {"rate": 2_000}}},
        keyed={"name": "counts", "parallelism": 1},
        sink={"config": {"kind": "log", "path": str(tmp_path / "out")}},
        checkpoints={"interval": 2, "storage": str(tmp_path / "checkpoints")},
    )  # fmt: skip
    with cli(["run", str(write_job(tmp_path, job)), "--no-view"]) as run:
        checkpoints = lambda: status_of("restarted").get("checkpoints") or {}  # noqa: E731
        wait_for(lambda: checkpoints().get("completed", 0) >= 1, 60, "a checkpoint")
        # A trickle of 20 keys/s: the move of thousands of keys lasts long enough to kill inside it.
        waiting = subprocess.Popen(
            [KEYSHIFT, "rescale", "restarted", "counts", "2", "--option", "chunk_keys=4",
             "--option", "trickle_keys_per_s=20"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip

        def rescaling() -> bool:
            if waiting.poll() is not None:
                pytest.fail(f"keyshift rescale ended early: {waiting.communicate()[0]}")
            return status_of("restarted").get("rescale") is not None

        try:
            wait_for(rescaling, 60, "the rescale to start")
            (coordinator,) = coordinators_of(run.pid)
            os.kill(coordinator, signal.SIGKILL)
            output, _ = waiting.communicate(timeout=120)
        finally:
            waiting.kill()
        assert waiting.returncode == 1, output
        assert "the coordinator restarted while rescale 1 ran" in output, output
        assert "done" not in output
        os.kill(run.pid, signal.SIGINT)
        run.communicate(timeout=120)
