"""A PySpark source job: replay files, or generate bids, into a keyshift job's ingest endpoint.

    python examples/spark/source_job.py --endpoint HOST:PORT --input DIR --format json
    python examples/spark/source_job.py --endpoint HOST:PORT --bids 200000 \\
        --profile '{"kind": "points", "points": [[0, 4000], [20, 20000], [60, 4000]]}'

The stream goes through `writeStream.format("keyshift")`, which commits each micro-batch to the
job once even when Spark retries it; restart with the same --checkpoint to go on where it
stopped. With --bids N the job ends after N bids; a file replay runs until stopped (Ctrl-C).
On Kubernetes, as a StreamingJob's `spec.sources` app, it finds the endpoint in $KEYSHIFT_INGEST.
`make demo` (examples/spark/demo.py) uses `bid_stream` and `write_to_keyshift` from here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming.query import StreamingQuery

from keyshift.spark.bids import DUE_COLUMN
from keyshift.spark.session import local_session, run_to_the_end


def bid_stream(
    spark: SparkSession, total: int, profile: dict[str, object] | None, auctions: int, seed: int
) -> DataFrame:
    """Bids 0 .. total-1 (keyshift.spark.bids), arriving at the profile's rate."""
    reader = spark.readStream.format("keyshift-bids").option("total", total)
    reader = reader.option("auctions", auctions).option("seed", seed)
    if profile is not None:
        reader = reader.option("profile", json.dumps(profile))
    return reader.load()


def file_stream(spark: SparkSession, directory: Path, fmt: str) -> DataFrame:
    """The rows of the files in `directory`, and of files added later."""
    schema = spark.read.format(fmt).load(str(directory)).schema  # a stream needs its schema
    return spark.readStream.format(fmt).schema(schema).load(str(directory))


def write_to_keyshift(
    df: DataFrame,
    endpoint: str,
    checkpoint: Path,
    trigger_seconds: float = 1.0,
    due_column: str | None = None,
) -> StreamingQuery:
    """`due_column`: when each row fell due, so the writer reports its backlog to the job."""
    writer = df.writeStream.format("keyshift").option("endpoint", endpoint)
    if due_column is not None:
        writer = writer.option("dueColumn", due_column)
    return (
        writer.option("checkpointLocation", str(checkpoint))
        .trigger(processingTime=f"{trigger_seconds} seconds")
        .start()
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ingest = os.environ.get("KEYSHIFT_INGEST")  # set by the operator for a StreamingJob's sources
    parser.add_argument(
        "--endpoint",
        default=ingest,
        required=ingest is None,
        help="the job's ingest address HOST:PORT (default: $KEYSHIFT_INGEST)",
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--input", type=Path, help="a directory of JSON or Parquet files")
    what.add_argument("--bids", type=int, help="generate this many bids")
    parser.add_argument("--format", choices=["json", "parquet"], default="json")
    parser.add_argument("--profile", type=json.loads, help="load profile of the bids, as JSON")
    parser.add_argument("--auctions", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", type=Path, default=Path("out/spark-source-checkpoint"))
    args = parser.parse_args(argv)
    spark = local_session("keyshift-source")
    if args.bids is not None:
        df = bid_stream(spark, args.bids, args.profile, args.auctions, args.seed)
    else:
        df = file_stream(spark, args.input, args.format)
    due = DUE_COLUMN if args.bids is not None else None
    query = write_to_keyshift(df, args.endpoint, args.checkpoint, due_column=due)
    # --bids ends once every bid is committed to the job; a file replay runs until Ctrl-C.
    run_to_the_end(spark, query, bounded=args.bids is not None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
