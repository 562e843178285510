"""Spark connector benchmark: how fast Spark feeds a job and reads its output, against direct
Python clients of the same endpoints, measured in the same run.

A job (ingest source -> per-auction count, one keyed instance -> Parquet output log) runs on
loopback with a local[2] Spark session beside it.

- write: N bids pushed by `IngestClient` in Arrow batches of 20k (one batch id each), then N
  more by a Spark stream (`keyshift-bids` -> `writeStream.format("keyshift")`, micro-batches of
  100k, two-phase commits). Rate = bids / seconds from the first to the last bid reaching the
  job (Spark's start-up excluded).
- read: the whole output log by `OutputLogReader.read_all`, then by `spark.read.format(
  "keyshift")` into Spark's `noop` sink (every row materialized, nothing written).

Run: `make bench-spark` or `.venv/bin/python bench/spark_io.py [--bids N]`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import yaml

from keyshift.operator.local_host import LocalJob
from keyshift.runtime.ingest_client import IngestClient
from keyshift.runtime.job import parse_job
from keyshift.runtime.job_secret import SECRET_ENV, new_job_secret
from keyshift.runtime.output_log import OutputLogReader
from keyshift.spark.bids import BidOptions, bids
from keyshift.spark.session import local_session

PUSH_ROWS = 20_000
MICRO_BATCH = 100_000


def job(out: Path) -> dict[str, Any]:
    return {
        "name": "bench-spark",
        "fields": {"auction": "int", "price": "int"},
        "source": {"parallelism": 1, "config": {"kind": "ingest"}},
        "keyed": {"name": "counts", "parallelism": 1, "key_by": "auction",
                  "operator": {"function": "count"}},
        "sink": {"config": {"kind": "log", "path": str(out), "format": "parquet",
                            "segment_records": 200_000}},
        "batching": {"max_records": 8192, "linger_ms": 5, "credits": 8},
    }  # fmt: skip


def ingested(local: LocalJob) -> int:
    instances = local.status()["stages"][0]["instances"]
    return int(instances[0]["stats"].get("emitted", 0)) if instances else 0


def timed_arrival(local: LocalJob, start_count: int, target: int) -> float:
    """Seconds from the first new row reaching the job to the count reaching `target`."""
    first = None
    while True:
        count = ingested(local)
        now = time.monotonic()
        if first is None and count > start_count:
            first = now
        if count >= target:
            assert first is not None
            return max(now - first, 1e-9)
        time.sleep(0.05)


def timed(action: Callable[[], Any]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bids", type=int, default=2_000_000)
    args = parser.parse_args()
    n = args.bids
    options = BidOptions({"total": str(n), "auctions": "100000"})
    with tempfile.TemporaryDirectory(prefix="bench-spark-") as tmp:
        root = Path(tmp)
        out = root / "log"
        spec = parse_job(job(out))
        job_file = root / "job.yaml"
        job_file.write_text(yaml.safe_dump(job(out)))
        # One secret for the job, Spark's workers and this script's clients.
        os.environ.setdefault(SECRET_ENV, new_job_secret())
        spark = local_session("bench-spark")
        with LocalJob(spec, job_file, log_dir=root / "logs") as local:
            local.start()
            while not (endpoint := _endpoint(local)):
                time.sleep(0.1)
            with IngestClient(endpoint) as client:

                def push_all() -> None:
                    for start in range(0, n, PUSH_ROWS):
                        batch = bids(options, start, min(start + PUSH_ROWS, n))
                        table = pa.Table.from_batches([batch]).select(["auction", "price"])
                        client.push(table, batch_id=f"direct-{start}")

                push_seconds = timed(push_all)
                direct_seconds = max(timed_arrival(local, 0, n), push_seconds)
            query = (
                spark.readStream.format("keyshift-bids")
                .options(total=n, auctions=100_000, seed=1, maxRecordsPerBatch=MICRO_BATCH)
                .load()
                .select("auction", "price")
                .writeStream.format("keyshift")
                .option("endpoint", endpoint)
                .option("checkpointLocation", str(root / "cp"))
                .start()
            )
            spark_seconds = timed_arrival(local, n, 2 * n)
            query.stop()
            local.drain()
            while local.status()["phase"] != "finished":
                time.sleep(0.1)
        records = OutputLogReader(out).read_all().num_rows
        direct_read = timed(lambda: OutputLogReader(out).read_all())
        spark_read = timed(
            lambda: (
                spark.read.format("keyshift")
                .option("job", str(job_file))
                .load(str(out))
                .write.format("noop")
                .mode("overwrite")
                .save()
            )
        )
        spark.stop()
    result = {
        "bids": n,
        "write_direct_rows_per_s": round(n / direct_seconds),
        "write_spark_rows_per_s": round(n / spark_seconds),
        "write_ratio_spark_to_direct": round(direct_seconds / spark_seconds, 2),
        "log_records": records,
        "read_direct_rows_per_s": round(records / direct_read),
        "read_spark_rows_per_s": round(records / spark_read),
        "read_ratio_spark_to_direct": round(direct_read / spark_read, 2),
    }
    print(json.dumps(result, indent=2))
    return 0


def _endpoint(local: LocalJob) -> str | None:
    instances = local.status()["stages"][0]["instances"]
    return instances[0]["stats"].get("ingest_address") if instances else None


if __name__ == "__main__":
    sys.exit(main())
