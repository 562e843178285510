"""A real Prometheus server for tests, started on a free loopback port and always stopped.

Tests that check what Prometheus sees of keyshift's metrics use it through the `prometheus`
fixture in tests/conftest.py. It runs Debian's /usr/bin/prometheus (`make test` installs the
package) with a throwaway config and storage: scrape and evaluation every second, one scrape job
`keyshift` whose targets come from a file_sd JSON file (`targets_file`, written with
`write_targets`). As in a cluster, the scrape job does not honor the targets' labels: keyshift's
own are `keyshift_job` and `keyshift_instance`, which never collide with the `job` and `instance`
Prometheus attaches. The first scrape of a new target comes a few
seconds after it is written; `wait_for_series` polls the query API until a series shows up.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

PROMETHEUS_BINARY = Path("/usr/bin/prometheus")
JOB_NAME = "keyshift"


class PrometheusError(RuntimeError):
    """Prometheus did not start, died, or did not answer as expected in time."""


def free_port() -> int:
    """A TCP port free on loopback right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class PrometheusServer:
    """One Prometheus process with its own config, targets file and storage in `directory`.

    Use it as a context manager (or call `start` and `stop`): leaving the block stops the process,
    also when the block raises. Without `directory` a temporary one is made and removed on stop.
    """

    def __init__(
        self,
        directory: Path | None = None,
        binary: Path | str = PROMETHEUS_BINARY,
        ready_timeout: float = 30.0,
    ) -> None:
        self.binary = Path(binary)
        self.ready_timeout = ready_timeout
        self._own_directory = directory is None
        self.directory = (
            Path(tempfile.mkdtemp(prefix="prometheus-")) if directory is None else directory
        )
        self.config_file = self.directory / "prometheus.yml"
        self.targets_file = self.directory / "targets.json"
        self.storage = self.directory / "data"
        self.log_file = self.directory / "prometheus.log"
        self.port = 0
        self.url = ""
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> PrometheusServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> PrometheusServer:
        """Start Prometheus and wait until it reports ready; on failure stop it and raise."""
        if self._process is not None:
            raise PrometheusError("this Prometheus server is already started")
        if not self.binary.is_file() or not os.access(self.binary, os.X_OK):
            raise PrometheusError(
                f"no Prometheus binary at {self.binary}: install the Debian package `prometheus`"
                " (`make test` does, or: apt-get install --no-install-recommends prometheus)"
            )
        self.directory.mkdir(parents=True, exist_ok=True)
        self.write_targets([])
        self.config_file.write_text(yaml.safe_dump(self._config(), sort_keys=False))
        attempts = 3
        while True:
            attempts -= 1
            self._launch()
            try:
                self._wait_ready()
                return self
            except PrometheusError:
                # Another process may have taken the free port before Prometheus bound it.
                port_lost = "address already in use" in self.log_tail()
                self._terminate()
                if port_lost and attempts > 0:
                    continue
                self.stop()
                raise
            except BaseException:
                self.stop()
                raise

    def _launch(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [
            str(self.binary),
            f"--config.file={self.config_file}",
            f"--storage.tsdb.path={self.storage}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--storage.tsdb.retention.time=1h",
            "--log.level=warn",
        ]
        with self.log_file.open("wb") as log:
            self._process = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.directory,
                start_new_session=True,
            )

    def stop(self, grace: float = 5.0) -> None:
        """Stop the process (terminate, kill after `grace` s); remove a temporary directory."""
        self._terminate(grace)
        if self._own_directory:
            shutil.rmtree(self.directory, ignore_errors=True)

    def _terminate(self, grace: float = 5.0) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def write_targets(self, targets: list[dict[str, Any]]) -> None:
        """Replace the scrape targets, file_sd style: [{"targets": ["host:port"], "labels": {}}].

        Written to a temporary file and renamed over the old one, so Prometheus never reads a
        half-written file. It picks the change up within a second (refresh_interval).
        """
        temporary = self.targets_file.with_name(f".{self.targets_file.name}.tmp")
        temporary.write_text(json.dumps(targets))
        temporary.replace(self.targets_file)

    def query(self, promql: str) -> list[dict[str, Any]]:
        """The result of an instant query: [{"metric": {labels}, "value": [time, "value"]}]."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                body = json.load(response)
        except urllib.error.HTTPError as error:  # bad queries come back as 400 with an error body
            detail = error.read().decode(errors="replace")
            raise PrometheusError(f"query {promql!r} failed: {error.code} {detail}") from None
        if body.get("status") != "success":
            raise PrometheusError(f"query {promql!r} failed: {body}")
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def wait_for_series(self, query: str, deadline: float) -> list[dict[str, Any]]:
        """Poll `query` until it returns a non-empty result, for at most `deadline` seconds."""
        give_up = time.monotonic() + deadline
        while True:
            self._check_alive()
            result = self.query(query)
            if result:
                return result
            if time.monotonic() > give_up:
                raise PrometheusError(
                    f"query {query!r} returned no series within {deadline:.0f} s;"
                    f" targets: {self._targets_summary()}\n{self.log_tail()}"
                )
            time.sleep(0.2)

    def log_tail(self, lines: int = 30) -> str:
        """The last lines Prometheus logged (warnings and errors only)."""
        try:
            text = self.log_file.read_text(errors="replace")
        except FileNotFoundError:
            return "(Prometheus wrote no log)"
        tail = text.splitlines()[-lines:]
        return "Prometheus log tail:\n" + "\n".join(tail) if tail else "(Prometheus log is empty)"

    def _config(self) -> dict[str, Any]:
        return {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [
                {
                    "job_name": JOB_NAME,
                    "file_sd_configs": [
                        {"files": [str(self.targets_file)], "refresh_interval": "1s"}
                    ],
                }
            ],
        }

    def _check_alive(self) -> None:
        if self._process is None:
            raise PrometheusError("Prometheus is not started")
        code = self._process.poll()
        if code is not None:
            raise PrometheusError(f"Prometheus exited with code {code}\n{self.log_tail()}")

    def _wait_ready(self) -> None:
        give_up = time.monotonic() + self.ready_timeout
        while True:
            self._check_alive()
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet, or still starting (503)
            if time.monotonic() > give_up:
                raise PrometheusError(
                    f"Prometheus at {self.url} not ready within {self.ready_timeout:.0f} s\n"
                    f"{self.log_tail()}"
                )
            time.sleep(0.05)

    def _targets_summary(self) -> str:
        """What Prometheus says about its targets' health, to explain a missing series."""
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/targets", timeout=5) as response:
                active = json.load(response)["data"]["activeTargets"]
        except (OSError, ValueError, KeyError) as error:
            return f"(could not list targets: {error})"
        return (
            ", ".join(
                f"{t['scrapeUrl']} {t['health']} {t.get('lastError') or ''}".strip() for t in active
            )
            or "none"
        )
