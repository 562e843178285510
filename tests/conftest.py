"""Shared harness for tests that start real keyshift processes on loopback.

Every process a test starts is stopped by the test, also when it fails: jobs run inside
`running_job` (a LocalJob context manager) or `cli` (a `keyshift` subprocess in its own session
whose whole process group is killed at the end), and the `prometheus` fixture stops its server.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from keyshift.operator.cli import job_client, main
from keyshift.operator.job_registry import RegistryError
from keyshift.operator.local_host import LocalJob
from keyshift.runtime.coordinator import Coordinator
from keyshift.runtime.job import JobSpec, parse_job
from keyshift.runtime.job_secret import SECRET_ENV, new_job_secret
from keyshift.runtime.lifecycle import PARENT_ENV
from keyshift.runtime.output_log import OutputLogReader
from keyshift.runtime.protocol import Empty
from keyshift.runtime.transport import TransportError, start_server
from tests.prometheus_server import PrometheusServer
from tests.s3_server import MotoServer

REPO = Path(__file__).resolve().parent.parent
KEYSHIFT = str(Path(sys.executable).with_name("keyshift"))


def ingest_address(local: Any, stage: str | None = None) -> str | None:
    """The ingest endpoint of a running job's source instance 0 (of source `stage`; of the
    first source when not named), once it has one."""
    stages = local.status()["stages"]
    found = stages[0] if stage is None else next(s for s in stages if s["name"] == stage)
    instances = sorted(found["instances"], key=lambda i: i["index"])
    return instances[0]["stats"].get("ingest_address") if instances else None


def wait_for(condition: Callable[[], Any], timeout: float, what: str, every: float = 0.1) -> Any:
    """Poll until `condition()` is truthy; fail the test naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def write_job(tmp_path: Path, job: dict[str, Any], name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(job))
    return path


def children_of(host_pid: int) -> list[psutil.Process]:
    """keyshift processes started by the host with this pid (found by their environment)."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            ours = proc.environ().get(PARENT_ENV) == str(host_pid)
            if ours and proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def coordinators_of(host_pid: int) -> list[int]:
    """The coordinator among the host's processes: one, or none while the host restarts it."""
    found = []
    for proc in children_of(host_pid):
        try:
            if "keyshift.runtime.coordinator" in proc.cmdline():
                found.append(proc.pid)
        except psutil.Error:  # it exited since it was listed
            continue
    return found


# A loaded machine (the suite runs two tests at a time, beside other work) has taken over the
# default 30 s to start a job's coordinator, its processes or a rescale's new one: the tests
# give them this long, unless a test says otherwise.
TEST_REGISTER_TIMEOUT = 120.0


@contextmanager
def running_job(tmp_path: Path, job: dict[str, Any], **kwargs: Any) -> Iterator[LocalJob]:
    """Start a job's processes with the local host; stop them all on exit."""
    kwargs.setdefault("register_timeout", TEST_REGISTER_TIMEOUT)
    kwargs.setdefault("start_timeout", TEST_REGISTER_TIMEOUT)
    path = write_job(tmp_path, job)
    spec: JobSpec = parse_job(job)
    local = LocalJob(spec, path, log_dir=tmp_path / "logs", **kwargs)
    try:
        local.start()
        yield local
    finally:
        local.stop()


def status_of(job: str) -> dict[str, Any]:
    """The status of a job started by `keyshift run`, from its coordinator found by name in the
    registry with the job's secret, as `keyshift status JOB` finds it; empty while it cannot
    be had (not recorded yet, starting, restarting). For polling: a `keyshift` process per
    poll costs a busy machine a second or more of CPU."""
    try:
        client = job_client(job)
    except RegistryError:
        return {}
    try:
        status: dict[str, Any] = client.call("Status", timeout=5.0)
        return status
    except TransportError:
        return {}
    finally:
        client.close()


