"""`keyshift run` leaves no process behind: at its end, on Ctrl-C, and when a child dies."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import psutil
import pytest

from tests.conftest import children_of, cli, count_job, wait_for, write_job

pytestmark = pytest.mark.live

STEADY = {"kind": "generator", "keys": 1000, "profile": {"rate": 5000}}


def start_and_wait(tmp_path: Path, proc: subprocess.Popen[str]) -> list[psutil.Process]:
    """Wait until the host has started all five processes of the job."""
    return wait_for(lambda: len(kids := children_of(proc.pid)) == 5 and kids, 120, "5 children")


def assert_gone(children: list[psutil.Process]) -> None:
    alive = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"left behind: {[c.cmdline() for c in alive]}"


def job_file(tmp_path: Path) -> Path:
    return write_job(
        tmp_path,
        count_job(
            source={"config": STEADY},
            keyed={"name": "counts", "parallelism": 2},
            sink={"config": {"kind": "log", "path": str(tmp_path / "out")}},
        ),
    )


def test_normal_end_leaves_nothing(tmp_path: Path) -> None:
    with cli(["run", str(job_file(tmp_path)), "--duration", "2", "--no-view"]) as proc:
        children = start_and_wait(tmp_path, proc)
        output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output
    assert "finished" in output
    assert_gone(children)


def test_ctrl_c_drains_and_leaves_nothing(tmp_path: Path) -> None:
    with cli(["run", str(job_file(tmp_path)), "--no-view"]) as proc:
        children = start_and_wait(tmp_path, proc)
        os.kill(proc.pid, signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output
    assert "stopped by Ctrl-C" in output
    assert_gone(children)


def test_killed_child_fails_the_run_and_leaves_nothing(tmp_path: Path) -> None:
    with cli(["run", str(job_file(tmp_path)), "--no-view"]) as proc:
        children = start_and_wait(tmp_path, proc)
        victim = next(c for c in children if "counts" in c.cmdline() and "1" in c.cmdline())
        victim.kill()
        output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, output
    assert re.search(r"counts/1 \(pid \d+\) was killed by signal 9", output), output
    assert_gone(children)


def test_killed_host_takes_its_children_along(tmp_path: Path) -> None:
    with cli(["run", str(job_file(tmp_path)), "--no-view"]) as proc:
        children = start_and_wait(tmp_path, proc)
        proc.kill()
        proc.wait()
        wait_for(
            lambda: not [c for c in children if c.is_running() and c.status() != "zombie"],
            15,
            "the children to die with their host",
        )
