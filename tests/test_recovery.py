"""Crash recovery with real processes: `kill -9` of a keyed instance, of the coordinator, and of
an instance in the middle of a hot-first migration, while `keyshift run` runs a checkpointed
job under load. The host restarts the job from its latest checkpoint; at the end every record
was applied exactly once and in order per key (tests.job_fns:track outputs each record's
(count, source, seq)), and the final counts equal the truth computed from the sources' seeds.

A job fed through its ingest endpoint recovers the same way when its source instance is
killed: what the endpoint acknowledged is replayed from its log, a client's retry is applied
once, and a reader of the output log never sees a record that the recovery makes again.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import yaml

from keyshift.runtime.checkpoint_store import CheckpointStore
from keyshift.runtime.generator import instance_total
from keyshift.runtime.ingest_client import IngestClient, IngestError
from keyshift.runtime.metrics import JOB_LABEL, MetricName
from keyshift.runtime.output_log import OutputLogReader
from keyshift.runtime.transport import JsonClient, TransportError
from tests.conftest import STATE_BACKENDS, cli, coordinators_of, state_settings, wait_for
from tests.prometheus_server import free_port
from tests.test_autoscaling_live import Output
from tests.test_rescale import SERVICE, applied_once, check_output, tracked_job

pytestmark = [pytest.mark.live, pytest.mark.slow]

# 6 s at 5k records/s: the crashes come within the first few, and a restored source goes on
# from its checkpoint's place on this clock (a recovery that ends after the sources' last
# records still replays them). The checks hold at any rate; the time they need does not
# shrink with it, the CPU the suite spends does.
TOTAL = 30_000
SOURCE = {"kind": "generator", "keys": 2000, "distribution": "zipf", "seed": 17,
          "profile": {"rate": 5000}, "total": TOTAL}  # fmt: skip
# For crashes that must come while the sources run, however long the steps before them take.
UNBOUNDED = {k: v for k, v in SOURCE.items() if k != "total"}


class Run:
    """`keyshift run` of a checkpointed tracking job, its output, and its coordinator's
    status."""

    def __init__(self, proc: Any, address: str) -> None:
        self.proc = proc
        self.output = Output(proc)
        self.client = JsonClient(address, SERVICE)

    def status(self) -> dict[str, Any]:
        return self.client.call("Status", timeout=5.0)

    def status_now(self) -> dict[str, Any] | None:
        """The status, or None while the coordinator is (re)starting: for polling."""
        try:
            return self.status()
        except TransportError:
            return None

    def completed(self) -> int:
        status = self.status_now()
        return int(status["checkpoints"]["completed"]) if status else 0

    def ingest_address(self) -> str | None:
        status = self.status_now()
        instances = status["stages"][0]["instances"] if status else []
        return instances[0]["stats"].get("ingest_address") if instances else None

    def pid_of(self, stage: str, index: int) -> int:
        stages = {s["name"]: s for s in self.status()["stages"]}
        (instance,) = [i for i in stages[stage]["instances"] if i["index"] == index]
        return int(instance["pid"])


def start_run(tmp_path: Path, job: dict[str, Any]) -> tuple[Any, int]:
    """`keyshift run` of `job` with checkpoints every 0.5 s: the cli context and its port."""
    job["checkpoints"] = {"interval": 0.5, "storage": str(tmp_path / "checkpoints")}
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    port = free_port()
    args = ["run", str(job_file), "--no-view", "--port", str(port),
            "--log-dir", str(tmp_path / "logs")]  # fmt: skip
    return cli(args), port


def recover_through(
    tmp_path: Path, job: dict[str, Any], crash: Callable[[Run], None], drain: bool = False
) -> str:
    """Run `job` with checkpoints, `crash` it after two, and see it recover and end well: by
    itself, or with `drain` (for sources without a total) drained once it has recovered and
    taken a checkpoint since. The run's output."""
    context, port = start_run(tmp_path, job)
    with context as proc:
        run = Run(proc, f"127.0.0.1:{port}")
        output = run.output
        try:
            wait_for(lambda: run.completed() >= 2, 120, "two checkpoints")
            crash(run)
            if drain:
                wait_for(lambda: recovered_and_running(run), 180, "the job to run again")
                done = run.completed()
                wait_for(lambda: run.completed() > done, 60, "a checkpoint after the recovery")
                os.kill(proc.pid, signal.SIGINT)
            code = proc.wait(timeout=180)
        finally:
            run.client.close()
        assert code == 0, output.text()
    text = output.text()
    assert "recovered from checkpoint" in text, text
    return text


