"""The sink's ordered, offset-addressed output log: one partition per sink instance, written as
immutable segment files. Written by the sink stage instances; read by tests, the local host's
report and the PySpark reader (keyshift.spark.log_reader).

Layout::

    <path>/part-<partition:05d>/<start:020d>-<end:020d>.<jsonl|parquet>

A segment file holds the records with offsets ``start .. end-1``; a record's offset is its
index in its partition, counted from 0. Every file carries an ``offset`` int64 column first,
followed by the columns of the appended record batches. Files are written to a ``.tmp`` name
in the same directory, fsynced and renamed into place, so a segment is either absent or
complete, and is never changed once written. Exactly one writer owns a partition at a time.

Readers that must see every record (named in the sink's `readers`) record how far they have
read in ``<path>/_readers/<name>.json`` (``{"<partition>": offset}``); the writer may then trim
a partition: it writes ``<partition>/trimmed`` (the first offset still kept) and deletes the
segments below it. Offsets never change; reading below the trimmed offset is an error.

A job that takes checkpoints *publishes* its output: ``<partition>/published`` holds the offset
below which records are final, and readers see nothing past it (as Kafka's read_committed
consumers, or Flink's two-phase-commit sinks). The sink moves it up to a checkpoint's offset
once that checkpoint is complete, and to the end when the job finishes; a recovery truncates
the log back to its checkpoint's offset, so what readers saw is never made again. Without
the file, every complete segment is visible.

A write the disk refuses (full: ENOSPC, or any other OSError) raises OutputStorageError, a
retryable StorageError, and leaves the writer as it was before the write: the records stay
buffered, no partial file is left, and the same call may be made again once there is space.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO, Final

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from keyshift.runtime.records import READER_NAME
from keyshift.runtime.storage import StorageError

FORMATS: Final = ("jsonl", "parquet", "none")
OFFSET_COLUMN: Final = "offset"
TMP_SUFFIX: Final = ".tmp"
TRIMMED_FILE: Final = "trimmed"
PUBLISHED_FILE: Final = "published"
READERS_DIR: Final = "_readers"

log = logging.getLogger("keyshift.output_log")

_SEGMENT_NAME = re.compile(r"^(\d{20})-(\d{20})\.(jsonl|parquet)$")
_PARTITION_NAME = re.compile(r"^part-(\d{5,})$")
_JSON_BLOCK_SIZE = 16 << 20


class OutputLogError(ValueError):
    """A log that cannot be written or read as asked: missing, corrupt or misused."""


class OutputStorageError(StorageError):
    """The disk refused a write to the log (full, or failing); retryable."""


def partition_dir_name(partition: int) -> str:
    """The name of a partition's directory inside the log directory."""
    return f"part-{partition:05d}"


def segment_file_name(start: int, end: int, fmt: str) -> str:
    """The name of the segment file holding offsets ``start .. end-1``."""
    return f"{start:020d}-{end:020d}.{fmt}"


@dataclass(frozen=True)
class Segment:
    """One complete segment file: the records with offsets in [start, end)."""

    start: int
    end: int
    format: str
    path: Path

    @property
    def records(self) -> int:
        return self.end - self.start


def _offset_file(path: Path) -> int | None:
    """The offset an offset file holds; None when there is no such file."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        offset = int(text)
    except ValueError:
        raise OutputLogError(f"corrupt output log: {path} holds {text[:40]!r}") from None
    if offset < 0:
        raise OutputLogError(f"corrupt output log: {path} is negative")
    return offset


def trimmed_offset(partition_dir: Path) -> int:
    """The first offset a partition still keeps (0 until it is trimmed)."""
    return _offset_file(partition_dir / TRIMMED_FILE) or 0


def published_offset(partition_dir: Path) -> int | None:
    """The offset below which a partition's records are final (None: all of them are)."""
    return _offset_file(partition_dir / PUBLISHED_FILE)


