"""Spark's writers into a keyshift job: `df.writeStream.format("keyshift")` and `df.write`.

Built by keyshift.spark.datasource.KeyshiftDataSource on the driver; `write` runs in Spark's
Python workers, `commit` / `abort` on the driver. Two phases, like Flink's two-phase-commit
sinks: each task stages its partition's rows at the job's ingest endpoint under the micro-
batch's transaction (`<query id>:<batch id>`) and parts (`<partition>-<attempt>-<n>`, each a
push within the endpoint's limits `maxRequestRows` / `maxRequestBytes`); the driver's
`commit` applies the parts of the successful attempts at once, and the endpoint applies a
transaction only once. So a retried task replaces its part, a micro-batch that Spark re-runs
after a restart from its checkpoint is not counted twice, and a failed micro-batch leaves
nothing behind (`abort`, or expiry of the staged parts).

With option `dueColumn` (a column saying when each row fell due: epoch microseconds, or a
timestamp), every push also reports the writer's backlog (keyshift.runtime.ingest_backlog): the
rows due by now but not pushed yet, estimated from the due times of the rows it pushes (their
rate, and how long ago the last of them fell due), and the age of the oldest. The job's
autoscaler sizes the job for it: without it, a job that pushes back sees only what it manages.

Rows that do not fit the job's schema are rejected at staging, with reasons. The valid rows of
the batch are committed; then, with `badRows` = `fail` (the default), commit raises
KeyshiftRejectedRows so the error reaches the query; with `drop`, they are dropped and counted
(the job's rejected-records metric and log).
"""

from __future__ import annotations

import os
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial

import grpc
import pyarrow as pa
import pyarrow.compute as pc
from pyspark import TaskContext
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)

from keyshift.runtime.auth import Security
from keyshift.runtime.ingest_backlog import ClientBacklog
from keyshift.runtime.ingest_client import IngestClient, IngestError, IngestReply
from keyshift.runtime.job import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_REQUEST_ROWS
from keyshift.runtime.job_secret import SECRET_ENV

# Statuses worth retrying: the job pushes back (its queue is full) or is briefly unreachable.
RETRYABLE = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE})
BAD_ROWS = ("fail", "drop")


class KeyshiftRejectedRows(ValueError):
    """Rows of a micro-batch did not fit the job's schema (the valid ones were committed)."""


class KeyshiftWriteError(RuntimeError):
    """The job's ingest endpoint refused or could not take a micro-batch."""


@dataclass(frozen=True)
class WriterOptions:
    endpoints: tuple[str, ...]
    bad_rows: str
    timeout: float  # seconds to keep retrying a backpressured or unreachable endpoint
    security: Security  # the job's token (and TLS settings) every push presents
    max_request_rows: int = DEFAULT_MAX_REQUEST_ROWS  # the job's ingest source's limits
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    due_column: str | None = None  # when each row fell due, for the backlog report

    @classmethod
    def parse(cls, options: dict[str, str]) -> WriterOptions:
        """The writer's options (Spark lower-cases option names); ValueError saying what is
        wrong."""
        raw = options.get("endpoint", "")
        endpoints = tuple(e.strip() for e in raw.split(",") if e.strip())
        if not endpoints:
            raise ValueError(
                "option 'endpoint' is required: the job's ingest address host:port "
                "(several, comma-separated, for a source stage with several instances)"
            )
        for endpoint in endpoints:
            host, sep, port = endpoint.rpartition(":")
            if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
                raise ValueError(f"option 'endpoint': {endpoint!r} is not host:port")
        bad_rows = options.get("badrows", "fail")
        if bad_rows not in BAD_ROWS:
            raise ValueError(f"option 'badRows' must be one of {BAD_ROWS}, got {bad_rows!r}")
        try:
            timeout = float(options.get("timeout", "300"))
        except ValueError:
            raise ValueError(
                f"option 'timeout' must be seconds, got {options['timeout']!r}"
            ) from None
        if timeout <= 0:
            raise ValueError(f"option 'timeout' must be positive, got {timeout}")
        # Option `token` holds the job's secret; without it the environment's is used (TLS
        # settings always come from the environment).
        environ = dict(os.environ)
        if options.get("token"):
            environ[SECRET_ENV] = options["token"]
        try:
            security = Security.from_env(environ)
        except ValueError as exc:
            raise ValueError(f"option 'token': {exc}") from None
        rows = _positive_int(options, "maxrequestrows", DEFAULT_MAX_REQUEST_ROWS)
        size = _positive_int(options, "maxrequestbytes", DEFAULT_MAX_REQUEST_BYTES)
        due = options.get("duecolumn")
        if due is not None and not due.strip():
            raise ValueError("option 'dueColumn' must name a column, got an empty string")
        return cls(endpoints, bad_rows, timeout, security, rows, size, due)


