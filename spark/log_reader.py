"""Spark's readers of a keyshift job's output log: `spark.readStream.format("keyshift")` and the
batch `spark.read.format("keyshift")`.

Built by keyshift.spark.datasource.KeyshiftDataSource; `read` runs in Spark's Python workers,
the rest on the driver. The log (keyshift.runtime.output_log) is addressed by (partition,
offset), so a stream's offset is `{"partitions": {"<partition>": next offset}}`: Spark's
checkpoint holds it, and a query restarted from its checkpoint reads exactly the records after
the last committed micro-batch — no loss, no repeats. With option `reader`, the query also
records each committed end in the log (`commit`), which lets a sink that names this reader
delete what was read and backpressure the job while the query lags. Each row carries the
log's `partition` and `offset` columns first, then the job's output columns.

Options: `path` (the log directory; `load(path)` sets it), `job` (the job file: the schema
comes from it; without it, from the log's first segment), `sink` (with `job`: which of the
job's sinks wrote the log, needed when it has several), `reader` (a name, see above),
`maxRecordsPerBatch` (a stream's default read limit).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from keyshift.runtime.job import JobError, load_job
from keyshift.runtime.keyed_stage import sink_schema
from keyshift.runtime.output_log import (
    OFFSET_COLUMN,
    OutputLogError,
    OutputLogReader,
    commit_reader,
    list_segments,
    partition_dir_name,
)
from keyshift.runtime.records import READER_NAME

PARTITION_COLUMN = "partition"
Offsets = dict[int, int]


def log_schema(options: dict[str, str]) -> pa.Schema:
    """The Arrow schema of the rows read: partition, offset, then the job's output columns."""
    path = _path(options)
    job_file = options.get("job")
    if job_file is not None:
        job = _load_job(job_file)
        columns = sink_schema(job, _sink(job, options.get("sink")))
    else:
        columns = _first_segment_schema(path)
    return pa.schema(
        [pa.field(PARTITION_COLUMN, pa.int32()), pa.field(OFFSET_COLUMN, pa.int64())]
        + [pa.field(f.name, f.type) for f in columns]
    )


def spark_schema(options: dict[str, str]) -> StructType:
    return from_arrow_schema(log_schema(options))


def _load_job(job_file: str) -> Any:
    try:
        return load_job(job_file, resolve_functions=False)
    except JobError as exc:
        raise ValueError(f"option 'job': cannot read the job file {job_file}: {exc}") from None


def _sink(job: Any, name: str | None) -> str:
    """The sink of `job` whose log is read: `name`, or the job's only sink."""
    sinks = [sink.name for sink in job.sinks()]
    if name is None and len(sinks) > 1:
        raise ValueError(
            f"option 'sink': job {job.name} has the sinks {sinks}: name the one that wrote this log"
        )
    if name is not None and name not in sinks:
        raise ValueError(f"option 'sink': job {job.name} has no sink {name!r} (it has {sinks})")
    return name or sinks[0]


def _path(options: dict[str, str]) -> Path:
    raw = options.get("path")
    if not raw:
        raise ValueError("give the output log's directory: .load(path) or option 'path'")
    return Path(raw)


def _first_segment_schema(path: Path) -> pa.Schema:
    if path.exists():
        reader = _open(path)
        for partition in reader.partitions():
            for segment in list_segments(path / partition_dir_name(partition)):
                table = reader.read(partition, segment.start, segment.start + 1)
                return table.schema.remove(table.schema.get_field_index(OFFSET_COLUMN))
    raise ValueError(
        f"output log {path} has no records yet to take the schema from: pass option 'job' "
        "(the job file) or a schema"
    )


def _open(path: Path) -> OutputLogReader:
    try:
        return OutputLogReader(path)
    except OutputLogError as exc:
        raise ValueError(str(exc)) from None


class LogRange(InputPartition):
    """Offsets [start, end) of one log partition: one Spark task."""

    def __init__(self, path: str, partition: int, start: int, end: int) -> None:
        super().__init__(partition)
        self.path, self.partition, self.start, self.end = path, partition, start, end


