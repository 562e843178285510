"""moto's S3 server as a real HTTP process on loopback, for the tests of storage on S3
(checkpoints, the ingest log). The `s3_endpoint` fixture (tests/conftest.py) is one server per
test process, shared by its tests; `s3_bucket` makes each test a fresh bucket and `s3_options`
gives the fsspec options to reach it. `MotoServer` is one a test stops and starts again on the
same port: an outage of S3."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import boto3

from tests.prometheus_server import free_port

START_TIMEOUT = 90.0


class MotoServer:
    """moto's S3 server as its own process on a loopback port that stays the same when the
    server is stopped and started again (moto keeps its buckets in memory: they are gone
    after a stop). Use as a context manager: the server is stopped on every path."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        moto = str(Path(sys.executable).with_name("moto_server"))
        # What it says, for when it does not start (it keeps its own handle to the file).
        with tempfile.TemporaryFile() as log:
            self.process = subprocess.Popen(
                [moto, "-H", "127.0.0.1", "-p", str(self.port)], stdout=log, stderr=log
            )
            # moto imports for a second and a half of CPU: on a machine as busy as the suite's
            # (two test processes beside the jobs they run) a start has taken 30 s.
            deadline = time.monotonic() + START_TIMEOUT
            while True:
                try:
                    urllib.request.urlopen(self.url, timeout=1).close()
                    return
                except OSError:
                    code = self.process.poll()
                    if code is None and time.monotonic() < deadline:
                        time.sleep(0.1)
                        continue
                self.stop()
                log.seek(0)
                said = log.read().decode(errors="replace")[-2000:]
                why = f"exited with {code}" if code is not None else "did not answer in time"
                raise RuntimeError(f"moto_server on port {self.port} {why}:\n{said}")

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None

    def __enter__(self) -> MotoServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def s3_options(endpoint: str) -> dict[str, Any]:
    return {
        "key": "testing",
        "secret": "testing",
        "use_listings_cache": False,
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        # botocore's default retries a refused connection four times with backoff, ~9 s per
        # call; one retry is enough on loopback, and the outage tests, whose calls to a stopped
        # server must fail, then wait a second per call instead of ten.
        "config_kwargs": {"retries": {"max_attempts": 1}},
    }


def s3_bucket(endpoint: str, prefix: str) -> str:
    """A new, empty bucket; its name."""
    bucket = f"{prefix}-{time.monotonic_ns()}"
    create_bucket(endpoint, bucket)
    return bucket


def create_bucket(endpoint: str, bucket: str) -> None:
    """Make a bucket of that name (again, after a restart of moto's server)."""
    boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    ).create_bucket(Bucket=bucket)