@contextmanager
def cli(args: list[str], cwd: Path = REPO, **popen: Any) -> Iterator[subprocess.Popen[str]]:
    """Run `keyshift ARGS` in its own session; kill its whole group on exit."""
    if args[:1] == ["run"] and "--register-timeout" not in args:
        args = [*args, "--register-timeout", str(TEST_REGISTER_TIMEOUT)]
    # The run dies with this test process, its job's processes with it, even when a hung test
    # makes faulthandler end this process (pyproject's faulthandler_timeout) with no cleanup.
    env = {**os.environ, **popen.pop("env", {}), "COLUMNS": "200", PARENT_ENV: str(os.getpid())}
    proc = subprocess.Popen(
        [KEYSHIFT, *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=env,
        **popen,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for child in children_of(proc.pid):
            child.kill()


def keyshift_main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """`keyshift ARGS` run by the command line's own `main` in this process: its exit code and
    what it printed (stdout and stderr, as `cli` merges them). For commands that are refused
    before they start anything: a `keyshift` process costs a busy machine seconds, and a test
    not marked `live` that starts any process of ours fails, which checks 'nothing started'."""
    capsys.readouterr()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("COLUMNS", "200")
        patch.setattr(sys, "path", list(sys.path))  # main appends the working directory
        try:
            code = main(args)
        except SystemExit as exit:  # argparse's refusals
            code = exit.code if isinstance(exit.code, int) else 2
    printed = capsys.readouterr()
    return code, printed.out + printed.err


# Test jobs linger 20 ms: their processes spend most of their CPU per message, not per record,
# and two tests share the machine's two cores.
BATCHING = {"max_records": 2048, "linger_ms": 20, "credits": 4}


STATE_BACKENDS = ["memory", "rocksdb"]


def state_settings(backend: str, tmp_path: Path) -> dict[str, Any]:
    """A keyed stage's `state` for a test job: small caches, each test its own directory."""
    if backend == "memory":
        return {"backend": "memory"}
    return {"backend": "rocksdb", "path": str(tmp_path / "state"), "block_cache_mb": 8,
            "write_buffer_mb": 4}  # fmt: skip


def count_job(**overrides: Any) -> dict[str, Any]:
    """A small keyed-count job; tests override what they exercise."""
    job: dict[str, Any] = {
        "name": "t",
        "source": {
            "parallelism": 1,
            "config": {"kind": "generator", "keys": 2000, "distribution": "zipf", "seed": 3},
        },
        "keyed": {"name": "counts", "parallelism": 2},
        "sink": {"config": {"kind": "log", "format": "jsonl"}},
        "batching": dict(BATCHING),  # a test may change its job's copy
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(job.get(key), dict):
            job[key] = {**job[key], **value}
        else:
            job[key] = value
    return job


@contextmanager
def served(coordinator: Coordinator) -> Iterator[str]:
    """`coordinator` served in process on a free loopback port, for tests that play the
    instances over real calls; its address. Shut down and stopped at the end."""
    server, port = start_server("127.0.0.1:0", [coordinator.handler()])
    try:
        yield f"127.0.0.1:{port}"
    finally:
        coordinator.shutdown(Empty())
        server.stop(None)


@pytest.fixture
def one_keyed_coordinator() -> Iterator[tuple[Coordinator, str]]:
    """A count job's coordinator (one keyed and one sink instance expected), `served`."""
    coordinator = Coordinator(
        parse_job(count_job(keyed={"parallelism": 1}, sink={"parallelism": 1})), 30.0
    )
    with served(coordinator) as address:
        yield coordinator, address


# A test is `live` when it starts one of these: a keyshift process (the CLI, a coordinator or an
# instance), a Prometheus or S3 server, Spark's JVM. `make test-fast` runs the tests that are
# not; `_live_tests_are_marked` keeps the marks honest.
LIVE_PROGRAMS = frozenset({"keyshift", "prometheus", "moto_server", "java", "spark-submit"})


def live_program(args: Any) -> str | None:
    """What in a Popen's `args` makes the test live, if anything."""
    argv = [str(a) for a in args] if isinstance(args, list | tuple) else [str(args)]
    if not argv:
        return None
    if Path(argv[0]).name in LIVE_PROGRAMS:
        return Path(argv[0]).name
    for flag, module in itertools.pairwise(argv):
        if flag == "-m" and module.startswith("keyshift."):
            return module
    return None


@contextmanager
def _refusing_live_programs(item: pytest.Item) -> Iterator[None]:
    """While a test not marked `live` (or `alone`) sets up and runs, starting a live program
    fails it at once, naming the program: `make test-fast` never hides a multi-process test
    and never waits on one. (Around the test's phases, not in a fixture, so that fixtures of a
    wider scope, such as the module's S3 server, are caught too.)"""
    if item.get_closest_marker("live") or item.get_closest_marker("alone"):
        yield
        return
    start = subprocess.Popen.__init__

    def guarded(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> None:
        program = live_program(args)
        if program is not None:
            pytest.fail(
                f"{item.nodeid} starts {program}: mark it live (pytest.mark.live)", pytrace=False
            )
        start(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = guarded  # type: ignore[method-assign]
    try:
        yield
    finally:
        subprocess.Popen.__init__ = start  # type: ignore[method-assign]


def target_module(thread: threading.Thread) -> str:
    """The module of the code a thread runs ("" when it is not known)."""
    return str(getattr(getattr(thread, "_target", None), "__module__", ""))


def _keyshift_threads() -> set[threading.Thread]:
    """The live threads running keyshift's own code (a scraper, a reader, a checkpoint
    driver...), known by their target's module."""
    return {t for t in threading.enumerate() if target_module(t).startswith("keyshift.")}


_THREADS_BEFORE = pytest.StashKey[set[threading.Thread]]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    item.stash[_THREADS_BEFORE] = _keyshift_threads()
    with _refusing_live_programs(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    """A keyshift thread a test started must be gone once it is torn down: one left behind
    goes on in the test process (a leaked scraper knocked at the ports of jobs long gone, and
    one of them had become Spark's)."""
    result = yield
    before = item.stash.get(_THREADS_BEFORE, set())
    deadline = time.monotonic() + 10
    while (left := _keyshift_threads() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    if left:
        names = ", ".join(sorted(f"{t.name} ({target_module(t)})" for t in left))
        pytest.fail(f"{item.nodeid} left keyshift threads running: {names}", pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with _refusing_live_programs(item):
        return (yield)


@pytest.fixture(autouse=True)
def _job_registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test records its running jobs in its own registry (keyshift.operator.job_registry)."""
    monkeypatch.setenv("KEYSHIFT_HOME", str(tmp_path / "keyshift-home"))


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[PrometheusServer]:
    """A real Prometheus server (tests/prometheus_server.py), ready; stopped after the test."""
    with PrometheusServer(tmp_path / "prometheus") as server:
        yield server


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 server (tests/s3_server.py) on a free loopback port, one per test process for
    all its tests (each makes its own bucket): a start costs seconds of a busy machine. The
    tests that stop S3 start their own `MotoServer`."""
    with MotoServer() as server:
        yield server.url


def latest_by_version(out: Path) -> dict[Any, tuple[int, Any]]:
    """Each key's latest aggregate update in an output log, as (version, value)."""
    table = OutputLogReader(out).read_all()
    latest: dict[Any, tuple[int, Any]] = {}
    for key, value, version in zip(
        table.column("key").to_pylist(),
        table.column("value").to_pylist(),
        table.column("version").to_pylist(),
        strict=True,
    ):
        if version > latest.get(key, (-1, None))[0]:
            latest[key] = (version, value)
    return latest


@pytest.fixture(autouse=True)
def _job_secret(monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test has its own job secret in the environment: the jobs it starts (the local host
    takes the caller's secret) and the clients it makes in-process share it."""
    secret = new_job_secret()
    monkeypatch.setenv(SECRET_ENV, secret)
    return secret
