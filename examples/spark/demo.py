"""`make demo`: a PySpark source -> a keyed keyshift job autoscaled by DS2 -> a PySpark sink.

1. A local Spark session starts (its start-up warnings come first).
2. `keyshift run examples/spark/bids.yaml` starts the job with its live view and autoscaler.
3. A Spark sink query reads the job's output log (as its reader `demo-sink`) into Parquet.
4. A Spark source query pushes bids into the job's ingest endpoint, rising from 4k to 20k
   bids/s and falling back, and ends after the last bid; DS2 scales the keyed stage out and in,
   moving state live, hot keys first.
5. Once Spark has committed every bid to the job, the job drains (as on Ctrl-C) and writes its
   report; the sink query reads what is left.
6. A Spark batch query over the same bids computes the expected per-auction aggregates and the
   closing line says whether the sink's Parquet matches them.

Everything goes to out/spark-demo/. Run from the repository root: `python examples/spark/demo.py`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from sink_job import read_output, write_parquet
from source_job import bid_stream, write_to_keyshift

from keyshift.operator.job_registry import lookup
from keyshift.runtime.generator import records_due
from keyshift.runtime.job import PointsProfile, load_job
from keyshift.runtime.job_secret import SECRET_ENV, new_job_secret
from keyshift.runtime.lifecycle import allow_user_code
from keyshift.runtime.output_log import OutputLogReader
from keyshift.runtime.transport import JsonClient, TransportError
from keyshift.spark.bids import DUE_COLUMN
from keyshift.spark.session import local_session

JOB_FILE = Path("examples/spark/bids.yaml")
OUT = Path("out/spark-demo")
READER = "demo-sink"
# Bids per second over time: up to 20k/s, which needs about three keyed instances; in steps
# that let each decision see the load it answers.
PROFILE = PointsProfile(
    kind="points",
    points=[(0, 4000), (10, 8000), (20, 14000), (30, 20000), (55, 12000), (65, 4000), (80, 0)],
)
AUCTIONS = 20_000
SEED = 42
KEYSHIFT = Path(sys.executable).with_name("keyshift")


class DemoError(RuntimeError):
    pass


def wait(
    condition: Callable[[], Any], seconds: float, what: str, job: subprocess.Popen[bytes]
) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if job.poll() is not None:
            raise DemoError(f"keyshift run exited ({job.returncode}) while waiting for {what}")
        value = condition()
        if value:
            return value
        time.sleep(0.5)
    raise DemoError(f"timed out after {seconds:.0f} s waiting for {what}")


def ingest_endpoint(name: str) -> str | None:
    record = lookup(name)
    if record is None:
        return None
    client = JsonClient(record["coordinator"], "keyshift.Coordinator")
    try:
        instances = client.call("Status", timeout=5.0)["stages"][0]["instances"]
    except TransportError:
        return None
    finally:
        client.close()
    return instances[0]["stats"].get("ingest_address") if instances else None


def committed_bids(query: Any) -> int:
    progress = query.lastProgress
    if not progress:
        return 0
    end = progress["sources"][0]["endOffset"]
    return int((json.loads(end) if isinstance(end, str) else end)["seq"])


def log_records(log: Path) -> int:
    reader = OutputLogReader(log)
    return sum(reader.end_offset(p) for p in reader.partitions())


def compare(spark: SparkSession, sink: DataFrame, total: int) -> tuple[bool, str]:
    """Whether the sink's rows match a Spark batch query over the same bids, and a summary."""
    rows = sink.count()
    distinct = sink.select("source", "seq").distinct().count()
    values = F.from_json("value", "bids long, total long")
    latest = (
        sink.withColumn("v", values)
        .groupBy(F.col("key").alias("auction"))
        .agg(F.max("v.bids").alias("bids"), F.max("v.total").alias("total"))
    )
    bids = (
        spark.read.format("keyshift-bids").options(total=total, auctions=AUCTIONS, seed=SEED).load()
    )
    expected = bids.groupBy("auction").agg(
        F.count("*").alias("bids"), F.sum("price").alias("total")
    )
    mismatched = latest.exceptAll(expected).count() + expected.exceptAll(latest).count()
    auctions = expected.count()
    ok = rows == total and distinct == total and mismatched == 0
    verdict = "matched" if ok else "did NOT match"
    summary = (
        f"spark sink: {rows:,} rows in {OUT / 'auctions'} ({distinct:,} distinct records, one "
        f"per bid); per-auction bid counts and price totals {verdict} a Spark batch query over "
        f"the same {total:,} bids ({auctions:,} auctions, {mismatched} differing)"
    )
    return ok, summary


def main() -> int:
    allow_user_code()  # the job's keyed function lives in examples/
    spec = load_job(JOB_FILE)
    total = int(records_due(PROFILE, PROFILE.points[-1][0]) or 0)
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    print(f"starting Spark (local[2]); then keyshift job {spec.name}, {total:,} bids", flush=True)
    # One secret for the job, Spark's workers and this script's clients.
    os.environ.setdefault(SECRET_ENV, new_job_secret())
    spark = local_session("keyshift-demo")
    job = subprocess.Popen(
        [str(KEYSHIFT), "run", str(JOB_FILE), "--report", str(OUT / "report.png")]
    )
    queries = []
    try:
        endpoint = wait(lambda: ingest_endpoint(spec.name), 60, "the ingest endpoint", job)
        log = OUT / "log"
        sink = write_parquet(
            read_output(spark, log, JOB_FILE, READER), OUT / "auctions", OUT / "sink-checkpoint"
        )
        queries.append(sink)
        bids = bid_stream(spark, total, PROFILE.model_dump(mode="json"), AUCTIONS, SEED)
        source = write_to_keyshift(bids, endpoint, OUT / "source-checkpoint", due_column=DUE_COLUMN)
        queries.append(source)
        wait(lambda: committed_bids(source) >= total, 600, "Spark to write every bid", job)
        source.stop()
        job.send_signal(signal.SIGINT)  # drain: every committed bid flows to the log
        if job.wait(timeout=300) != 0:
            raise DemoError(f"keyshift run failed ({job.returncode})")
        records = log_records(log)

        def parquet() -> int:
            return int(spark.read.parquet(str(OUT / "auctions")).count())

        deadline = time.monotonic() + 120
        while parquet() < records:
            if time.monotonic() > deadline or sink.exception() is not None:
                raise DemoError(f"the Spark sink did not read all {records:,} records")
            time.sleep(1)
        sink.stop()
        ok, summary = compare(spark, spark.read.parquet(str(OUT / "auctions")), total)
        print(summary, flush=True)
        return 0 if ok else 1
    except DemoError as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1
    finally:
        for query in queries:
            query.stop()
        if job.poll() is None:
            job.send_signal(signal.SIGINT)
            try:
                job.wait(timeout=60)
            except subprocess.TimeoutExpired:
                job.kill()
        spark.stop()


if __name__ == "__main__":
    sys.exit(main())
