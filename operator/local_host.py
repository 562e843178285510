"""The local host: runs a job as processes on this machine (`keyshift run`).

Starts the coordinator and one process per stage instance on loopback, watches them, drains the
job at the end of its duration or on Ctrl-C, and stops every process it started on every path,
crashes included. A child that dies makes the run fail with its name and last log lines.
Used by `keyshift.operator.cli`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keyshift.operator.processes import Child
from keyshift.operator.state_memory import PROCESS_ENV
from keyshift.runtime.auth import Security
from keyshift.runtime.checkpoint_store import CheckpointError, CheckpointMeta, CheckpointStore
from keyshift.runtime.coordinator import RESTART_EXIT_CODE
from keyshift.runtime.job import JobSpec
from keyshift.runtime.job_secret import SECRET_ENV, load_job_secret, new_job_secret
from keyshift.runtime.restart_strategy import counting_local
from keyshift.runtime.storage import retrying
from keyshift.runtime.transport import JsonClient, TransportError

log = logging.getLogger("keyshift.host")

COORDINATOR_SERVICE = "keyshift.Coordinator"
STATUS_INTERVAL = 0.5
RECOVERY_STATUS_INTERVAL = 0.05  # while a local recovery waits for its replacement
LOST_GRACE = 3.0
# Seconds a coordinator that stopped answering gets to be seen exiting (see _observe).
EXIT_GRACE = 2.0


class RunError(RuntimeError):
    """The job could not start or did not finish cleanly; the message says which part and why."""


class GaveUp(RunError):
    """The coordinator's restart strategy gave up on a lost instance: not restarted again."""


@dataclass
class RunResult:
    status: dict[str, Any]
    interrupted: bool
    log_dir: Path
    history: list[dict[str, Any]] = field(default_factory=list)


