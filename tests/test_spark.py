"""PySpark as keyshift's source and sink, with real local Spark and real keyshift processes.

One Spark session serves the module (it takes 10-15 s to start). A Spark source query writes
NEXMark-like bids (keyshift.spark.bids) into a job's ingest endpoint; a Spark sink query reads
the job's output log; a Spark batch query over the same bids gives the expected aggregates.
Micro-batches are retried the two ways a crash leaves them: a task that fails after other tasks
staged their rows, and a batch whose commit reached keyshift but not Spark's commit log (we
delete the commit log entry, which is what such a crash leaves behind).
"""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from pyspark.errors import AnalysisException, PythonException, StreamingQueryException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.query import StreamingQuery

from keyshift.operator.local_host import LocalJob
from keyshift.operator.scaling_metrics import members_of
from keyshift.runtime.job_secret import SECRET_ENV, new_job_secret
from keyshift.runtime.metrics import MetricName
from keyshift.runtime.output_log import OutputLogReader, reader_offsets
from keyshift.runtime.transport import JsonClient
from keyshift.spark.bids import DUE_COLUMN
from keyshift.spark.session import local_session
from tests.conftest import count_job, latest_by_version, running_job, wait_for
from tests.nexmark_reference import run_query, source_events, write_events
from tests.test_rescale import SERVICE, rescale_via

pytestmark = [pytest.mark.slow, pytest.mark.alone]

AUCTIONS = 2000
SEED = 5
# One secret for the module: Spark's Python workers keep the environment the JVM started with.
SECRET = new_job_secret()


@pytest.fixture(scope="module", autouse=True)
def _job_secret() -> Iterator[str]:
    """Set before the module's Spark session starts (autouse fixtures of a scope come first)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(SECRET_ENV, SECRET)
        yield SECRET


@pytest.fixture(scope="module")
def spark() -> Iterator[SparkSession]:
    session = local_session("keyshift-tests")
    try:
        yield session
    finally:
        session.stop()


def bids_job(out: Path, parallelism: int = 1, readers: tuple[str, ...] = ()) -> dict[str, Any]:
    """Per auction, the sum of its bids' prices (the version counts its bids)."""
    return count_job(
        name="bids",
        fields={"auction": "int", "price": "int"},
        source={"parallelism": 1, "config": {"kind": "ingest"}},
        keyed={
            "name": "per-auction",
            "parallelism": parallelism,
            "key_by": "auction",
            "operator": {"function": "sum", "field": "price"},
        },
        sink={
            "config": {
                "kind": "log",
                "path": str(out),
                "format": "parquet",
                "segment_records": 4000,
                "readers": list(readers),
            }
        },
    )


def endpoint_of(local: LocalJob) -> str:
    def address() -> str | None:
        instances = local.status()["stages"][0]["instances"]
        return instances[0]["stats"].get("ingest_address") if instances else None

    return wait_for(address, 30, "the ingest endpoint")


def ingested(local: LocalJob) -> int:
    return int(local.status()["stages"][0]["instances"][0]["stats"].get("emitted", 0))


def bids(spark: SparkSession, total: int, stream: bool, rate: float | None = None) -> DataFrame:
    reader = spark.readStream if stream else spark.read
    reader = reader.format("keyshift-bids").option("total", total)
    reader = reader.option("auctions", AUCTIONS).option("seed", SEED)
    if rate is not None:
        reader = reader.option("profile", json.dumps({"kind": "constant", "rate": rate}))
    return reader.load()


def expected(spark: SparkSession, total: int) -> dict[int, tuple[int, float]]:
    """Per auction (bids, sum of prices), by a Spark batch query over the same bids."""
    rows = bids(spark, total, stream=False).groupBy("auction").agg(F.count("*"), F.sum("price"))
    return {r[0]: (r[1], float(r[2])) for r in rows.collect()}


def write_into(df: DataFrame, endpoint: str, checkpoint: Path, **options: str) -> StreamingQuery:
    due = [DUE_COLUMN] if options.get("dueColumn") == DUE_COLUMN else []
    writer = df.select("auction", "price", *due).writeStream.format("keyshift")
    writer = writer.option("endpoint", endpoint).option("checkpointLocation", str(checkpoint))
    for name, value in options.items():
        writer = writer.option(name, value)
    return writer.trigger(processingTime="500 milliseconds").start()


def client_backlog_age(local: LocalJob) -> float:
    """The age of the oldest row the source's clients report due and not pushed, as the source
    instance exports it."""
    (address,) = members_of(local.status())["source"].values()
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == MetricName.CLIENT_BACKLOG_AGE
    )


def stop_job(local: LocalJob) -> None:
    local.drain()
    wait_for(lambda: local.status()["phase"] == "finished", 60, "the job to drain")


