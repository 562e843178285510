"""Fixtures of the kind end-to-end suite: one kind cluster per session, the job under test.

`kube` creates a kind cluster with a unique name from e2e/kind-config.yaml (its own kubeconfig),
builds both images and loads them into it, prepares the node directory the job's output goes
to, installs Prometheus (e2e/prometheus.yaml) and the chart (helm/keyshift) with the built
image; at the end of the session it deletes the cluster, also when something failed, unless
KEYSHIFT_E2E_KEEP=1. `job` applies e2e/streamingjob.yaml and watches it. A failed test, or a
failed setup, dumps the cluster's state to e2e/logs/<test or "setup">/ first.

On a machine without docker, kind, helm, kubectl or a Docker engine, test_kind.py skips itself
at collection; this file then only prints why (see pytest_terminal_summary).
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.cluster import (
    IMAGE,
    LOGS,
    SPARK_IMAGE,
    JobWatch,
    Kube,
    apply_job,
    build_images,
    dump_diagnostics,
    install_chart,
    install_prometheus,
    prepare_output_dir,
)

KEEP = os.environ.get("KEYSHIFT_E2E_KEEP") == "1"


def _say(config: pytest.Config, line: str) -> None:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(line)


@pytest.fixture(scope="session")
def kube(request: pytest.FixtureRequest) -> Iterator[Kube]:
    shutil.rmtree(LOGS, ignore_errors=True)
    LOGS.mkdir(parents=True)
    name = f"keyshift-e2e-{secrets.token_hex(3)}"
    home = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    kube = Kube(name, home / "kubeconfig", LOGS / "commands.log")
    try:
        kube.create_cluster()
        build_images(kube)
        for image in (IMAGE, SPARK_IMAGE):
            kube.load_image(image)
        prepare_output_dir(kube)
        install_prometheus(kube)
        install_chart(kube)
        yield kube
    except BaseException as exc:
        if not isinstance(exc, GeneratorExit | KeyboardInterrupt):
            dump_diagnostics(kube, LOGS / "setup")
        raise
    finally:
        if KEEP:
            note = (
                f"KEYSHIFT_E2E_KEEP=1: kind cluster {name} kept; "
                f"export KUBECONFIG={kube.kubeconfig}; delete it with "
                f"`kind delete cluster --name {name}`"
            )
            (LOGS / "KEPT.txt").write_text(note + "\n")
            _say(request.config, note)
        else:
            kube.delete_cluster()
            shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session")
def job(kube: Kube) -> Iterator[JobWatch]:
    """e2e/streamingjob.yaml applied in its namespace, watched from the moment it is applied."""
    apply_job(kube)
    watch = JobWatch(kube, LOGS / "history.jsonl")
    watch.start()
    try:
        yield watch
    finally:
        watch.stop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test dumps the cluster as it is right then (later tests change it)."""
    report = yield
    funcargs: dict[str, Any] = getattr(item, "funcargs", {})
    kube = funcargs.get("kube")
    if report.when == "call" and report.failed and isinstance(kube, Kube):
        dump_diagnostics(kube, LOGS / item.name)
    return report


def _skip_reasons(config: pytest.Config) -> list[tuple[str, str]]:
    """(node id, reason) of what this suite skipped (the whole module, without Docker)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    found = []
    for report in getattr(reporter, "stats", {}).get("skipped", []):
        if str(report.nodeid).startswith("e2e/"):
            longrepr = report.longrepr
            reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
            found.append((report.nodeid, reason.removeprefix("Skipped: ")))
    return found


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """Say why the suite was skipped, even without -rs (which says it already)."""
    if "s" in getattr(terminalreporter, "reportchars", ""):
        return
    for nodeid, reason in _skip_reasons(config):
        terminalreporter.write_line(f"SKIPPED {nodeid}: {reason}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A suite skipped as a whole collected no test, which pytest calls exit status 5; it is a
    skip, and exits 0 like one."""
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED and _skip_reasons(session.config):
        session.exitstatus = pytest.ExitCode.OK