def run_and_crash(
    tmp_path: Path,
    crash: Any,
    backend: str = "memory",
    source: dict[str, Any] = SOURCE,
    **job: Any,
) -> None:
    """`recover_through` a tracking job of two sources and two keyed instances on `backend`;
    a `source` without a total runs until the job has recovered, then drains."""
    out = tmp_path / "out"
    state = state_settings(backend, tmp_path)
    total = source.get("total")
    job = {**tracked_job(out, source, 2, state=state), **job}
    recover_through(tmp_path, job, crash, drain=total is None)
    emitted = None if total is None else [instance_total(total, s, 2) or 0 for s in range(2)]
    check_output(out, source, emitted)


def pids(run: Run) -> dict[str, int]:
    """Every instance's pid, by name."""
    return {
        f"{stage['name']}/{i['index']}": int(i["pid"])
        for stage in run.status()["stages"]
        for i in stage["instances"]
    }


def recovered(run: Run) -> dict[str, Any] | None:
    """The last recovery the coordinator recorded, once there is one."""
    status = run.status_now()
    return (status["recoveries"].get("last") if status else None) or None


def recovered_and_running(run: Run) -> bool:
    """Whether the job has recovered (locally or by a restart) and runs again."""
    status = run.status_now()
    return bool(status and status["recoveries"].get("last") and status["phase"] == "running")


@pytest.mark.parametrize("backend", STATE_BACKENDS)
def test_a_killed_keyed_instance_recovers_from_the_last_checkpoint(
    tmp_path: Path, backend: str
) -> None:
    """Locally: only the lost instance is started again; the coordinator, the sources, the
    other keyed instance and the sinks rewind in place (their processes stay)."""

    def crash(run: Run) -> None:
        done = run.completed()
        wait_for(lambda: run.completed() > done + random.randint(0, 2), 120, "a checkpoint")
        before, coordinators = pids(run), coordinator_pids(run)
        killed = f"track/{random.randint(0, 1)}"
        os.kill(before[killed], signal.SIGKILL)
        last = wait_for(lambda: recovered(run), 60, "the local recovery")
        assert last["mode"] == "local" and last["reason"].startswith(f"instance {killed}"), last
        after = pids(run)
        assert after.pop(killed) != before.pop(killed)
        assert after == before and coordinator_pids(run) == coordinators

    run_and_crash(tmp_path, crash, backend)


def test_a_loss_during_a_local_recovery_falls_back_to_the_global_restart(tmp_path: Path) -> None:
    """Both keyed instances die at once: the second is lost while the first one's local
    recovery waits for its replacement, and the job restarts as a whole instead."""

    def crash(run: Run) -> None:
        first, second = run.pid_of("track", 0), run.pid_of("track", 1)
        os.kill(first, signal.SIGKILL)
        os.kill(second, signal.SIGKILL)

    run_and_crash(tmp_path, crash)
    (recovery,) = CheckpointStore(str(tmp_path / "checkpoints")).recoveries()
    assert recovery["mode"] == "global", recovery
    assert "and the local recovery failed: instance track/" in recovery["reason"], recovery


def test_a_killed_sink_instance_recovers_and_its_output_is_published_once(tmp_path: Path) -> None:
    """A sink holds no keyed state but owns an output log whose tail past the checkpoint is
    unpublished: the recovery truncates it and the replay writes it again, once."""

    def crash(run: Run) -> None:
        done = run.completed()
        wait_for(lambda: run.completed() > done, 120, "a checkpoint")
        os.kill(run.pid_of("sink", random.randint(0, 1)), signal.SIGKILL)

    run_and_crash(tmp_path, crash)