def list_segments(partition_dir: Path) -> list[Segment]:
    """The complete segments of a partition directory in offset order.

    Ignores ``.tmp`` and other unrelated files, and segments below the trimmed offset (a trim
    interrupted before it deleted them). Raises OutputLogError when the segments do not tile
    the offsets from the trimmed offset without a gap or an overlap.
    """
    segments: list[Segment] = []
    try:
        entries = list(os.scandir(partition_dir))
    except FileNotFoundError:
        raise OutputLogError(f"output log partition {partition_dir} does not exist") from None
    except NotADirectoryError:
        raise OutputLogError(f"output log partition {partition_dir} is not a directory") from None
    trimmed = trimmed_offset(partition_dir)
    for entry in entries:
        m = _SEGMENT_NAME.match(entry.name)
        if m is None:
            continue
        start, end = int(m.group(1)), int(m.group(2))
        if end <= start:
            raise OutputLogError(
                f"corrupt output log: segment {entry.path} has end offset {end} <= start {start}"
            )
        if end > trimmed:
            segments.append(Segment(start, end, m.group(3), Path(entry.path)))
    segments.sort(key=lambda s: (s.start, s.end))
    expected = trimmed
    previous: Segment | None = None
    for seg in segments:
        if seg.start != expected:
            after = f"after {previous.path.name}" if previous else "at the start of the partition"
            what = "gap" if seg.start > expected else "overlap"
            raise OutputLogError(
                f"corrupt output log: {what} {after} in {partition_dir}: expected a segment "
                f"starting at offset {expected}, found {seg.path.name}"
            )
        expected = seg.end
        previous = seg
    return segments


def reader_offsets(path: str | Path) -> dict[str, dict[int, int]]:
    """What each named reader has committed: reader -> partition -> first offset not needed."""
    found: dict[str, dict[int, int]] = {}
    directory = Path(path) / READERS_DIR
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return found
    for entry in entries:
        name, dot, ext = entry.name.rpartition(".")
        if not dot or ext != "json" or not READER_NAME.match(name):
            continue
        try:
            data = json.loads(Path(entry.path).read_bytes())
            found[name] = {int(p): int(o) for p, o in data.items()}
        except FileNotFoundError:
            continue
        except (ValueError, TypeError, AttributeError) as exc:
            raise OutputLogError(f"corrupt reader offsets {entry.path}: {exc}") from None
    return found


def commit_reader(path: str | Path, reader: str, offsets: dict[int, int]) -> None:
    """Record that `reader` no longer needs the records below `offsets` in each partition."""
    if not READER_NAME.match(reader):
        raise OutputLogError(
            f"reader name {reader!r} must be 1-100 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit"
        )
    directory = Path(path) / READERS_DIR
    directory.mkdir(exist_ok=True)
    data = json.dumps({str(p): int(o) for p, o in sorted(offsets.items())}).encode()
    _write_atomically(directory / f"{reader}.json", lambda f: f.write(data))