def check_due_column(options: WriterOptions, columns: Sequence[str]) -> None:
    """ValueError, when the query starts, if option dueColumn names a column the DataFrame
    does not have."""
    if options.due_column is not None and options.due_column not in columns:
        raise ValueError(
            f"option 'dueColumn' names {options.due_column!r}, which the DataFrame does not have "
            f"(it has {', '.join(columns)})"
        )


def _positive_int(options: dict[str, str], name: str, default: int) -> int:
    raw = options.get(name, str(default))
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"option {name!r} must be a positive whole number, got {raw!r}")
    return int(raw)


@dataclass
class StagedParts(WriterCommitMessage):
    """What one task staged: picklable, it travels from the worker to the driver's commit."""

    transaction: str
    endpoint: str
    parts: list[str]
    rows: int = 0
    rejected: int = 0
    reasons: list[str] = field(default_factory=list)


def _retrying(
    call: str, endpoint: str, timeout: float, attempt: Callable[[], IngestReply]
) -> IngestReply:
    """Run `attempt`, retrying while the job pushes back or is unreachable, until `timeout`."""
    deadline = time.monotonic() + timeout
    delay = 0.05
    while True:
        try:
            return attempt()
        except IngestError as exc:
            if exc.code not in RETRYABLE or time.monotonic() + delay > deadline:
                raise KeyshiftWriteError(f"{call} at keyshift endpoint {endpoint}: {exc}") from exc
        time.sleep(delay)
        delay = min(delay * 2, 1.0)