class LocalJob:
    """A job's processes on this machine; use as a context manager so they always stop."""

    def __init__(
        self,
        spec: JobSpec,
        job_file: Path,
        log_dir: Path | None = None,
        host: str = "127.0.0.1",
        coordinator_port: int = 0,
        start_timeout: float = 30.0,
        register_timeout: float = 30.0,
    ) -> None:
        self.spec = spec
        self.job_file = job_file
        self.host = host
        self.coordinator_port = coordinator_port
        self.start_timeout = start_timeout
        self.register_timeout = register_timeout
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix=f"keyshift-{spec.name}-"))
        self.coordinator: Child | None = None
        self.instances: dict[str, Child] = {}
        # Per keyed stage, its idle pre-started instances (`standby: N`), not yet given an index.
        self.standbys: dict[str, list[Child]] = {s.stage.name: [] for s in spec.keyed_stages()}
        self._standbys_started = 0
        self.client: JsonClient | None = None
        self.address = ""
        self.coordinator_metrics_port = 0
        # Every run has a secret: the caller's (so clients it starts share it), else a new one.
        secret = load_job_secret() or new_job_secret().encode()
        self.env = {**PROCESS_ENV, SECRET_ENV: secret.decode()}
        self.security = Security.from_env({**os.environ, **self.env})
        self._dead_since: dict[str, float] = {}
        # {"reason", "checkpoint", "seconds", "mode"}: global (restarted here) or local (the
        # coordinator's, replacing a lost instance alone)
        self.recoveries: list[dict[str, Any]] = []
        # When (wall clock, as the coordinator's record) each failure the restart strategy
        # counts happened: the restarts made here and the coordinator's local recoveries.
        self.failures: list[float] = []
        self.restarts = 0  # restarts made here (each restarted coordinator's log is numbered)
        self.started = time.time()  # the coordinator counts the failures recorded since

    def __enter__(self) -> LocalJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def children(self) -> list[Child]:
        return [*self._members(), *(c for waiting in self.standbys.values() for c in waiting)]

    def _members(self) -> list[Child]:
        """The coordinator and the instances: the processes whose death fails the run."""
        return [*([self.coordinator] if self.coordinator else []), *self.instances.values()]

    def start(self, restore: bool = False) -> None:
        """Start the coordinator and every instance; with `restore`, from the latest valid
        checkpoint (the coordinator says how many keyed instances it had)."""
        ready = self.log_dir / "coordinator.ready"
        ready.unlink(missing_ok=True)
        self.coordinator = Child(
            "coordinator",
            [
                "-m", "keyshift.runtime.coordinator",
                "--job", str(self.job_file),
                "--host", self.host,
                "--port", str(self.coordinator_port),
                "--ready-file", str(ready),
                "--register-timeout", str(self.register_timeout),
                "--failures-since", repr(self.started),
                *(["--restore"] if restore else []),
            ],
            self.log_dir / ("coordinator.log" if not restore else
                            f"coordinator-recovery-{self.restarts}.log"),
            self.env,
        )  # fmt: skip
        deadline = time.monotonic() + self.start_timeout
        while not ready.exists():
            code = self.coordinator.exit_code()
            if code is not None:
                raise RunError(self._crash_message(self.coordinator, code))
            if time.monotonic() > deadline:
                raise RunError(f"coordinator did not start within {self.start_timeout:.0f} s")
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        # A restarted coordinator binds the same port: clients (the autoscaler's) keep working.
        self.coordinator_port = int(info["port"])
        self.address = f"{self.host}:{info['port']}"
        self.coordinator_metrics_port = int(info["metrics_port"])
        if self.client is None:
            self.client = JsonClient(self.address, COORDINATOR_SERVICE, self.security)
        if restore:
            # The client's channel saw the old coordinator die: wait until it has reconnected.
            self.client.wait_ready(self.start_timeout)
            self.ensure_instances(self.status())
            return
        for stage in self.spec.stages():
            for index in range(stage.parallelism):
                self.start_instance(stage.name, index)
        self.ensure_standbys()

    def recoverable(self, stop: threading.Event) -> CheckpointMeta | None:
        """The checkpoint a recovery would go on from: only with checkpoints and a valid one
        (without one, a fresh start would repeat output). Both kinds of source replay from a
        checkpoint: a generator recomputes, an ingest source keeps a log. Checkpoint storage
        that cannot be reached is waited for, with backoff, until `stop`."""
        settings = self.spec.checkpoints
        if settings is None:
            return None
        try:
            store = CheckpointStore(settings.storage, settings.storage_options)
            return retrying(store.latest_valid, "looking for a checkpoint to recover from", stop)
        except CheckpointError:
            return None

    def halt(self) -> None:
        """Kill every process of the job at once (a recovery restarts them)."""
        for child in self.children():
            child.stop(grace=0)

    def recover(self, reason: str, checkpoint: CheckpointMeta, failed: float) -> None:
        """Stop every process and start the job again from `checkpoint`: each keyed instance
        reloads its groups, each sink rewinds its output log, each source replays from its
        position. Whatever was in flight is made again from the sources. The recovery is
        timed from `failed` (monotonic), the failure that started it."""
        self.halt()
        self.instances.clear()
        for waiting in self.standbys.values():
            waiting.clear()
        self._dead_since.clear()
        self.recoveries.append(
            {"reason": reason, "checkpoint": checkpoint.id, "seconds": None, "mode": "global"}
        )
        self.start(restore=True)
        self.recoveries[-1]["started"] = failed

    def restart(self, failure: RunError, interrupted: threading.Event) -> None:
        """Restart the job from its latest checkpoint after `failure`, as its restart strategy
        says: after a growing delay, and a restart that fails in turn (the restarted
        coordinator lost while it starts) is a failure like any other. RunError when the job
        cannot go on: no checkpoints, no valid one, the strategy gives up (here or in the
        coordinator), or Ctrl-C."""
        if self.spec.checkpoints is None or isinstance(failure, GaveUp):
            raise failure
        reason = str(failure)
        first = time.monotonic()
        while True:
            now = time.time()
            decision = self.spec.restart.decide(self.failures, now)
            self.failures = self.spec.restart.kept([*self.failures, now])
            self.restarts += 1
            # Nothing may write checkpoints (or delete old ones) while we pick one.
            self.halt()
            if decision.delay is None:
                raise RunError(f"{reason}\n  not restarted again: {decision.why}")
            if decision.delay:
                log.warning("restarting in %.1f s (%s)", decision.delay, decision.why)
            if interrupted.wait(decision.delay):
                raise failure
            checkpoint = self.recoverable(interrupted)
            if checkpoint is None:
                raise failure
            log.warning("recovering from checkpoint %d: %s", checkpoint.id, reason)
            try:
                self.recover(reason, checkpoint, first)
                return
            except (RunError, TransportError) as exc:
                log.warning("the restart failed: %s", exc)
                self.recoveries.pop()  # not recovered: the next attempt is the recovery
                reason = f"{reason}\n  and the restart failed: {exc}"

    def replace(self, status: dict[str, Any]) -> None:
        """Start again, alone, the instances a local recovery replaces (keyshift.runtime.
        local_recovery), unless a replacement runs (the lost process, hung, is stopped first);
        and take its record once it is over."""
        for name, lost in status.get("replacing", {}).items():
            child = self.instances.get(name)
            if child is None or child.pid == lost or child.exit_code() is not None:
                stage, _, index = name.rpartition("/")
                log.warning("starting %s again (a local recovery)", name)
                self.start_instance(stage, int(index))
        last = status["recoveries"].get("last") or {}
        if (
            last.get("mode") == "local"
            and last["failed_at"] >= self.started  # not an earlier run's, on the same storage
            and not any(r.get("failed_at") == last["failed_at"] for r in self.recoveries)
        ):
            self.recoveries.append(dict(last))
            # Said once counted: a failure from now on is one more of the series.
            self.failures = self.spec.restart.kept(counting_local(self.failures, last))
            log.warning("recovered locally from checkpoint %s (counted by the restart "
                        "strategy)", last.get("checkpoint"))  # fmt: skip

    def ensure_instances(self, status: dict[str, Any]) -> None:
        """Start the instances the coordinator wants and nobody runs (a scale-out): standbys
        a scale-out took are those instances already; then replace the standbys taken or
        dead."""
        for stage in status["stages"]:
            self.promote(stage["name"], [*stage.get("standbys", []), *stage["instances"]])
            registered = {i["index"] for i in stage["instances"]}
            self.ensure(stage["name"], stage["desired"], registered)
        if status["phase"] in ("starting", "running"):  # standbys of a stopping job exit
            self.ensure_standbys()

    def promote(self, stage: str, members: list[dict[str, Any]]) -> None:
        """The standbys the coordinator gave an index (a standby taken, or an instance that
        registered already) become that instance here."""
        taken = {s["pid"]: s["index"] for s in members if s["index"] is not None}
        for child in list(self.standbys.get(stage, [])):
            index = taken.get(child.pid)
            if index is None:
                continue
            self.standbys[stage].remove(child)
            name = f"{stage}/{index}"
            if name in self.instances:
                self.instances[name].stop(grace=0)  # an exited, retired predecessor
            child.name = name
            self.instances[name] = child

    def ensure_standbys(self) -> None:
        """Keep `standby` idle instances of each keyed stage: a dead one is replaced, not a
        failure of the job."""
        for step in self.spec.keyed_stages():
            stage = step.stage.name
            waiting = [c for c in self.standbys[stage] if c.exit_code() is None]
            for child in self.standbys[stage]:
                if child not in waiting:
                    log.warning("standby %s (pid %d) exited; replacing it", child.name, child.pid)
                    child.stop(grace=0)
            while len(waiting) < step.stage.standby:
                self._standbys_started += 1
                number = self._standbys_started
                waiting.append(
                    self.instance_child(f"{stage}/standby-{number}", stage, ["--standby"])
                )
            self.standbys[stage] = waiting

    def ensure(self, stage: str, parallelism: int, registered: Collection[int] = ()) -> None:
        """Have instances 0..parallelism-1 of `stage` running: the local WorkerPool. A retired
        instance (exited cleanly, no longer registered) may be started again."""
        for index in range(parallelism):
            child = self.instances.get(f"{stage}/{index}")
            if child is None or (child.exit_code() == 0 and index not in registered):
                self.start_instance(stage, index)

    def shrink(self, stage: str, parallelism: int) -> None:
        """Nothing to do: retired instances exit by themselves (and `ensure` may start their
        indexes again later)."""

    def match(self, stage: str, parallelism: int) -> None:
        """Nothing to do: the run loop starts what the coordinator wants on every status
        (`ensure_instances`), and retired instances exit by themselves."""

    def start_instance(self, stage: str, index: int) -> Child:
        name = f"{stage}/{index}"
        if name in self.instances:
            self.instances[name].stop(grace=0)  # an exited, retired predecessor
        child = self.instance_child(name, stage, ["--index", str(index)])
        self.instances[name] = child
        return child

    def instance_child(self, name: str, stage: str, role: list[str]) -> Child:
        """An instance process of `stage` (`role`: its index, or a standby's flag), logging to
        `<name with - for />.log` in the job's log directory."""
        args = ["-m", "keyshift.runtime.instance", "--coordinator", self.address,
                "--stage", stage, *role, "--host", self.host]  # fmt: skip
        return Child(name, args, self.log_dir / f"{name.replace('/', '-')}.log", self.env)

    def status(self) -> dict[str, Any]:
        assert self.client is not None
        result: dict[str, Any] = self.client.call("Status", timeout=5.0)
        return result

    def drain(self) -> None:
        if self.client is not None:
            self.client.call("Drain", timeout=5.0)

    def check_children(self, expect_exit: bool, let_go: frozenset[str] = frozenset()) -> None:
        """Raise RunError if a child died unexpectedly (any exit while running, non-zero ever),
        unless the coordinator has let it go (lost mid-rescale and recovered from). A child
        that just died gets a moment for the coordinator to say so."""
        for child in self._members():
            code = child.exit_code()
            if code is None or child.name in let_go:
                continue
            if code != 0 and child.name in self.instances and not expect_exit:
                first = self._dead_since.setdefault(child.name, time.monotonic())
                if time.monotonic() - first < LOST_GRACE:
                    continue
            if code != 0 or (not expect_exit and child is self.coordinator):
                raise RunError(self._crash_message(child, code))

    def _crash_message(self, child: Child, code: int) -> str:
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        if child is self.coordinator and code == RESTART_EXIT_CODE:
            how = "stopped the job to restart it from its latest checkpoint"
        tail = child.tail()
        lines = (
            f"\n  last log lines ({child.log_path}):\n    " + tail.replace("\n", "\n    ")
            if tail
            else ""
        )
        return f"{child.name} (pid {child.pid}) {how}{lines}"

    def stop(self, grace: float = 3.0) -> None:
        """Stop every process this job started, whatever state they are in."""
        if self.client is not None:
            with contextlib.suppress(TransportError):
                self.client.call("Shutdown", timeout=2.0)
        for child in reversed(self.children()):
            child.stop(grace)
        if self.client is not None:
            self.client.close()
            self.client = None


