"""moto's S3 server as a real HTTP process on loopback, for the tests of storage on S3
(checkpoints, the ingest log). Import `s3_endpoint` into a test module to use the fixture;
`s3_bucket` makes a fresh bucket and `s3_options` gives the fsspec options to reach it."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from tests.prometheus_server import free_port


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 server as its own process on a free loopback port."""
    port = free_port()
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(url, timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("moto_server did not start") from None
                time.sleep(0.1)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=10)


def s3_options(endpoint: str) -> dict[str, Any]:
    return {
        "key": "testing",
        "secret": "testing",
        "use_listings_cache": False,
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }


def s3_bucket(endpoint: str, prefix: str) -> str:
    """A new, empty bucket; its name."""
    bucket = f"{prefix}-{time.monotonic_ns()}"
    boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    ).create_bucket(Bucket=bucket)
    return bucket