class _IngestWriter:
    """The part both writers share: stage a task's rows, commit or abort a transaction."""

    def __init__(self, options: dict[str, str], transaction: str | None) -> None:
        self.options = WriterOptions.parse(options)
        self.transaction = transaction  # the batch writer's; a stream's is per micro-batch

    def _stage(
        self, batches: Iterator[pa.RecordBatch], transaction: str, client_id: str
    ) -> StagedParts:
        """Stage a task's rows; `client_id` names the writer in its backlog reports (one for all
        its tasks: each reports the whole stream's backlog as it sees it)."""
        context = TaskContext.get()
        partition = context.partitionId() if context else 0
        attempt = context.attemptNumber() if context else 0
        endpoint = self.options.endpoints[partition % len(self.options.endpoints)]
        staged = StagedParts(transaction, endpoint, [])
        limits = (self.options.max_request_rows, self.options.max_request_bytes)
        with IngestClient(endpoint, *limits, self.options.security) as client:
            index = 0
            for rows in _chunks(batches, limits[1]):
                left = rows.num_rows
                for fmt, payload, count in client.pieces(rows):
                    left -= count
                    backlog = self._backlog(rows, left, client_id, time.time())
                    part = f"{partition}-{attempt}-{index}"
                    index += 1
                    reply = _retrying(
                        "staging",
                        endpoint,
                        self.options.timeout,
                        partial(
                            client.stage_payload, fmt, payload, transaction, part, backlog=backlog
                        ),
                    )
                    staged.parts.append(part)
                    staged.rows += count - reply.rejected
                    staged.rejected += reply.rejected
                    staged.reasons += [r for r in reply.reasons if r not in staged.reasons]
        return staged

    def _backlog(
        self, rows: pa.Table, left: int, client_id: str, now: float
    ) -> ClientBacklog | None:
        """What is due and not pushed at `now` (epoch seconds) once a piece of `rows` is,
        `left` of them still to go; None without option dueColumn."""
        column = self.options.due_column
        if column is None:
            return None
        due, oldest = due_backlog(rows, column, rows.num_rows - left, now)
        # Each endpoint hears of its share: the job sums its source instances' reports.
        return ClientBacklog(client_id, due // len(self.options.endpoints), oldest)

    def _commit(self, messages: Sequence[WriterCommitMessage | None], what: str) -> None:
        staged = [m for m in messages if isinstance(m, StagedParts)]
        by_endpoint: dict[tuple[str, str], list[str]] = defaultdict(list)
        for message in staged:
            by_endpoint[(message.endpoint, message.transaction)] += message.parts
        for (endpoint, transaction), parts in sorted(by_endpoint.items()):
            if not parts:
                continue  # only empty partitions went there
            with IngestClient(endpoint, security=self.options.security) as client:
                _retrying(
                    "commit",
                    endpoint,
                    self.options.timeout,
                    partial(client.commit, transaction, parts),
                )
        rejected = sum(m.rejected for m in staged)
        if rejected and self.options.bad_rows == "fail":
            reasons = sorted({r for m in staged for r in m.reasons})
            written = sum(m.rows for m in staged)
            raise KeyshiftRejectedRows(
                f"{rejected} rows of {what} do not fit the keyshift job's schema "
                f"({'; '.join(reasons)}); its {written} valid rows were written. Fix the rows, "
                "or set option badRows=drop to drop such rows and go on"
            )

    def _abort(self, messages: Sequence[WriterCommitMessage | None]) -> None:
        for message in {
            (m.endpoint, m.transaction) for m in messages if isinstance(m, StagedParts)
        }:
            endpoint, transaction = message
            try:
                with IngestClient(endpoint, security=self.options.security) as client:
                    client.abort(transaction)
            except IngestError:
                pass  # staged parts expire at the endpoint by themselves


def due_backlog(rows: pa.Table, column: str, pushed: int, now: float) -> tuple[int, float]:
    """(rows due by `now` and not pushed, seconds since the oldest of them fell due) once the
    first `pushed` of `rows` are, from `column`, when each row fell due. Rows later than these
    are not known here: they are estimated from these rows' rate over their span of due times,
    as due since the last of them; rows without a due time count as due."""
    if column not in rows.column_names:
        raise KeyshiftWriteError(
            f"option 'dueColumn' names {column!r}, which the rows do not have (they have "
            f"{', '.join(rows.column_names)})"
        )
    values = rows.column(column)
    if pa.types.is_timestamp(values.type):
        values = values.cast(pa.timestamp("us", values.type.tz)).cast(pa.int64())
    elif not pa.types.is_integer(values.type):
        raise KeyshiftWriteError(
            f"option 'dueColumn': column {column!r} must hold epoch microseconds or timestamps, "
            f"not {values.type}"
        )
    left = rows.num_rows - pushed
    known = pc.drop_null(values)
    if len(known) == 0:
        return left, 0.0
    first, last = pc.min(known).as_py() / 1e6, pc.max(known).as_py() / 1e6
    rate = (len(known) - 1) / (last - first) if last > first else 0.0
    later = int(rate * max(now - last, 0.0))
    next_due = values[pushed].as_py() if left else None
    oldest = next_due / 1e6 if next_due is not None else (last if later else now)
    return left + later, max(now - oldest, 0.0)


def _chunks(batches: Iterator[pa.RecordBatch], max_bytes: int) -> Iterator[pa.Table]:
    """The task's rows as tables of about `max_bytes` (a push's worth: the task holds no more
    than that at once); none for an empty partition."""
    pending: list[pa.RecordBatch] = []
    size = 0
    for batch in batches:
        if batch.num_rows == 0:
            continue
        pending.append(batch)
        size += batch.nbytes
        if size >= max_bytes:
            yield pa.Table.from_batches(pending)
            pending, size = [], 0
    if pending:
        yield pa.Table.from_batches(pending)


class KeyshiftStreamWriter(_IngestWriter, DataSourceStreamArrowWriter):
    def __init__(self, options: dict[str, str]) -> None:
        super().__init__(options, None)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> StagedParts:
        context = TaskContext.get()
        query = context.getLocalProperty("sql.streaming.queryId") if context else None
        batch = context.getLocalProperty("streaming.sql.batchId") if context else None
        if not query or batch is None:
            raise KeyshiftWriteError("no streaming query id or batch id in the task's context")
        # The query id survives restarts from the checkpoint, so a re-run batch has the same
        # transaction and is committed once.
        return self._stage(iterator, f"{query}:{batch}", query)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        self._commit(messages, f"micro-batch {batchId}")

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        self._abort(messages)


class KeyshiftBatchWriter(_IngestWriter, DataSourceArrowWriter):
    def __init__(self, options: dict[str, str]) -> None:
        super().__init__(options, f"write:{uuid.uuid4()}")

    def write(self, iterator: Iterator[pa.RecordBatch]) -> StagedParts:
        assert self.transaction is not None
        return self._stage(iterator, self.transaction, self.transaction)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        self._commit(messages, "the write")

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        self._abort(messages)
