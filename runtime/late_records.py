"""The job's late-records log: records too late for their event-time windows (their window's
end plus the stage's allowed lateness already behind the watermark), and records whose event
time is missing, null or not a timestamp, kept where the user can read them instead of
vanishing. Late records are written by the keyed instances (keyshift.runtime.keyed_stage), bad
event times by the instance that finds them (`InstanceContext.bad_event_times`: the source's
ingest endpoint and chained functions); read with keyshift.runtime.output_log's
OutputLogReader.

Layout: an output log per keyed stage, a partition per instance::

    <path>/<stage>/part-<instance index:05d>/<start>-<end>.<jsonl|parquet>

One row per record and window it was too late for (a record of a sliding window may be in
time for some of its windows and not for others): the record's fields, its key as it came,
`window_start` and its `event_time`. Each batch is written at once (late records are few, and
must not wait in memory for a crash); a later instance of the same index goes on after the
last one's segments (one writer at a time). A recovery does not truncate this log: a late
record replayed after a crash may be written twice (at least once).

A record with a bad event time has no schema to keep it in (its values may not fit the job's):
it is one row of `reason` and `record` (the record as JSON text, values JSON cannot hold as
their repr), in the partition of the instance that found it, under its stage (the source
stage's name for rows refused at ingest or made by a chained function).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from keyshift.runtime.job import LateRecordsLog
from keyshift.runtime.output_log import OutputLogWriter, OutputStorageError
from keyshift.runtime.records import GROUP, INGEST_TIME, SEQ, SOURCE

log = logging.getLogger("keyshift.late")

# The reason label of records with a bad event time in keyshift_invalid_records_total.
BAD_EVENT_TIME = "event_time"
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


class BadEventTimesWriter:
    """One instance's partition of the log for records whose event time is bad; written from
    the stage loop and the ingest endpoint's threads alike."""

    def __init__(self, settings: LateRecordsLog, stage: str, index: int) -> None:
        self.log = LateRecordsWriter(settings, stage, index)
        self.lock = threading.Lock()

    def write(self, records: Sequence[Any], reasons: Sequence[str]) -> None:
        rows = pa.record_batch(
            {
                "reason": pa.array(list(reasons), pa.string()),
                "record": pa.array([json.dumps(r, default=repr) for r in records], pa.string()),
            }
        )
        with self.lock:
            self.log.write(rows)

    def close(self) -> None:
        with self.lock:
            self.log.close()