@contextmanager
def interrupt_flag() -> Iterator[threading.Event]:
    """Turn Ctrl-C into a flag for the duration of the block, so a run can drain in order."""
    interrupted = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: interrupted.set())
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, previous)


def _observe(job: LocalJob, let_go: frozenset[str]) -> dict[str, Any]:
    """The job's status; RunError when a process died or the job failed."""
    job.check_children(expect_exit=False, let_go=let_go)
    try:
        status = job.status()
    except TransportError as exc:
        # A killed coordinator's connections close before its exit can be seen: a moment for
        # that, so that the error says how it ended, not only that it stopped answering.
        if job.coordinator is not None:
            job.coordinator.exit_code_within(EXIT_GRACE)
        job.check_children(expect_exit=False)
        raise RunError(f"coordinator stopped answering: {exc}") from None
    if status["phase"] == "failed":
        failed = "job failed: " + "; ".join(status["errors"])
        if status.get("gave_up"):
            raise GaveUp(f"{failed}\n  not restarted again: {status['gave_up']}")
        raise RunError(failed)
    return status


def run_job(
    job: LocalJob,
    duration: float | None,
    interrupted: threading.Event,
    on_status: Callable[[dict[str, Any]], None] = lambda status: None,
    drain_timeout: float = 60.0,
) -> RunResult:
    """Run a started job until it finishes, its duration ends or `interrupted`; then drain it.
    A job with checkpoints that loses a process is restarted from its latest checkpoint, as
    its restart strategy (`JobSpec.restart`) allows."""
    history: list[dict[str, Any]] = []
    started = time.monotonic()
    drain_deadline: float | None = None
    let_go: frozenset[str] = frozenset()
    while True:
        try:
            status = _observe(job, let_go)
        except RunError as exc:
            job.restart(exc, interrupted)
            continue
        pending = job.recoveries[-1] if job.recoveries else None
        if pending is not None and pending["seconds"] is None and status["phase"] == "running":
            pending["seconds"] = time.monotonic() - pending.pop("started")
        let_go = frozenset(status.get("lost", ()))
        history.append(status)
        on_status(status)
        job.ensure_instances(status)  # first: a standby a local recovery took is promoted
        job.replace(status)
        phase = status["phase"]
        if phase == "finished":
            break
        out_of_time = duration is not None and time.monotonic() - started >= duration
        if drain_deadline is None and (interrupted.is_set() or out_of_time):
            job.drain()
            drain_deadline = time.monotonic() + drain_timeout
        if drain_deadline is not None and time.monotonic() > drain_deadline:
            raise RunError(f"job did not drain within {drain_timeout:.0f} s")
        # A lost process is replaced as soon as the coordinator says so (a local recovery).
        interval = RECOVERY_STATUS_INTERVAL if phase == "recovering" else STATUS_INTERVAL
        interrupted.wait(interval) if drain_deadline is None else time.sleep(interval)
    # Instances exit by themselves once finished; give them a moment, then check their codes.
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and any(
        c.exit_code() is None for c in job.instances.values()
    ):
        time.sleep(0.05)
    job.check_children(expect_exit=True, let_go=let_go)
    return RunResult(
        status=status, interrupted=interrupted.is_set(), log_dir=job.log_dir, history=history
    )
