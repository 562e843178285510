"""A PySpark sink job: read a keyshift job's output log and write it as Parquet.

    python examples/spark/sink_job.py --log out/spark-demo/log --job examples/spark/bids.yaml \\
        --reader demo-sink --output out/auctions

`spark.readStream.format("keyshift")` reads the log by (partition, offset); the checkpoint keeps
how far it got, so a restarted job neither loses nor repeats output. As the log's named
`--reader`, each committed micro-batch lets the job delete what was read. A job of several
sinks names the one whose log this is with `--sink`. `make demo`
(examples/spark/demo.py) uses `read_output` and `write_parquet` from here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming.query import StreamingQuery

from keyshift.spark.session import local_session, run_to_the_end


def read_output(
    spark: SparkSession, log: Path, job: Path, reader: str | None, sink: str | None = None
) -> DataFrame:
    stream = spark.readStream.format("keyshift").option("job", str(job))
    if reader is not None:
        stream = stream.option("reader", reader)
    if sink is not None:
        stream = stream.option("sink", sink)
    return stream.load(str(log))


def write_parquet(
    df: DataFrame, output: Path, checkpoint: Path, trigger_seconds: float = 1.0
) -> StreamingQuery:
    return (
        df.writeStream.format("parquet")
        .option("path", str(output))
        .option("checkpointLocation", str(checkpoint))
        .trigger(processingTime=f"{trigger_seconds} seconds")
        .start()
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--log", type=Path, required=True, help="the job's output log directory")
    parser.add_argument("--job", type=Path, required=True, help="the job file (for the schema)")
    parser.add_argument("--reader", help="the reader name the job's sink lists in `readers`")
    parser.add_argument("--sink", help="the sink that wrote the log (a job of several sinks)")
    parser.add_argument("--output", type=Path, required=True, help="Parquet output directory")
    parser.add_argument("--checkpoint", type=Path, default=Path("out/spark-sink-checkpoint"))
    args = parser.parse_args(argv)
    spark = local_session("keyshift-sink")
    query = write_parquet(
        read_output(spark, args.log, args.job, args.reader, args.sink),
        args.output,
        args.checkpoint,
    )
    run_to_the_end(spark, query, bounded=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