def read_range(piece: LogRange, schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    """The records of a range as batches of `schema` (partition and offset columns first)."""
    table = OutputLogReader(piece.path).read(piece.partition, piece.start, piece.end)
    if table.num_rows != piece.end - piece.start:
        raise OutputLogError(
            f"output log {piece.path} partition {piece.partition}: asked for offsets "
            f"[{piece.start}, {piece.end}), found {table.num_rows} records"
        )
    column = pa.array([piece.partition] * table.num_rows, pa.int32())
    table = table.add_column(0, PARTITION_COLUMN, column)
    missing = [name for name in schema.names if name not in table.column_names]
    if missing:
        raise OutputLogError(
            f"output log {piece.path} partition {piece.partition} has no columns {missing}; "
            f"it has {table.column_names} (is option 'job' the job that wrote it?)"
        )
    yield from table.select(schema.names).cast(schema).to_batches()


def _ends(path: Path) -> Offsets:
    """Each partition's end offset; none while the job has not created the log yet."""
    if not path.exists():
        return {}
    reader = _open(path)
    return {p: reader.end_offset(p) for p in reader.partitions()}


def _starts(path: Path) -> Offsets:
    if not path.exists():
        return {}
    reader = _open(path)
    return {p: reader.start_offset(p) for p in reader.partitions()}


def _encode(offsets: Offsets) -> dict[str, Any]:
    return {"partitions": {str(p): o for p, o in sorted(offsets.items())}}


def _decode(offset: dict[str, Any]) -> Offsets:
    try:
        return {int(p): int(o) for p, o in offset["partitions"].items()}
    except (KeyError, TypeError, ValueError, AttributeError):
        raise ValueError(f"not a keyshift output log offset: {offset!r}") from None


def limit_ends(start: Offsets, ends: Offsets, max_rows: int | None) -> Offsets:
    """Ends that take at most `max_rows` records after `start`, shared fairly by partitions."""
    available = {p: max(end - start.get(p, 0), 0) for p, end in ends.items()}
    if max_rows is None or sum(available.values()) <= max_rows:
        return {p: max(end, start.get(p, 0)) for p, end in ends.items()}
    taken = dict.fromkeys(available, 0)
    left = max_rows
    while left > 0:
        hungry = [p for p in sorted(available) if taken[p] < available[p]]
        if not hungry:
            break
        share = max(left // len(hungry), 1)
        for p in hungry:
            step = min(share, available[p] - taken[p], left)
            taken[p] += step
            left -= step
    return {p: start.get(p, 0) + taken[p] for p in ends}


class KeyshiftLogStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, options: dict[str, str], schema: StructType) -> None:
        self.path = _path(options)
        self.arrow_schema = to_arrow_schema(schema)
        self.reader_name = options.get("reader")
        if self.reader_name is not None and not READER_NAME.match(self.reader_name):
            raise ValueError(
                f"option 'reader' {self.reader_name!r} must be 1-100 letters, digits, '_', "
                "'.' or '-', starting with a letter or digit"
            )
        raw = options.get("maxrecordsperbatch")
        self.max_rows = None if raw is None else int(raw)
        if self.max_rows is not None and self.max_rows < 1:
            raise ValueError(f"option 'maxRecordsPerBatch' must be >= 1, got {raw}")
        self.pinned: Offsets | None = None

    def initialOffset(self) -> dict[str, Any]:
        return _encode(_starts(self.path))

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadAllAvailable() if self.max_rows is None else ReadMaxRows(self.max_rows)

    def prepareForTriggerAvailableNow(self) -> None:
        self.pinned = _ends(self.path)

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        ends = self.pinned if self.pinned is not None else _ends(self.path)
        max_rows = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        return _encode(limit_ends(_decode(start), ends, max_rows))

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[LogRange]:
        first, last = _decode(start), _decode(end)
        return [
            LogRange(str(self.path), p, first.get(p, 0), stop)
            for p, stop in sorted(last.items())
            if stop > first.get(p, 0)
        ]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, LogRange)
        return read_range(partition, self.arrow_schema)

    def commit(self, end: dict[str, Any]) -> None:
        if self.reader_name is not None:
            commit_reader(self.path, self.reader_name, _decode(end))


class KeyshiftLogReader(DataSourceReader):
    """A batch read of everything the log keeps now."""

    def __init__(self, options: dict[str, str], schema: StructType) -> None:
        self.path = _path(options)
        self.arrow_schema = to_arrow_schema(schema)

    def partitions(self) -> list[LogRange]:
        starts, ends = _starts(self.path), _ends(self.path)
        return [LogRange(str(self.path), p, starts[p], ends[p]) for p in sorted(ends)] or [
            LogRange(str(self.path), 0, 0, 0)
        ]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, LogRange)
        if partition.end > partition.start:
            yield from read_range(partition, self.arrow_schema)
