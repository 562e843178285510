"""Crash recovery with real processes: `kill -9` of a keyed instance, of the coordinator, and of
an instance in the middle of a hot-first migration, while `keyshift run` runs a checkpointed
job under load. The host restarts the job from its latest checkpoint; at the end every record
was applied exactly once and in order per key (tests.job_fns:track outputs each record's
(count, source, seq)), and the final counts equal the truth computed from the sources' seeds.
"""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path
from typing import Any

import pytest
import yaml

from keyshift.runtime.generator import instance_total
from keyshift.runtime.transport import JsonClient
from tests.conftest import children_of, cli, wait_for
from tests.prometheus_server import free_port
from tests.test_autoscaling_live import Output
from tests.test_checkpointing_live import checkpoints_of
from tests.test_rescale import SERVICE, check_output, tracked_job

pytestmark = pytest.mark.slow

TOTAL = 240_000
SOURCE = {"kind": "generator", "keys": 2000, "distribution": "zipf", "seed": 17,
          "profile": {"rate": 20000}, "total": TOTAL}  # fmt: skip


class Run:
    """`keyshift run` of a checkpointed tracking job, and its coordinator's status."""

    def __init__(self, proc: Any, address: str) -> None:
        self.proc = proc
        self.client = JsonClient(address, SERVICE)

    def status(self) -> dict[str, Any]:
        return self.client.call("Status", timeout=5.0)  # type: ignore[no-any-return]

    def completed(self) -> int:
        try:
            return int(checkpoints_of(self)["completed"])
        except Exception:  # the coordinator is restarting
            return 0

    def pid_of(self, stage: str, index: int) -> int:
        stages = {s["name"]: s for s in self.status()["stages"]}
        (instance,) = [i for i in stages[stage]["instances"] if i["index"] == index]
        return int(instance["pid"])


def run_and_crash(tmp_path: Path, crash: Any) -> None:
    out = tmp_path / "out"
    job = tracked_job(out, SOURCE, keyed=2)
    job["checkpoints"] = {"interval": 0.5, "storage": str(tmp_path / "checkpoints")}
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    port = free_port()
    with cli(["run", str(job_file), "--no-view", "--port", str(port),
              "--log-dir", str(tmp_path / "logs")]) as proc:  # fmt: skip
        output = Output(proc)
        run = Run(proc, f"127.0.0.1:{port}")
        try:
            wait_for(lambda: run.completed() >= 2, 60, "two checkpoints")
            crash(run)
            code = proc.wait(timeout=180)
        finally:
            run.client.close()
        assert code == 0, output.text()
    text = output.text()
    assert "recovered from checkpoint" in text, text
    emitted = [instance_total(TOTAL, s, 2) or 0 for s in range(2)]
    check_output(out, SOURCE, emitted)


def test_a_killed_keyed_instance_recovers_from_the_last_checkpoint(tmp_path: Path) -> None:
    def crash(run: Run) -> None:
        done = run.completed()
        wait_for(lambda: run.completed() > done + random.randint(0, 2), 30, "a checkpoint")
        os.kill(run.pid_of("track", random.randint(0, 1)), signal.SIGKILL)

    run_and_crash(tmp_path, crash)


def test_a_killed_coordinator_recovers_from_the_checkpoint_metadata(tmp_path: Path) -> None:
    def crash(run: Run) -> None:
        coordinators = [
            p for p in children_of(run.proc.pid)
            if "keyshift.runtime.coordinator" in " ".join(p.cmdline())
        ]  # fmt: skip
        assert len(coordinators) == 1
        coordinators[0].send_signal(signal.SIGKILL)

    run_and_crash(tmp_path, crash)


def test_a_kill_during_a_hot_first_migration_recovers(tmp_path: Path) -> None:
    def crash(run: Run) -> None:
        run.client.call("Rescale", {"stage": "track", "parallelism": 3, "strategy": "hot-first"})

        def moving() -> bool:
            rescale = run.status()["rescale"]
            return bool(rescale) and rescale["phase"] in ("moving", "retiring")

        wait_for(moving, 60, "the rescale to move state")
        os.kill(run.pid_of("track", 0), signal.SIGKILL)  # the old owner, mid-move

    run_and_crash(tmp_path, crash)
