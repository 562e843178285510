"""The job's late-records log: records too late for their event-time windows (their window's
end plus the stage's allowed lateness already behind the watermark), kept where the user can
read them instead of vanishing. Written by the keyed instances (keyshift.runtime.keyed_stage);
read with keyshift.runtime.output_log's OutputLogReader.

Layout: an output log per keyed stage, a partition per instance::

    <path>/<stage>/part-<instance index:05d>/<start>-<end>.<jsonl|parquet>

One row per record and window it was too late for (a record of a sliding window may be in
time for some of its windows and not for others): the record's fields, its key as it came,
`window_start` and its `event_time`. Each batch is written at once (late records are few, and
must not wait in memory for a crash); a later instance of the same index goes on after the
last one's segments (one writer at a time). A recovery does not truncate this log: a late
record replayed after a crash may be written twice (at least once).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow as pa

from keyshift.runtime.job import LateRecordsLog
from keyshift.runtime.output_log import OutputLogWriter, OutputStorageError
from keyshift.runtime.records import GROUP, INGEST_TIME, SEQ, SOURCE

log = logging.getLogger("keyshift.late")

# Columns that only mean something inside the job.
INTERNAL = (INGEST_TIME, SOURCE, SEQ, GROUP)
SEGMENT_RECORDS = 100_000


class LateRecordsWriter:
    """One keyed instance's partition of the late-records log."""

    def __init__(self, settings: LateRecordsLog, stage: str, index: int) -> None:
        self.writer = OutputLogWriter(
            Path(settings.path) / stage, index, settings.format, SEGMENT_RECORDS
        )

    def write(self, rows: pa.RecordBatch) -> None:
        """Append `rows` and write them now. A write the disk refuses keeps them buffered: the
        next write tries them again (the stage goes on meanwhile)."""
        kept = [name for name in rows.schema.names if name not in INTERNAL]
        self.writer.append(rows.select(kept))
        try:
            self.writer.flush()
        except OutputStorageError as exc:
            log.warning("late records kept in memory for now: %s", exc)

    def close(self) -> None:
        try:
            self.writer.close()
        except OutputStorageError as exc:
            log.error("late records lost with the instance: %s", exc)
