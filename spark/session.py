"""A local Spark session set up for keyshift, with its data sources registered, and the way
an example job runs its query.

Used by the example Spark jobs (examples/spark/), `make demo` and the tests: Python workers run
this interpreter (PYSPARK_PYTHON), everything binds to loopback, no web UI, quiet logs.
"""

from __future__ import annotations

import os
import sys

from pyspark.sql import SparkSession
from pyspark.sql.streaming.query import StreamingQuery

from keyshift.spark.bids import BidsDataSource
from keyshift.spark.datasource import KeyshiftDataSource
from keyshift.spark.nexmark import NexmarkDataSource


def register(spark: SparkSession) -> None:
    """Make `format("keyshift")`, `format("keyshift-bids")` and `format("keyshift-nexmark")`
    available in a session."""
    spark.dataSource.register(KeyshiftDataSource)
    spark.dataSource.register(BidsDataSource)
    spark.dataSource.register(NexmarkDataSource)


def local_session(app: str, cores: int = 2, extra: dict[str, str] | None = None) -> SparkSession:
    """A local[cores] session for `app`; `extra` adds Spark settings."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    builder = (
        SparkSession.builder.master(f"local[{cores}]")
        .appName(app)
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.shuffle.partitions", str(cores))
        .config("spark.sql.streaming.forceDeleteTempCheckpointLocation", "true")
        .config("spark.ui.showConsoleProgress", "false")
    )
    for key, value in (extra or {}).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark


def run_to_the_end(spark: SparkSession, query: StreamingQuery, bounded: bool) -> None:
    """Run a job's query until all its input is processed (`bounded`) or until Ctrl-C, then
    stop the query and the session."""
    try:
        if bounded:
            query.processAllAvailable()
        else:
            query.awaitTermination()
    except KeyboardInterrupt:
        pass
    finally:
        query.stop()
        spark.stop()