def final_aggregates(out: Path) -> dict[int, tuple[int, float]]:
    return {key: (version, value) for key, (version, value) in latest_by_version(out).items()}


def forget_commit(checkpoint: Path, batch: int) -> None:
    """Leave a checkpoint as a crash right before Spark logged the batch's commit would."""
    (checkpoint / "commits" / str(batch)).unlink()
    (checkpoint / "commits" / f".{batch}.crc").unlink(missing_ok=True)


# --- end to end ------------------------------------------------------------------------------


def test_spark_source_to_rescaled_job_to_spark_sink_matches_a_batch_query(
    spark: SparkSession, tmp_path: Path
) -> None:
    total = 150_000
    out = tmp_path / "log"
    job = bids_job(out, readers=("sink",))
    job_file = tmp_path / "bids.yaml"
    job_file.write_text(yaml.safe_dump(job))
    sink_dir = tmp_path / "sink"
    queries: list[StreamingQuery] = []
    try:
        with running_job(tmp_path, job) as local:
            endpoint = endpoint_of(local)
            sink = (
                spark.readStream.format("keyshift")
                .option("job", str(job_file))
                .option("reader", "sink")
                .load(str(out))
                .writeStream.format("parquet")
                .option("path", str(sink_dir))
                .option("checkpointLocation", str(tmp_path / "sink-checkpoint"))
                .trigger(processingTime="1 second")
                .start()
            )
            queries.append(sink)
            source = write_into(
                bids(spark, total, True, 25_000),
                endpoint,
                tmp_path / "src-cp",
                dueColumn=DUE_COLUMN,
            )
            queries.append(source)
            wait_for(lambda: ingested(local) > total // 4, 120, "a quarter of the bids")
            # The writer reports the bids due but not written yet with its pushes.
            wait_for(lambda: client_backlog_age(local) > 0, 60, "the writer's backlog report")
            client = JsonClient(local.address, SERVICE)
            try:
                rescale_via(local, client, 3, "hot-first", stage="per-auction")
            finally:
                client.close()
            wait_for(lambda: ingested(local) == total, 120, "every bid to be ingested")
            source.stop()
            stop_job(local)
        log = OutputLogReader(out)
        log_ends = {p: log.end_offset(p) for p in log.partitions()}
        # The reader commits a batch's end when the next batch starts: a further batch comes
        # only with new data, so wait until the sink has read up to the end instead.
        # Spark's file sink lists its committed files in _spark_metadata: read through it.
        committed = lambda: spark.read.parquet(str(sink_dir)).count()  # noqa: E731
        wait_for(lambda: committed() >= sum(log_ends.values()), 60, "the sink to catch up")
        sink.stop()
        table = spark.read.parquet(str(sink_dir)).toArrow()
        positions = list(
            zip(table["partition"].to_pylist(), table["offset"].to_pylist(), strict=True)
        )
        assert len(positions) == len(set(positions)) == sum(log_ends.values())
        latest: dict[int, tuple[int, float]] = {}
        for key, version, value in zip(
            table["key"].to_pylist(),
            table["version"].to_pylist(),
            table["value"].to_pylist(),
            strict=True,
        ):
            if version > latest.get(key, (-1, 0.0))[0]:
                latest[key] = (version, value)
        assert latest == expected(spark, total)
    finally:
        for query in queries:
            query.stop()


# --- retries ---------------------------------------------------------------------------------


def test_a_retried_micro_batch_is_not_counted_twice(spark: SparkSession, tmp_path: Path) -> None:
    total = 30_000
    out = tmp_path / "log"
    marker = tmp_path / "fail"
    marker.touch()
    checkpoint = tmp_path / "src-cp"

    @F.udf("long")
    def gate(seq: int) -> int:
        if seq >= 20_000 and os.path.exists(str(marker)):
            raise ValueError("injected failure after partition 0 was staged")
        return seq

    with running_job(tmp_path, bids_job(out)) as local:
        endpoint = endpoint_of(local)
        # The gate feeds a column the writer sends, so Spark cannot prune it away.
        stream = bids(spark, total, True)
        gated = stream.withColumn("price", F.when(gate("seq") >= 0, stream["price"]))
        first = write_into(gated, endpoint, checkpoint)
        with pytest.raises(StreamingQueryException, match="injected failure"):
            first.awaitTermination(120)
            pytest.fail("the query did not fail")
        assert ingested(local) == 0  # partition 0 was staged, never applied
        marker.unlink()

        second = write_into(gated, endpoint, checkpoint)
        second.processAllAvailable()
        second.stop()
        wait_for(lambda: ingested(local) == total, 30, "the retried batch to flow")
        # A crash after keyshift applied batch 0 but before Spark logged it: batch 0 runs again.
        forget_commit(checkpoint, 0)
        third = write_into(gated, endpoint, checkpoint)
        third.processAllAvailable()
        third.stop()
        assert (checkpoint / "commits" / "0").exists()
        stop_job(local)
        assert ingested(local) == total
    assert final_aggregates(out) == expected(spark, total)


def test_a_sink_query_restarted_from_its_checkpoint_neither_loses_nor_repeats(
    spark: SparkSession, tmp_path: Path
) -> None:
    out = tmp_path / "log"
    checkpoint = tmp_path / "sink-cp"
    batches = tmp_path / "batches"

    def read_log() -> None:
        def keep(df: DataFrame, batch_id: int) -> None:
            df.write.mode("overwrite").parquet(str(batches / f"batch={batch_id}"))

        query = (
            spark.readStream.format("keyshift")
            .option("maxRecordsPerBatch", 1000)
            .option("reader", "restarted")
            .load(str(out))
            .writeStream.foreachBatch(keep)
            .option("checkpointLocation", str(checkpoint))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination(120)
        assert query.exception() is None

    with running_job(tmp_path, bids_job(out, parallelism=2)) as local:
        endpoint = endpoint_of(local)
        # The batch writer: df.write into the job.
        bids(spark, 10_000, stream=False).write.format("keyshift").option(
            "endpoint", endpoint
        ).mode("append").save()
        wait_for(lambda: _log_records(out) > 0, 60, "output in the log")
        read_log()
        # More output, then a restart from the checkpoint (after losing the last commit entry).
        more = bids(spark, 30_000, stream=False).where(F.col("seq") >= 10_000)
        more.write.format("keyshift").option("endpoint", endpoint).mode("append").save()
        stop_job(local)
    last = max(int(name) for name in os.listdir(checkpoint / "commits") if name.isdigit())
    forget_commit(checkpoint, last)
    read_log()
    table = pq.read_table(batches)
    positions = list(zip(table["partition"].to_pylist(), table["offset"].to_pylist(), strict=True))
    assert len(positions) == len(set(positions)) == _log_records(out)
    # As the log's reader, the query committed how far it read (a batch behind: Spark commits
    # a batch's end to the source when it plans the next one).
    (committed,) = reader_offsets(out)["restarted"].values()
    assert 0 < committed < _log_records(out)
    ran = sorted(int(d.name.removeprefix("batch=")) for d in batches.iterdir())
    assert ran == list(range(len(ran))) and len(ran) > last + 1  # batch `last` ran again


def _log_records(out: Path) -> int:
    if not out.exists():
        return 0
    reader = OutputLogReader(out)
    return sum(reader.end_offset(p) - reader.start_offset(p) for p in reader.partitions())


# --- bad input -------------------------------------------------------------------------------


def test_rows_that_do_not_fit_fail_the_query_and_the_valid_rows_are_kept(
    spark: SparkSession, tmp_path: Path
) -> None:
    out = tmp_path / "log"
    rows = [(1, 10), (2, None), (3, 30), (None, 40), (1, 50)]
    df = spark.createDataFrame(rows, "auction long, price long")
    with running_job(tmp_path, bids_job(out)) as local:
        endpoint = endpoint_of(local)
        with pytest.raises(AnalysisException, match="2 rows of the write do not fit") as exc:
            df.write.format("keyshift").option("endpoint", endpoint).mode("append").save()
        assert "missing field 'auction'" in str(exc.value)
        assert "missing field 'price'" in str(exc.value)
        assert "badRows=drop" in str(exc.value)
        wait_for(lambda: ingested(local) == 3, 30, "the valid rows")
        # With badRows=drop the rows are dropped, counted by the job, and the query goes on.
        df.write.format("keyshift").option("endpoint", endpoint).option("badRows", "drop").mode(
            "append"
        ).save()
        wait_for(lambda: ingested(local) == 6, 30, "the valid rows of the second write")
        stop_job(local)
    assert final_aggregates(out) == {1: (4, 120.0), 3: (2, 60.0)}


def test_a_writer_without_the_jobs_token_is_refused_and_nothing_arrives(
    spark: SparkSession, tmp_path: Path
) -> None:
    out = tmp_path / "log"
    df = spark.createDataFrame([(1, 10), (2, 20)], "auction long, price long")
    with running_job(tmp_path, bids_job(out)) as local:
        endpoint = endpoint_of(local)
        wrong = df.write.format("keyshift").option("endpoint", endpoint)
        with pytest.raises(PythonException, match="UNAUTHENTICATED"):
            wrong.option("token", new_job_secret()).mode("append").save()
        assert ingested(local) == 0
        # The job's secret as option `token` (here also the workers' environment's).
        df.write.format("keyshift").option("endpoint", endpoint).option("token", SECRET).mode(
            "append"
        ).save()
        wait_for(lambda: ingested(local) == 2, 30, "the rows written with the token")
        stop_job(local)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "option 'endpoint' is required"),
        ({"endpoint": "nohost"}, "'nohost' is not host:port"),
        ({"endpoint": "127.0.0.1:1", "badRows": "keep"}, "option 'badRows' must be one of"),
        ({"endpoint": "127.0.0.1:1", "timeout": "soon"}, "option 'timeout' must be seconds"),
    ],
)
def test_bad_writer_options_fail_when_the_query_starts(
    spark: SparkSession, tmp_path: Path, options: dict[str, str], message: str
) -> None:
    writer = bids(spark, 10, True).writeStream.format("keyshift")
    for name, value in options.items():
        writer = writer.option(name, value)
    with pytest.raises(Exception, match=message):
        writer.option("checkpointLocation", str(tmp_path / "cp")).start().awaitTermination(60)


