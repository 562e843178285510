"""The test Prometheus server (tests/prometheus_server.py) scrapes the targets it is given, keeps
the labels our metrics carry beside its own target labels, fails clearly when it cannot run, and
is always stopped."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from keyshift.runtime.metrics import INSTANCE_LABEL, JOB_LABEL, LABELS
from tests.prometheus_server import PrometheusError, PrometheusServer


@pytest.fixture
def exporter() -> Iterator[tuple[str, Gauge]]:
    """An in-process /metrics endpoint on a free loopback port, with one labelled gauge."""
    registry = CollectorRegistry()
    gauge = Gauge("keyshift_test_value", "A test gauge", LABELS, registry=registry)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        yield f"127.0.0.1:{server.server_address[1]}", gauge
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.mark.live
def test_scrapes_file_sd_targets_and_keeps_their_labels(
    prometheus: PrometheusServer, exporter: tuple[str, Gauge]
) -> None:
    address, gauge = exporter
    gauge.labels("x", "s", "y").set(42)
    prometheus.write_targets([{"targets": [address], "labels": {"source": "test"}}])

    series = prometheus.wait_for_series(f'keyshift_test_value{{{JOB_LABEL}="x"}}', deadline=30)

    assert len(series) == 1
    labels = series[0]["metric"]
    # keyshift's labels and Prometheus' target labels side by side, none renamed to exported_*.
    assert labels[JOB_LABEL] == "x" and labels["stage"] == "s" and labels[INSTANCE_LABEL] == "y"
    assert labels["job"] == "keyshift" and labels["instance"] == address
    assert labels["source"] == "test"
    assert not any(name.startswith("exported_") for name in labels)
    assert float(series[0]["value"][1]) == 42
    # The target itself is scraped under the config's job, labelled by its address.
    up = prometheus.wait_for_series(f'up{{job="keyshift", instance="{address}"}}', deadline=10)
    assert float(up[0]["value"][1]) == 1


def test_missing_binary_is_a_clear_error(tmp_path: Path) -> None:
    server = PrometheusServer(tmp_path / "prometheus", binary=tmp_path / "no-such-prometheus")
    with pytest.raises(PrometheusError, match=r"no Prometheus binary at .*no-such-prometheus"):
        server.start()
    assert not server.running


def test_exit_at_start_is_reported_with_the_log(tmp_path: Path) -> None:
    binary = tmp_path / "broken-prometheus"
    binary.write_text("#!/bin/sh\necho 'err=\"something is wrong\"' >&2\nexit 3\n")
    binary.chmod(0o755)
    server = PrometheusServer(tmp_path / "prometheus", binary=binary)
    with pytest.raises(PrometheusError, match=r"(?s)exited with code 3.*something is wrong"):
        server.start()
    assert not server.running


@pytest.mark.live
def test_stopped_when_the_block_raises(tmp_path: Path) -> None:
    process: subprocess.Popen[bytes] | None = None
    with pytest.raises(RuntimeError, match="test failed"):  # noqa: SIM117 - the raise is the point
        with PrometheusServer(tmp_path / "prometheus") as server:
            process = server._process
            assert server.running
            raise RuntimeError("test failed")
    assert process is not None
    assert process.poll() is not None
    assert not server.running