def test_a_hung_instance_is_lost_by_its_silence_and_the_job_recovers(tmp_path: Path) -> None:
    """SIGSTOP: the process lives and its connections stay open, as on a node that is gone;
    the coordinator notices that it stopped reporting."""

    def crash(run: Run) -> None:
        os.kill(run.pid_of("track", 1), signal.SIGSTOP)  # the host's halt kills it

    run_and_crash(tmp_path, crash, heartbeat_timeout=2)
    log = (tmp_path / "logs" / "coordinator.log").read_text()
    assert "instance track/1" in log and "it sent no report for 2 s" in log, log[-2000:]


def test_a_recovery_waits_for_checkpoint_storage_that_is_down(tmp_path: Path) -> None:
    """The checkpoint directory is gone (a file in its place: every read and write fails)
    when a keyed instance dies: the host waits for the storage, retrying with backoff, and
    recovers once it is back."""
    storage = tmp_path / "checkpoints"
    away = tmp_path / "checkpoints-away"

    def crash(run: Run) -> None:
        storage.rename(away)
        storage.write_text("the storage is down")
        os.kill(run.pid_of("track", 0), signal.SIGKILL)
        wait_for(lambda: run.output.has("looking for a checkpoint to recover from"), 60, "a retry")
        assert run.proc.poll() is None, run.output.text()
        storage.unlink()
        away.rename(storage)

    run_and_crash(tmp_path, crash)


def test_a_killed_coordinator_recovers_from_the_checkpoint_metadata(tmp_path: Path) -> None:
    def crash(run: Run) -> None:
        (coordinator,) = coordinator_pids(run)
        os.kill(coordinator, signal.SIGKILL)

    run_and_crash(tmp_path, crash)


def coordinator_pids(run: Run) -> list[int]:
    return coordinators_of(run.proc.pid)


def test_a_coordinator_killed_during_a_recovery_is_restarted_again(tmp_path: Path) -> None:
    """A failure during a recovery is retried, not fatal: the coordinator the host restarted
    after an instance's kill is killed as soon as it is there, before it is up; the host
    restarts the job once more, after the restart strategy's delay."""

    def crash(run: Run) -> None:
        (first,) = coordinator_pids(run)
        os.kill(run.pid_of("track", 0), signal.SIGKILL)
        restarted = wait_for(
            lambda: [p for p in coordinator_pids(run) if p != first], 30, "the restart"
        )
        os.kill(restarted[0], signal.SIGKILL)

    # The global restart's path: a local recovery keeps the coordinator.
    run_and_crash(tmp_path, crash, restart={"initial_delay": 0.2}, recovery="global")
    # The second restart (the first one's log was cut short by the kill) recovered.
    log = (tmp_path / "logs" / "coordinator-recovery-2.log").read_text()
    assert "recovered (global) from checkpoint" in log, log[-2000:]


@pytest.mark.parametrize("last", ["track/1", "coordinator"])
def test_the_restart_strategy_gives_up_after_its_attempts(tmp_path: Path, last: str) -> None:
    """Two local recoveries are the two attempts allowed, the second after the strategy's
    delay; the third loss fails the run, whether the coordinator would recover it locally (its
    strategy gives up) or the host would restart the job (its strategy counted both)."""
    out = tmp_path / "out"
    # 12 s of records: the job must still run at the third loss, after two recoveries.
    source = {**SOURCE, "total": 2 * TOTAL}
    job = {**tracked_job(out, source, 2), "restart": {"max_attempts": 2, "initial_delay": 0.5}}
    context, port = start_run(tmp_path, job)
    with context as proc:
        run = Run(proc, f"127.0.0.1:{port}")
        local = lambda: sum("recovered locally from" in line for line in run.output.lines)  # noqa: E731
        try:
            # Generous: on a loaded machine the processes alone have taken a minute to start.
            wait_for(lambda: run.completed() >= 2, 180, "two checkpoints")
            for attempt in (1, 2):
                os.kill(run.pid_of("track", 0), signal.SIGKILL)
                wait_for(lambda: local() == attempt, 60, f"local recovery {attempt}")  # noqa: B023
            second = recovered(run) or {}
            assert second.get("mode") == "local" and second["seconds"] >= 0.5, second
            (coordinator,) = coordinator_pids(run)
            victim = coordinator if last == "coordinator" else run.pid_of("track", 1)
            os.kill(victim, signal.SIGKILL)
            code = proc.wait(timeout=60)
        finally:
            run.client.close()
    text = run.output.text()
    assert code == 1, text
    assert "not restarted again: 3 failures in a row" in text, text
    assert "restart.max_attempts allows 2 restarts" in text, text
    assert f"{last} (pid {victim})" in text, text