def test_an_unreachable_job_fails_the_write_with_the_address(
    spark: SparkSession, tmp_path: Path
) -> None:
    df = spark.createDataFrame([(1, 10)], "auction long, price long")
    with pytest.raises(PythonException, match=r"staging at keyshift endpoint 127\.0\.0\.1:9"):
        df.write.format("keyshift").option("endpoint", "127.0.0.1:9").option("timeout", "2").mode(
            "append"
        ).save()


def test_reading_a_log_with_no_records_and_no_job_file_says_what_to_pass(
    spark: SparkSession, tmp_path: Path
) -> None:
    with pytest.raises(Exception, match="has no records yet to take the schema from"):
        spark.read.format("keyshift").load(str(tmp_path / "nothing")).collect()


# --- the example jobs ------------------------------------------------------------------------


def test_the_example_jobs_replay_json_files_into_a_job_and_write_its_output_as_parquet(
    spark: SparkSession, tmp_path: Path
) -> None:
    from examples.spark.sink_job import read_output, write_parquet
    from examples.spark.source_job import file_stream, write_to_keyshift

    inputs = tmp_path / "in"
    inputs.mkdir()
    rows = [{"auction": i % 7, "price": i, "note": "extra columns are ignored"} for i in range(700)]
    for part in range(2):
        lines = (json.dumps(r) for r in rows[part * 350 : (part + 1) * 350])
        (inputs / f"part-{part}.json").write_text("\n".join(lines) + "\n")
    out = tmp_path / "log"
    job = bids_job(out)
    job_file = tmp_path / "bids.yaml"
    job_file.write_text(yaml.safe_dump(job))
    with running_job(tmp_path, job) as local:
        source = write_to_keyshift(
            file_stream(spark, inputs, "json"), endpoint_of(local), tmp_path / "src-cp", 0.5
        )
        try:
            source.processAllAvailable()
        finally:
            source.stop()
        wait_for(lambda: ingested(local) == 700, 30, "the replayed rows")
        stop_job(local)
    sink = write_parquet(
        read_output(spark, out, job_file, None), tmp_path / "parquet", tmp_path / "sink-cp", 0.5
    )
    try:
        sink.processAllAvailable()
    finally:
        sink.stop()
    table = spark.read.parquet(str(tmp_path / "parquet")).toArrow()
    assert table.num_rows == _log_records(out)
    latest: dict[int, int] = {}
    for key, version in zip(table["key"].to_pylist(), table["version"].to_pylist(), strict=True):
        latest[key] = max(latest.get(key, 0), version)
    assert latest == {k: 100 for k in range(7)}


def test_nexmark_events_in_spark_answer_a_query_as_duckdb_does(
    spark: SparkSession, tmp_path: Path
) -> None:
    """`format("keyshift-nexmark")`: a batch read holds the events a job's nexmark source makes,
    and a streaming Q2 over them answers what DuckDB answers over the same events."""
    options = {"total": "20000", "seed": "3", "eventRate": "2000", "partitions": "3"}
    batch = spark.read.format("keyshift-nexmark").options(**options).load()
    events = source_events({"total": 20_000, "seed": 3, "event_rate": 2000}, 1)
    assert batch.count() == 20_000
    assert sorted(batch.collect()) == sorted(tuple(r.values()) for r in events.to_pylist())
    stream = spark.readStream.format("keyshift-nexmark").options(**options).load()
    q2 = stream.where("kind = 'bid' AND auction % 123 = 0").select("auction", "price")
    query = q2.writeStream.format("memory").queryName("nexmark_q2").start()
    try:
        query.processAllAvailable()
    finally:
        query.stop()
    answer = sorted(tuple(r) for r in spark.table("nexmark_q2").collect())
    expected = run_query("q2", write_events(events, tmp_path / "events.parquet"))
    assert answer == expected and expected