# --------------------------------------------------------------------------------------------
# Writing


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory handles
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(final: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write a file under a ``.tmp`` name, fsync it and rename it to ``final``."""
    tmp = final.with_name(final.name + TMP_SUFFIX)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(exc, OSError):
            raise OutputStorageError(f"cannot write {final}: {exc}", retryable=True) from exc
        raise
    _fsync_dir(final.parent)


_encode_str: Callable[[str], str] = json.encoder.encode_basestring
_NEEDS_ESCAPE: Final = r'["\\\x00-\x1f]'


def _large(text: str) -> pa.Scalar:
    return pa.scalar(text, pa.large_string())


def _join(parts: list[Any]) -> pa.Array:
    """Concatenate string arrays and scalars element-wise."""
    return pc.binary_join_element_wise(*parts, _large(""))


def _json_texts(column: pa.ChunkedArray | pa.Array) -> pa.Array:
    """The JSON text of each value of a column as a large_string array, ``null`` for nulls.

    Vectorized in Arrow except for strings that need escaping and for unusual column types.
    """
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    typ = arr.type
    if pa.types.is_null(typ):
        texts = pa.array(["null"] * len(arr), pa.large_string())
    elif pa.types.is_integer(typ):
        texts = pc.cast(arr, pa.large_string())
    elif pa.types.is_floating(typ):
        # Arrow prints the shortest text that reads back as the same double, like repr(), but
        # drops the ".0" of integral values ("1", "-0", "1e+20" keeps its exponent). JSON has no
        # NaN or infinities; write them as Python's json module does.
        texts = pc.cast(arr, pa.large_string())
        integral = pc.invert(pc.match_substring_regex(texts, "[.en]"))
        texts = pc.if_else(integral, _join([texts, _large(".0")]), texts)
        if pc.any(pc.invert(pc.is_finite(arr))).as_py():
            texts = pc.replace_substring(texts, "nan", "NaN")
            texts = pc.replace_substring(texts, "inf", "Infinity")
    elif pa.types.is_boolean(typ):
        texts = pc.if_else(arr, _large("true"), _large("false"))
    elif pa.types.is_string(typ) or pa.types.is_large_string(typ):
        if pc.any(pc.match_substring_regex(arr, _NEEDS_ESCAPE)).as_py():
            values = pc.fill_null(arr, "").to_pylist()
            texts = pa.array(map(_encode_str, values), pa.large_string(), mask=arr.is_null())
        else:
            texts = _join([_large('"'), pc.cast(arr, pa.large_string()), _large('"')])
    else:
        values = arr.to_pylist()
        dumped = [json.dumps(v, separators=(",", ":"), default=str) for v in values]
        texts = pa.array(dumped, pa.large_string())
    return pc.fill_null(texts, _large("null"))


def encode_jsonl(table: pa.Table) -> bytes:
    """A table as JSON Lines: one object per row, keyed by column name, in column order."""
    if table.num_rows == 0:
        return b""
    parts: list[Any] = []
    for i, (name, column) in enumerate(zip(table.column_names, table.columns, strict=True)):
        key = ("{" if i == 0 else ",") + json.dumps(name) + ":"
        parts += [_large(key), _json_texts(column)]
    parts.append(_large("}\n"))
    lines = _join(parts)
    if isinstance(lines, pa.ChunkedArray):
        lines = lines.combine_chunks()
    # The lines are contiguous in the array's data buffer: hand that out in one piece.
    _, offsets_buf, data_buf = lines.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int64)
    begin = int(offsets[lines.offset])
    end = int(offsets[lines.offset + len(lines)])
    return bytes(data_buf.slice(begin, end - begin))


class OutputLogWriter:
    """Appends record batches to one partition of an output log.

    ``append`` assigns offsets and buffers; whenever ``segment_records`` records are buffered
    they are written as full segments, and ``flush`` writes what remains as a smaller segment.
    A writer opened on an existing partition continues after its last complete segment (stray
    ``.tmp`` files from a crash are deleted). With format ``none`` offsets advance but nothing
    touches the disk. Not thread-safe; one writer per partition.
    """

    def __init__(self, path: str | Path, partition: int, format: str, segment_records: int) -> None:
        if format not in FORMATS:
            raise OutputLogError(f"unknown output log format {format!r}; expected one of {FORMATS}")
        if segment_records < 1:
            raise OutputLogError(f"segment_records must be >= 1, got {segment_records}")
        if partition < 0:
            raise OutputLogError(f"partition must be >= 0, got {partition}")
        self._partition = partition
        self._dir = Path(path) / partition_dir_name(partition)
        self._format = format
        self._segment_records = segment_records
        self._schema: pa.Schema | None = None
        self._buffer: list[pa.RecordBatch] = []
        self._buffered = 0
        self._records_written = 0
        self._closed = False
        self._next_segment_start = 0
        self._trimmed = 0
        self._published: int | None = None
        if format != "none":
            try:
                self._dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise OutputStorageError(f"cannot make {self._dir}: {exc}", retryable=True) from exc
            for entry in os.scandir(self._dir):
                if entry.name.endswith(TMP_SUFFIX):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
            self._trimmed = trimmed_offset(self._dir)
            self._published = published_offset(self._dir)
            self._delete_trimmed()
            segments = list_segments(self._dir)
            self._next_segment_start = segments[-1].end if segments else self._trimmed

    @property
    def partition(self) -> int:
        return self._partition

    @property
    def directory(self) -> Path:
        """The partition's directory (not created for format ``none``)."""
        return self._dir

    @property
    def format(self) -> str:
        return self._format

    @property
    def end_offset(self) -> int:
        """The offset the next appended record gets."""
        return self._next_segment_start + self._buffered

    @property
    def records_written(self) -> int:
        """Records this writer has put into segments (for ``none``: accepted); not buffered ones."""
        return self._records_written

    @property
    def buffered_records(self) -> int:
        return self._buffered

    @property
    def trimmed_offset(self) -> int:
        """The first offset still kept in the partition's files."""
        return self._trimmed

    @property
    def visible_offset(self) -> int:
        """The offset readers can read up to: the published one, if the log publishes."""
        end = self.end_offset
        return end if self._published is None else min(self._published, end)

    def publish(self, offset: int) -> None:
        """Let readers see the records below `offset` (in segments: flush first)."""
        if self._format == "none" or offset == self._published:
            return
        if offset > self._next_segment_start:
            raise OutputLogError(
                f"cannot publish offset {offset} of partition {self._partition}: its segments "
                f"end at {self._next_segment_start}"
            )
        text = str(offset).encode()
        _write_atomically(self._dir / PUBLISHED_FILE, lambda f: f.write(text))
        self._published = offset

    def trim(self, below: int) -> int:
        """Delete the complete segments that end at or below `below`; the records deleted.

        The new trimmed offset is written first, so a crash in between leaves segments that
        readers already ignore (the next writer deletes them).
        """
        if self._format == "none":
            return 0
        doomed = [s for s in list_segments(self._dir) if s.end <= below]
        if not doomed:
            return 0
        new_trimmed = doomed[-1].end
        text = str(new_trimmed).encode()
        _write_atomically(self._dir / TRIMMED_FILE, lambda f: f.write(text))
        self._trimmed = new_trimmed
        self._delete_trimmed()
        return sum(s.records for s in doomed)

    def truncate(self, offset: int) -> int:
        """Drop the records from `offset` on (a recovery rewinds the log to a checkpoint's
        offset, always a segment boundary); the records dropped. Nothing may be buffered."""
        if self._buffered:
            raise OutputLogError("truncate with buffered records")
        if self._format == "none":
            dropped = max(self._next_segment_start - offset, 0)
            self._next_segment_start = min(self._next_segment_start, offset)
            return dropped
        if offset < self._trimmed:
            raise OutputLogError(
                f"cannot truncate partition {self._partition} to offset {offset}: its readers "
                f"already let the log delete everything below {self._trimmed}"
            )
        segments = list_segments(self._dir)
        if offset > (segments[-1].end if segments else self._trimmed):
            raise OutputLogError(
                f"cannot truncate partition {self._partition} to offset {offset}: the log "
                f"ends at {self.end_offset}"
            )
        dropped = 0
        for seg in reversed(segments):
            if seg.start < offset < seg.end:
                raise OutputLogError(
                    f"offset {offset} is inside segment {seg.path.name}, not at a boundary"
                )
        if self._published is not None and offset < self._published:
            # Only a recovery that had to skip a corrupt checkpoint goes back this far: readers
            # may have read records that are now made again.
            log.error(
                "partition %d goes back to offset %d, below the published %d: readers may see "
                "records %d..%d again",
                self._partition, offset, self._published, offset, self._published - 1,
            )  # fmt: skip
            self.publish(offset)
        for seg in reversed(segments):
            if seg.start >= offset:
                seg.path.unlink()
                dropped += seg.records
        _fsync_dir(self._dir)
        self._next_segment_start = offset
        return dropped

    def _delete_trimmed(self) -> None:
        for entry in os.scandir(self._dir):
            m = _SEGMENT_NAME.match(entry.name)
            if m is not None and int(m.group(2)) <= self._trimmed:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)

    def append(self, batch: pa.RecordBatch) -> int:
        """Buffer a batch; return the offset of its first record (an empty batch is ignored)."""
        if self._closed:
            raise OutputLogError(f"output log writer for {self._dir} is closed")
        first = self.end_offset
        rows = batch.num_rows
        if rows == 0:
            return first
        batch = self._conform(batch)
        if self._format == "none":
            self._next_segment_start += rows
            self._records_written += rows
            return first
        self._buffer.append(batch)
        self._buffered += rows
        if self._buffered >= self._segment_records:
            self._drain(full_only=True)
        return first

    def flush(self) -> None:
        """Write everything buffered, the remainder as a segment smaller than segment_records."""
        if self._buffered:
            self._drain(full_only=False)

    def close(self) -> None:
        """Flush and refuse further appends. Idempotent."""
        if not self._closed:
            self.flush()
            self._closed = True

    def __enter__(self) -> OutputLogWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _conform(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        if self._schema is None:
            if OFFSET_COLUMN in batch.schema.names:
                raise OutputLogError(
                    f"record batches written to the output log must not have a column named "
                    f"{OFFSET_COLUMN!r}; the log adds it"
                )
            # Nullability and metadata are not part of the log's contract: drop them so batches
            # built in different ways still concatenate.
            self._schema = pa.schema([pa.field(f.name, f.type) for f in batch.schema])
        if batch.schema.equals(self._schema):
            return batch
        if batch.schema.names == self._schema.names and batch.schema.types == self._schema.types:
            return pa.RecordBatch.from_arrays(batch.columns, schema=self._schema)
        raise OutputLogError(
            f"record batch schema {batch.schema} differs from the schema of partition "
            f"{self._partition} ({self._schema})"
        )

    def _drain(self, full_only: bool) -> None:
        table = pa.Table.from_batches(self._buffer, schema=self._schema)
        size = self._segment_records
        done = 0
        try:
            while table.num_rows - done >= size or (not full_only and done < table.num_rows):
                count = min(size, table.num_rows - done)
                self._write_segment(table.slice(done, count))
                done += count
        finally:
            rest = table.slice(done)
            self._buffer = [b for b in rest.to_batches() if b.num_rows]
            self._buffered = rest.num_rows

    def _write_segment(self, table: pa.Table) -> None:
        start = self._next_segment_start
        end = start + table.num_rows
        offsets = pa.array(np.arange(start, end, dtype=np.int64))
        table = table.add_column(0, pa.field(OFFSET_COLUMN, pa.int64()), offsets)
        final = self._dir / segment_file_name(start, end, self._format)
        if self._format == "jsonl":
            data = encode_jsonl(table)

            def write(f: BinaryIO) -> None:
                f.write(data)

        else:

            def write(f: BinaryIO) -> None:
                pq.write_table(table, f)

        _write_atomically(final, write)
        self._next_segment_start = end
        self._records_written += table.num_rows


# --------------------------------------------------------------------------------------------
# Reading

_JSON_NATIVE_TYPES: Final = (pa.int64(), pa.float64(), pa.string(), pa.bool_(), pa.null())


def _parse_jsonl(source: Path | bytes) -> pa.Table:
    """Parse JSON Lines written by the writer; ``offset`` is int64, strings stay strings."""
    fields: dict[str, Any] = {OFFSET_COLUMN: pa.int64()}

    def parse() -> pa.Table:
        stream = io.BytesIO(source) if isinstance(source, bytes) else source
        return pa_json.read_json(
            stream,
            read_options=pa_json.ReadOptions(block_size=_JSON_BLOCK_SIZE),
            parse_options=pa_json.ParseOptions(explicit_schema=pa.schema(list(fields.items()))),
        )

    try:
        table = parse()
        # Arrow infers timestamps from strings that look like dates: ask for strings instead.
        retyped = {f.name: pa.string() for f in table.schema if f.type not in _JSON_NATIVE_TYPES}
        if retyped:
            fields.update(retyped)
            table = parse().select(table.column_names)
        return table
    except pa.ArrowInvalid:
        # Lines longer than a parse block, or other oddities: parse with the json module.
        text = source if isinstance(source, bytes) else source.read_bytes()
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        return pa.Table.from_pylist(rows)


def _concat(tables: Iterable[pa.Table]) -> pa.Table:
    return pa.concat_tables(list(tables), promote_options="default")


def _empty_table() -> pa.Table:
    return pa.table({OFFSET_COLUMN: pa.array([], pa.int64())})


class OutputLogReader:
    """Reads an output log: its partitions, their end offsets, and records by offset range."""

    def __init__(self, path: str | Path) -> None:
        self._path = Path(path)
        if not self._path.is_dir():
            raise OutputLogError(f"output log {self._path} does not exist or is not a directory")

    @property
    def path(self) -> Path:
        return self._path

    def partitions(self) -> list[int]:
        """The partition numbers present, ascending."""
        try:
            entries = list(os.scandir(self._path))
        except FileNotFoundError:
            raise OutputLogError(f"output log {self._path} does not exist") from None
        found = []
        for entry in entries:
            m = _PARTITION_NAME.match(entry.name)
            if m is not None and entry.is_dir():
                found.append(int(m.group(1)))
        return sorted(found)

    def segments(self, partition: int) -> list[Segment]:
        """The complete segments of a partition in offset order."""
        if partition < 0:
            raise OutputLogError(f"unknown partition {partition} of output log {self._path}")
        part_dir = self._path / partition_dir_name(partition)
        if not part_dir.is_dir():
            raise OutputLogError(
                f"unknown partition {partition} of output log {self._path} (no {part_dir.name})"
            )
        return list_segments(part_dir)

    def end_offset(self, partition: int) -> int:
        """The offset after the last visible record: the last complete segment's end, or the
        published offset if it is lower (the trimmed offset for an empty partition)."""
        return self._visible_end(partition, self.segments(partition))

    def _visible_end(self, partition: int, segments: list[Segment]) -> int:
        part_dir = self._path / partition_dir_name(partition)
        end = segments[-1].end if segments else trimmed_offset(part_dir)
        published = published_offset(part_dir)
        return end if published is None else max(min(end, published), trimmed_offset(part_dir))

    def start_offset(self, partition: int) -> int:
        """The first offset still readable (0 unless the partition was trimmed)."""
        self.segments(partition)  # checks that the partition exists
        return trimmed_offset(self._path / partition_dir_name(partition))

    def read(self, partition: int, start: int, stop: int | None = None) -> pa.Table:
        """The records with offsets in [start, stop) in offset order, ``offset`` column first.

        ``stop`` defaults to (and is capped at) the partition's end offset. Only the segments
        overlapping the range are read.
        """
        if start < 0:
            raise OutputLogError(f"start offset must be >= 0, got {start}")
        if stop is not None and stop < start:
            raise OutputLogError(f"stop offset {stop} is before start offset {start}")
        segments = self.segments(partition)
        trimmed = trimmed_offset(self._path / partition_dir_name(partition))
        if start < trimmed:
            raise OutputLogError(
                f"offsets below {trimmed} of partition {partition} of output log {self._path} "
                f"were deleted after every named reader committed them; cannot read from {start}"
            )
        end = self._visible_end(partition, segments)
        stop = end if stop is None else min(stop, end)
        wanted = [s for s in segments if s.end > start and s.start < stop]
        if not wanted:
            return self._empty_like(segments)
        parts = []
        for seg in wanted:
            table = self._read_segment(seg)
            lo = max(start, seg.start) - seg.start
            hi = min(stop, seg.end) - seg.start
            parts.append(table.slice(lo, hi - lo))
        return _concat(parts)

    def read_all(self, *, with_partition: bool = False) -> pa.Table:
        """Every partition's kept records, partition by partition, each in offset order.

        With ``with_partition`` a ``partition`` int32 column follows ``offset``.
        """
        tables = []
        for p in self.partitions():
            table = self.read(p, self.start_offset(p))
            if with_partition:
                column = pa.array(np.full(table.num_rows, p, dtype=np.int32))
                table = table.add_column(1, "partition", column)
            tables.append(table)
        if not tables:
            table = _empty_table()
            if with_partition:
                table = table.append_column("partition", pa.array([], pa.int32()))
            return table
        return _concat(tables)

    def _read_segment(self, seg: Segment) -> pa.Table:
        try:
            reader = pq.read_table if seg.format == "parquet" else _parse_jsonl
            table = reader(seg.path)
        except FileNotFoundError:
            raise OutputLogError(f"segment {seg.path} disappeared while reading") from None
        except (pa.ArrowException, json.JSONDecodeError) as exc:
            raise OutputLogError(f"corrupt output log segment {seg.path}: {exc}") from exc
        if table.num_rows != seg.records or table.column_names[:1] != [OFFSET_COLUMN]:
            raise OutputLogError(
                f"corrupt output log segment {seg.path}: {table.num_rows} records, "
                f"columns {table.column_names}; expected {seg.records} records, offset first"
            )
        first = table.column(OFFSET_COLUMN)[0].as_py()
        if first != seg.start:
            raise OutputLogError(
                f"corrupt output log segment {seg.path}: first offset {first}, expected {seg.start}"
            )
        return table

    def _empty_like(self, segments: list[Segment]) -> pa.Table:
        """An empty table with the partition's columns (as far as they can be known cheaply)."""
        if not segments:
            return _empty_table()
        seg = segments[0]
        try:
            if seg.format == "parquet":
                return pq.read_schema(seg.path).empty_table()
            with open(seg.path, "rb") as f:
                return _parse_jsonl(f.readline()).slice(0, 0)
        except (OSError, pa.ArrowException, json.JSONDecodeError):
            return _empty_table()
