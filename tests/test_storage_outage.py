"""Storage outages with real processes: they degrade the job, they do not kill it.

`keyshift run` of a checkpointed tracking job (tests.job_fns:track outputs each record's
(count, source, seq)) while its checkpoint storage, moto's S3 server, is stopped and started
again: the job keeps processing, its status says Degraded with the reason (as the operator's
CheckpointsFailing condition shows it), the coordinator counts the failed checkpoints and the
keyed instances their failed writes (keyshift_storage_failures_total{use="checkpoint"});
checkpoints resume once S3 is back, and at the end every record was applied exactly once.

A sink whose output disk (a small tmpfs) fills up stalls instead of failing: it says why in
its stats and keyshift_storage_failures_total{use="output_log"}, fails the checkpoints
meanwhile with the reason, backpressures the job, and once
space is freed the output is complete and exactly once.
"""

from __future__ import annotations

import os
import re
import signal
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from keyshift.operator.k8s_operator import observed_phase
from keyshift.runtime.generator import instance_total
from tests.conftest import cli, wait_for
from tests.prometheus_server import free_port
from tests.s3_server import MotoServer, create_bucket, s3_bucket, s3_options
from tests.small_disk import fill, small_disk
from tests.test_recovery import Run, coordinator_metrics
from tests.test_rescale import check_output, tracked_job

pytestmark = [pytest.mark.live, pytest.mark.slow]

SOURCE = {"kind": "generator", "keys": 2000, "distribution": "zipf", "seed": 23,
          "profile": {"rate": 3000}}  # fmt: skip


def start(tmp_path: Path, job: dict[str, Any]) -> tuple[Any, int]:
    """`keyshift run` of `job`: the cli context and the coordinator's port."""
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    port = free_port()
    args = ["run", str(job_file), "--no-view", "--port", str(port),
            "--log-dir", str(tmp_path / "logs")]  # fmt: skip
    return cli(args), port


def checkpoints(run: Run) -> dict[str, Any]:
    return (run.status_now() or {}).get("checkpoints") or {}


def output_offset(run: Run) -> int:
    """Records the sinks have written so far."""
    stages = {s["name"]: s for s in run.status()["stages"]}
    return sum(int(i["stats"].get("output_offset", 0)) for i in stages["sink"]["instances"])


def storage_failures(run: Run, stage: str, use: str) -> float:
    """keyshift_storage_failures_total{use} summed over the stage's instances, as exported."""
    stages = {s["name"]: s for s in run.status()["stages"]}
    total = 0.0
    for instance in stages[stage]["instances"]:
        with urllib.request.urlopen(f"http://{instance['metrics']}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        pattern = rf'keyshift_storage_failures_total\{{[^}}]*use="{use}"\}} (\S+)'
        total += sum(float(value) for value in re.findall(pattern, text))
    return total


def test_an_s3_outage_degrades_the_job_and_checkpoints_resume_after_it(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with MotoServer() as s3:
        bucket = s3_bucket(s3.url, "outage")
        job = tracked_job(out, SOURCE, keyed=2)
        job["checkpoints"] = {"interval": 0.5, "storage": f"s3://{bucket}/job",
                              "storage_options": s3_options(s3.url), "timeout": 20}  # fmt: skip
        context, port = start(tmp_path, job)
        with context as proc:
            run = Run(proc, f"127.0.0.1:{port}")
            try:
                wait_for(lambda: run.completed() >= 2, 90, "two checkpoints")
                s3.stop()
                wait_for(lambda: checkpoints(run).get("degraded"), 180, "the job to be degraded")
                status = run.status()
                phase, reason, message = observed_phase(status)
                assert (status["phase"], phase, reason) == (
                    "running",
                    "Degraded",
                    "CheckpointsFailing",
                ), message
                assert "Could not connect to the endpoint URL" in message, message
                failed = re.search(
                    r'keyshift_checkpoints_total\{[^}]*result="failed"[^}]*\} (\d+)',
                    coordinator_metrics(tmp_path),
                )
                assert failed is not None and int(failed.group(1)) >= 3
                assert storage_failures(run, "track", "checkpoint") >= 3
                written = output_offset(run)
                wait_for(lambda: output_offset(run) > written, 60, "records while S3 is down")
                s3.start()
                create_bucket(s3.url, bucket)  # moto lost its buckets with its process
                done = run.completed()
                wait_for(lambda: run.completed() > done, 120, "a checkpoint after the outage")
                assert not checkpoints(run)["degraded"]
                os.kill(proc.pid, signal.SIGINT)  # drain
                code = proc.wait(timeout=120)
            finally:
                run.client.close()
        assert code == 0, run.output.text()
    assert "Traceback" not in run.output.text()
    check_output(out, SOURCE, None)  # drained: what each source emitted is read off the output


def test_a_full_output_disk_stalls_the_sink_with_the_reason_and_loses_nothing(
    tmp_path: Path,
) -> None:
    total = 60_000
    source = {**SOURCE, "profile": {"rate": 4000}, "total": total}
    with small_disk(tmp_path / "disk", "16m") as disk:
        out = disk / "out"
        job = tracked_job(out, source, keyed=2)
        job["checkpoints"] = {"interval": 0.5, "storage": str(tmp_path / "checkpoints"),
                              "timeout": 10}  # fmt: skip
        filler = fill(disk, leave=256 * 1024)
        context, port = start(tmp_path, job)
        with context as proc:
            run = Run(proc, f"127.0.0.1:{port}")

            def stalled() -> list[str]:
                stages = {s["name"]: s for s in (run.status_now() or {}).get("stages", [])}
                sinks = stages["sink"]["instances"] if "sink" in stages else []
                return [i["stats"]["storage_error"] for i in sinks if "storage_error" in i["stats"]]

            try:
                errors = wait_for(stalled, 120, "the sink to stall on the full disk")
                assert "No space left on device" in errors[0], errors
                assert storage_failures(run, "sink", "output_log") >= 1
                wait_for(lambda: checkpoints(run).get("degraded"), 180, "the job to be degraded")
                phase, reason, message = observed_phase(run.status())
                assert (phase, reason) == ("Degraded", "CheckpointsFailing"), message
                assert "No space left on device" in message, message
                assert proc.poll() is None
                filler.unlink()  # space again
                code = proc.wait(timeout=180)
            finally:
                run.client.close()
            assert code == 0, run.output.text()
            check_output(out, source, [instance_total(total, s, 2) or 0 for s in range(2)])
