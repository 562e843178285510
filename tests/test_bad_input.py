"""Bad input and dead peers get clear errors, never a hang, and lose no valid records."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import psutil
import pytest

from keyshift.runtime.generator import KeyGenerator
from keyshift.runtime.job import GeneratorSource
from keyshift.runtime.output_log import OutputLogReader
from keyshift.runtime.transport import JsonClient
from tests.conftest import (
    children_of,
    cli,
    count_job,
    keyshift_main,
    running_job,
    wait_for,
    write_job,
)


@pytest.mark.live
def test_invalid_job_file_names_the_field_before_starting_anything(tmp_path: Path) -> None:
    path = write_job(tmp_path, count_job(keyed={"name": "Counts!", "parallelism": 0}))
    with cli(["run", str(path)]) as proc:
        output, _ = proc.communicate(timeout=30)
        assert not children_of(proc.pid)
    assert proc.returncode == 2
    assert "keyed.name" in output and "keyed.parallelism" in output
    assert "greater than or equal to 1" in output


def test_bad_cli_arguments_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """In process, not marked live: starting anything would fail the test."""
    for args in (["run", "nope.yaml", "--duration", "-1"], ["run", "nope.yaml", "--port", "x"]):
        code, output = keyshift_main(args, capsys)
        assert code == 2, output
    code, output = keyshift_main(["run", str(tmp_path / "missing.yaml")], capsys)
    assert code == 2 and "cannot read job file" in output


@pytest.mark.live
def test_operator_without_cluster_credentials_is_a_clear_error(tmp_path: Path) -> None:
    env = {**os.environ, "HOME": str(tmp_path), "KUBECONFIG": str(tmp_path / "none")}
    with cli(["operator", "--liveness-port", "0"], env=env) as proc:
        output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2, output
    assert "no Kubernetes credentials" in output and "KUBECONFIG" in output


@pytest.mark.live
def test_records_that_do_not_fit_are_counted_and_the_rest_kept(tmp_path: Path) -> None:
    total = 21_000
    source = {"kind": "generator", "keys": 100, "seed": 9, "total": total}
    out = tmp_path / "out"
    job = count_job(
        source={
            "config": source,
            "transforms": [{"map": "tests.job_fns:every_seventh_broken"}],
        },
        sink={"config": {"kind": "log", "path": str(out), "format": "jsonl"}},
    )
    log_dir = tmp_path / "logs"
    with cli(
        ["run", str(write_job(tmp_path, job)), "--no-view", "--log-dir", str(log_dir)]
    ) as proc:
        output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    assert "rejected 3,000" in output  # 3 of every 21 records are broken
    log = (log_dir / "source-0.log").read_text()
    assert "field 'key' should be int, got str" in log
    assert "missing field 'key'" in log
    assert "function_error ValueError: boom" in log

    keys, _ = KeyGenerator(GeneratorSource.model_validate(source), 0).records(0, total)
    truth = Counter(int(k) for seq, k in enumerate(keys) if seq % 7 != 0)
    table = OutputLogReader(out).read_all()
    got = dict(zip(table.column("key").to_pylist(), table.column("value").to_pylist(), strict=True))
    assert got == dict(truth)


@pytest.mark.live
def test_coordinator_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        path = write_job(tmp_path, count_job())
        with cli(["run", str(path), "--port", str(port), "--no-view"]) as proc:
            output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert f"127.0.0.1:{port}" in output and "already in use" in output


@pytest.mark.live
def test_missing_instance_fails_registration_with_names(tmp_path: Path) -> None:
    path = write_job(tmp_path, count_job())
    ready = tmp_path / "ready.json"
    coordinator = subprocess.Popen(
        [sys.executable, "-P", "-m", "keyshift.runtime.coordinator", "--job", str(path),
         "--ready-file", str(ready), "--register-timeout", "1"],
    )  # fmt: skip
    try:
        info = wait_for(lambda: ready.exists() and ready.read_text(), 20, "the coordinator")
        client = JsonClient(
            f"127.0.0.1:{__import__('json').loads(info)['port']}", "keyshift.Coordinator"
        )
        status = wait_for(
            lambda: (s := client.call("Status"))["phase"] == "failed" and s,
            20,
            "registration to fail",
        )
        assert "did not register within 1 s" in status["errors"][0]
        assert "source/0" in status["errors"][0] and "counts/1" in status["errors"][0]
        client.close()
    finally:
        coordinator.kill()
        coordinator.wait()


@pytest.mark.live
def test_dead_coordinator_fails_the_run_and_stops_instances(tmp_path: Path) -> None:
    job = count_job(
        source={"config": {"kind": "generator", "keys": 100, "profile": {"rate": 2000}}}
    )
    with cli(
        ["run", str(write_job(tmp_path, job)), "--no-view", "--log-dir", str(tmp_path / "l")]
    ) as proc:
        children = wait_for(lambda: len(k := children_of(proc.pid)) == 5 and k, 120, "5 children")
        coordinator = next(c for c in children if "keyshift.runtime.coordinator" in c.cmdline())
        coordinator.kill()
        output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "coordinator" in output and "killed by signal 9" in output
    for child in children:
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE


@pytest.mark.live
def test_instances_exit_on_their_own_when_the_coordinator_dies(tmp_path: Path) -> None:
    job = count_job(
        source={"config": {"kind": "generator", "keys": 100, "profile": {"rate": 2000}}}
    )
    with running_job(tmp_path, job) as local:
        wait_for(lambda: local.status()["phase"] == "running", 120, "the job to run")
        assert local.coordinator is not None
        local.coordinator.process.kill()
        wait_for(
            lambda: all(c.exit_code() is not None for c in local.instances.values()),
            20,
            "instances to notice the lost coordinator",
        )
        codes = {name: c.exit_code() for name, c in local.instances.items()}
        assert all(code == 1 for code in codes.values()), codes
        assert "lost the coordinator" in local.instances["counts/0"].tail()