@pytest.mark.parametrize("backend", STATE_BACKENDS)
def test_a_kill_during_a_hot_first_migration_recovers(tmp_path: Path, backend: str) -> None:
    killed: list[int] = []

    def crash(run: Run) -> None:
        # A slow trickle: the push of the ~700 moving keys lasts seconds, however busy the
        # machine, so the kill lands in the middle of it. Moved directly: a hand-over from
        # the checkpoint would push only the last half second's changes, over in a moment
        # (tests/test_handover.py kills one mid-switch).
        slow = {"chunk_keys": 8, "trickle_keys_per_s": 200, "handover": 0}
        run.client.call("Rescale", {"stage": "track", "parallelism": 3, "strategy": "hot-first",
                                    "options": slow})  # fmt: skip

        def moving_out_of() -> list[int]:
            """The old owners whose subscales are moving state now."""
            rescale = (run.status_now() or {}).get("rescale") or {}
            shown = (rescale.get("subscales") or {}).get("shown", [])
            return [s["sources"][0] for s in shown if s["phase"] == "moving"]

        killed.append(wait_for(moving_out_of, 60, "the rescale to move state")[0])
        os.kill(run.pid_of("track", killed[0]), signal.SIGKILL)  # an old owner, mid-move

    # No total: at load 12-20 the move was once not seen within 60 s, the new instance's start
    # taking so long that 12 s of records had ended; the job drains once it has recovered.
    # Uniform keys: the planner balances load, and with Zipf keys a 2 -> 3 moved as few as 8 hot
    # groups of 9 keys, pushed in a moment even at the trickle (the move was missed).
    run_and_crash(tmp_path, crash, backend, UNBOUNDED | {"distribution": "uniform"})
    # The true reason, however it was noticed: the old owner's command stream breaking, or the
    # new owner's fetch from it failing (which once failed the new owner instead, and the
    # recovery was recorded as "the coordinator was lost").
    recovery = CheckpointStore(str(tmp_path / "checkpoints")).recoveries()[0]
    assert recovery["reason"].startswith(f"instance track/{killed[0]}"), recovery


def test_a_kill_during_a_native_checkpoint_upload_recovers(tmp_path: Path) -> None:
    """A keyed instance on RocksDB is stopped while it uploads a checkpoint's files (its
    RocksDB checkpoint directory exists only then; a stop that missed it is undone, and the
    next checkpoint tried), then killed: the recovery restores the last completed checkpoint,
    ignores the half-uploaded one, and starts on a clean state directory."""
    instance = tmp_path / "state" / "t" / "track-0"
    caught: list[str] = []

    def crash(run: Run) -> None:
        pid = run.pid_of("track", 0)
        deadline = time.monotonic() + 60
        while not caught and time.monotonic() < deadline:
            if any(p.name.startswith("checkpoint-") for p in instance.iterdir()):
                os.kill(pid, signal.SIGSTOP)
                # Still there once stopped: the stop landed inside the upload.
                caught.extend(
                    p.name for p in instance.iterdir() if p.name.startswith("checkpoint-")
                )
                if not caught:
                    os.kill(pid, signal.SIGCONT)
        assert caught, "no checkpoint upload was caught within 60 s"
        os.kill(pid, signal.SIGKILL)

    run_and_crash(tmp_path, crash, "rocksdb")
    assert not any(p.name.startswith("checkpoint-") for p in instance.iterdir()), caught


def coordinator_metrics(tmp_path: Path) -> str:
    """What the running coordinator of `start_run`'s job exports."""
    ready = json.loads((tmp_path / "logs" / "coordinator.ready").read_text())
    with urllib.request.urlopen(f"http://127.0.0.1:{ready['metrics_port']}/metrics") as reply:
        return reply.read().decode()


