"""A job whose source is the ingest endpoint: pushed rows flow through keyed state to the log;
rows that do not fit are rejected with their reasons and the valid rows around them are kept."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest

from keyshift.runtime.ingest_client import IngestClient
from tests.conftest import count_job, latest_by_version, running_job, wait_for

pytestmark = pytest.mark.live


def test_pushed_rows_are_counted_once_and_bad_rows_rejected(tmp_path: Path) -> None:
    out = tmp_path / "out"
    job = count_job(
        fields={"user": "str", "clicks": "int"},
        source={"parallelism": 1, "config": {"kind": "ingest"}},
        keyed={
            "name": "per-user",
            "parallelism": 2,
            "key_by": "user",
            "operator": {"function": "sum", "field": "clicks"},
        },
        sink={"config": {"kind": "log", "path": str(out), "format": "parquet"}},
    )
    with running_job(tmp_path, job) as local:

        def address() -> str | None:
            status = local.status()
            instances = status["stages"][0]["instances"]
            return instances[0]["stats"].get("ingest_address") if instances else None

        endpoint = wait_for(address, 30, "the ingest endpoint")
        with IngestClient(endpoint) as client:
            table = pa.table({"user": ["ann", "bob", "ann"] * 100, "clicks": [1, 2, 3] * 100})
            first = client.push(table, batch_id="q1-0")
            assert (first.accepted, first.rejected) == (300, 0)
            again = client.push(table, batch_id="q1-0")  # a retried micro-batch
            assert again.duplicate and again.accepted == 0
            mixed = client.push(
                [{"user": "cid", "clicks": 5}, {"user": "cid"}, {"user": 7, "clicks": 1},
                 {"user": "cid", "clicks": 6}],
                batch_id="q1-1",
            )  # fmt: skip
            assert (mixed.accepted, mixed.rejected) == (2, 2)
            assert any("missing field 'clicks'" in r for r in mixed.reasons)
        wait_for(
            lambda: local.status()["stages"][0]["instances"][0]["stats"].get("invalid") == 2,
            10,
            "the rejections to be counted",
        )
        local.drain()
        wait_for(lambda: local.status()["phase"] == "finished", 30, "the job to drain")
    latest = latest_by_version(out)
    assert {u: v for u, (_, v) in latest.items()} == {"ann": 400.0, "bob": 200.0, "cid": 11.0}
    assert Counter(u for u, (n, _) in latest.items() for _ in range(n)) == Counter(
        {"ann": 200, "bob": 100, "cid": 2}
    )