class Pusher:
    """Pushes batches of known rows into an ingest endpoint on a thread, each with its batch id,
    retrying a batch until it is acknowledged (applied now, or before: a duplicate)."""

    RETRY = frozenset({"UNAVAILABLE", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "CANCELLED"})

    def __init__(self, endpoint: str, batches: int, rows: int) -> None:
        rng = np.random.default_rng(5)
        self.tables = [
            pa.table({"key": rng.zipf(1.2, rows) % 500, "value": np.ones(rows)})
            for _ in range(batches)
        ]
        self.endpoint = endpoint
        self.acked = 0
        self.retries = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for i, table in enumerate(self.tables):
                while not self._push(table, f"b{i}"):
                    self.retries += 1
                self.acked += 1
                threading.Event().wait(0.02)  # a steady stream, still flowing at the crash
        except BaseException as exc:  # reported by the test
            self.error = exc

    def _push(self, table: pa.Table, batch_id: str) -> bool:
        try:
            with IngestClient(self.endpoint) as client:
                client.push(table, batch_id=batch_id, timeout=10)
            return True
        except IngestError as exc:
            if exc.code is None or exc.code.name not in self.RETRY:
                raise
            threading.Event().wait(0.1)
            return False

    def truth(self) -> Counter[int]:
        return Counter(k for t in self.tables for k in t.column("key").to_pylist())


class LogWatcher:
    """Reads the output log on a thread as a Spark sink query would, remembering each record
    it saw by (partition, offset)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen: dict[tuple[int, int], tuple[Any, ...]] = {}
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        ends: dict[int, int] = {}
        try:
            while not self.stop.wait(0.1):
                if not self.path.exists():
                    continue
                reader = OutputLogReader(self.path)
                for p in reader.partitions():
                    for row in reader.read(p, ends.get(p, 0)).to_pylist():
                        self.seen[(p, row["offset"])] = tuple(row.values())
                        ends[p] = row["offset"] + 1
        except BaseException as exc:  # reported by the test
            self.error = exc


def test_a_killed_ingest_source_replays_what_it_acknowledged(tmp_path: Path) -> None:
    out = tmp_path / "out"
    job = tracked_job(out, {"kind": "ingest"}, keyed=2, sources=1)
    context, port = start_run(tmp_path, job)
    with context as proc:
        run = Run(proc, f"127.0.0.1:{port}")
        output = run.output
        watcher = LogWatcher(out)
        try:
            endpoint = wait_for(run.ingest_address, 60, "the ingest endpoint")
            pusher = Pusher(endpoint, batches=300, rows=200)
            wait_for(lambda: run.completed() >= 2 and pusher.acked > 60, 60, "checkpoints")
            os.kill(run.pid_of("source", 0), signal.SIGKILL)
            recoveries = lambda: (run.status_now() or {}).get("recoveries") or {}  # noqa: E731
            wait_for(lambda: recoveries().get("total"), 60, "the recovery")
            last = recoveries()["last"]
            assert last["reason"].startswith("instance source/0") and last["seconds"] > 0, last
            assert f'{MetricName.RECOVERIES}{{{JOB_LABEL}="t"}} 1.0' in coordinator_metrics(
                tmp_path
            )
            wait_for(lambda: pusher.acked == 300 or pusher.error, 120, "every batch acked")
            assert pusher.error is None, pusher.error
            os.kill(proc.pid, signal.SIGINT)  # drain
            code = proc.wait(timeout=60)
        finally:
            run.client.close()
            watcher.stop.set()
            watcher.thread.join(timeout=10)
        assert code == 0, output.text()
    assert watcher.error is None, watcher.error
    counts, seen = applied_once(out)
    assert counts == pusher.truth()
    assert seen == {(0, q) for q in range(300 * 200)}
    final = OutputLogReader(out).read_all(with_partition=True).to_pylist()
    now = {(row.pop("partition"), row["offset"]): tuple(row.values()) for row in final}
    changed = [key for key, row in watcher.seen.items() if now.get(key) != row]
    assert not changed, f"records read during the run changed afterwards: {changed[:5]}"
    assert len(watcher.seen) > 0
    assert "recovered from checkpoint" in output.text()
    assert pusher.retries > 0  # the crash interrupted the stream
