"""The ingest endpoint: external clients push rows into a job's source stage over gRPC.

Served by source-stage instances whose source is `kind: ingest`; clients use
keyshift.runtime.ingest_client (the PySpark writer is one of them).

Wire format of `keyshift.Ingest/Push` (unary, raw bytes, no generated code): a 4-byte
little-endian header length, a JSON header `{"format": "arrow" | "json", "batch_id": optional
string}` or `{"format": ..., "transaction": string, "part": string}`, either with an optional
`"backlog"` (what the client has not pushed yet: keyshift.runtime.ingest_backlog.ClientBacklog,
versioned; the endpoint keeps each client's latest report for the autoscaler), then the
payload: an Arrow IPC stream (one or more record batches) for "arrow", or a JSON array of row
objects for "json".
The reply is JSON: `{"accepted": n, "rejected": m, "reasons": [up to 5 distinct reasons],
"duplicate": bool, "first_seq": int | null}`.

Rows must carry every field of the job's schema (extra columns are ignored). An optional
`event_time` column (int64 microseconds; an Arrow timestamp column is converted) is the rows'
event time; without it, or where it is null, the event time is the ingest time, except in a
source with event-time settings (`EventTimeCheck`), where a null there is a bad event time (a
column that is absent still means the ingest time). A source that takes its event times from a
field of the job's finds a row whose field is missing, null or not an int a bad event time.
Rows with a bad event time are rejected as any bad row is, and also handed to `on_bad_times`
(the source counts them under the reason `event_time` and writes them to the job's
late-records log). Rows that do
not fit are rejected one by one with a reason (the same reasons as
`keyshift.runtime.schema_check.why_invalid`: strings must be valid UTF-8, floats finite unless
the job's `allow_non_finite` names the field); the valid rows around them are kept, in order,
and nothing accepted can fail a stage later. A body that cannot be parsed at all is refused
with INVALID_ARGUMENT and nothing in it is accepted.

Limits (`IngestLimits`, from the ingest source's job settings): a push of more than
`max_request_bytes` of payload or `max_request_rows` rows is refused whole with
INVALID_ARGUMENT naming the limit (the clients split their pushes under the defaults). JSON is
parsed in chunks of rows straight into Arrow columns, so a push takes about its Arrow size in
memory beside its body, not that of a Python object per value.

The accepted rows of one request become one record batch with consecutive sequence numbers,
put on a bounded queue that the source loop drains with `take`. While the queue is full, Push
waits (the backpressure a client feels) and after `push_timeout` answers RESOURCE_EXHAUSTED.
A request whose `batch_id` was already accepted is answered `duplicate: true` and applied no
second time.

Two-phase pushes (the PySpark writer's): a Push with `transaction` and `part` only validates
and stages its rows (a later Push of the same part replaces them: a retried task);
`keyshift.Ingest/Commit` with JSON `{"transaction": t, "parts": [...]}` queues the named parts
at once, and answers `duplicate: true` for a transaction committed before, so a Spark
micro-batch that is retried or committed twice is applied once; `keyshift.Ingest/Abort` with
`{"transaction": t}` drops the staged parts. Parts nobody commits expire after `staged_ttl`.
Staged parts take at most `max_staged_bytes` (in Arrow): a part that would go past it drops the
least recently staged other transactions first (their commit is then refused with
FAILED_PRECONDITION saying so, and the client retries the whole batch); a transaction that
alone would exceed it is refused with INVALID_ARGUMENT.
Batch ids and committed transactions are remembered (the last 100,000), so any retry of the
client is applied once.

When the job takes checkpoints, the service keeps a durable log (keyshift.runtime.ingest_log):
accepted rows and staged parts are written there before the reply, and after a crash the
instance starts from it — the rows a checkpoint does not cover yet are replayed first, staged
parts can still be committed, and the remembered ids are still there. Without checkpoints,
everything is kept in memory and a restart of the instance forgets it.
"""

from __future__ import annotations

import json
import logging
import re
import struct
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from keyshift.runtime.ingest_backlog import BadBacklog, ClientBacklog, ClientBacklogs
from keyshift.runtime.ingest_log import IngestLog, IngestLogError
from keyshift.runtime.job import (
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_REQUEST_ROWS,
    DEFAULT_MAX_STAGED_BYTES,
    IngestSource,
)
from keyshift.runtime.records import ARROW_TYPES, EVENT_TIME, SEQ, now_us, record_schema
from keyshift.runtime.schema_check import (
    check_records,
    event_time_problem,
    non_finite_reason,
    why_invalid,
)
from keyshift.runtime.storage import retrying

log = logging.getLogger("keyshift.ingest")

INGEST_SERVICE = "keyshift.Ingest"
PUSH_METHOD = f"/{INGEST_SERVICE}/Push"
COMMIT_METHOD = f"/{INGEST_SERVICE}/Commit"
ABORT_METHOD = f"/{INGEST_SERVICE}/Abort"
FORMATS = ("arrow", "json")
MAX_REASONS = 5
REMEMBERED_BATCH_IDS = 100_000
STAGED_TTL = 900.0  # seconds an uncommitted transaction's parts are kept
JSON_CHUNK_ROWS = 16_384  # JSON rows decoded to Python objects at a time
REMEMBERED_DROPS = 1000  # why recently dropped transactions were dropped, for their commit
_JSON_SPACE = re.compile(r"[ \t\n\r]*")
_HEADER_LENGTH = struct.Struct("<I")
_INT64_MAX = 2**63 - 1

Mask = npt.NDArray[np.bool_]
NULL_EVENT_TIME = f"field {EVENT_TIME!r} is null (in a source with event time)"


@dataclass(frozen=True)
class EventTimeCheck:
    """What a row's event time must be, beside the schema: the job field a source takes it from
    (`field`), or, in a source with event-time settings and no field, a non-null `event_time`
    wherever the column is given (`nulls_bad`)."""

    field: str | None = None
    nulls_bad: bool = False


@dataclass(frozen=True)
class IngestLimits:
    """What one endpoint takes at most (see the module docstring); the job file sets them."""

    max_request_rows: int = DEFAULT_MAX_REQUEST_ROWS
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_staged_bytes: int = DEFAULT_MAX_STAGED_BYTES

    @classmethod
    def of(cls, config: IngestSource) -> IngestLimits:
        return cls(config.max_request_rows, config.max_request_bytes, config.max_staged_bytes)


class IngestRefused(Exception):
    """A Push that is refused as a whole; `code` and the message go back to the client."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def pack_request(header: Mapping[str, Any], payload: bytes) -> bytes:
    """The body of one Push: header length, JSON header, payload."""
    encoded = json.dumps(dict(header)).encode()
    return _HEADER_LENGTH.pack(len(encoded)) + encoded + payload


@dataclass(frozen=True)
class PushHeader:
    format: str
    batch_id: str | None  # applied at most once
    transaction: str | None  # staged under (transaction, part) until Commit
    part: str | None
    backlog: ClientBacklog | None = None  # what the client has not pushed yet


def _optional_name(header: Mapping[str, Any], name: str) -> str | None:
    value = header.get(name)
    if value is not None and (not isinstance(value, str) or not value):
        raise IngestRefused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"header {name!r} must be a non-empty string, got {value!r}",
        )
    return value


def unpack_request(body: bytes) -> tuple[PushHeader, memoryview]:
    """Split a Push body into its header and payload; IngestRefused if it is malformed."""

    def bad(message: str) -> IngestRefused:
        return IngestRefused(grpc.StatusCode.INVALID_ARGUMENT, message)

    view = memoryview(body)
    if len(view) < _HEADER_LENGTH.size:
        raise bad(f"request of {len(view)} bytes is too short for its 4-byte header length")
    (length,) = _HEADER_LENGTH.unpack_from(view)
    end = _HEADER_LENGTH.size + length
    if end > len(view):
        raise bad(f"header length {length} exceeds the request ({len(view)} bytes)")
    header = _json_object(bytes(view[_HEADER_LENGTH.size : end]), "header")
    fmt = header.get("format")
    if fmt not in FORMATS:
        raise bad(f"header 'format' must be 'arrow' or 'json', got {fmt!r}")
    batch_id = _optional_name(header, "batch_id")
    transaction = _optional_name(header, "transaction")
    part = _optional_name(header, "part")
    if (transaction is None) != (part is None):
        raise bad("header 'transaction' and 'part' come together")
    if transaction is not None and batch_id is not None:
        raise bad("a staged part has no 'batch_id': its transaction is committed once")
    try:
        backlog = None if "backlog" not in header else ClientBacklog.from_header(header["backlog"])
    except BadBacklog as exc:
        raise bad(f"header {exc}") from None
    return PushHeader(str(fmt), batch_id, transaction, part, backlog), view[end:]


def _json_object(data: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise IngestRefused(
            grpc.StatusCode.INVALID_ARGUMENT, f"{what} is not JSON: {exc}"
        ) from None
    if not isinstance(value, dict):
        raise IngestRefused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{what} must be a JSON object, got {type(value).__name__}",
        )
    return value


# --- validation ------------------------------------------------------------------------------


@dataclass
class Rejection:
    reason: str
    sample: Any  # the first rejected row with this reason
    count: int
    event_time: bool = False  # a bad event time: its rows are in `CheckedRows.bad_times`


@dataclass
class CheckedRows:
    """The valid rows of one request as Arrow columns, and what was rejected."""

    columns: list[pa.Array]  # one per job field, in the schema's order
    event_time: pa.Array | None  # int64 microseconds; null where the ingest time applies
    num_rows: int
    rejections: list[Rejection] = field(default_factory=list)
    bad_times: list[tuple[Any, str]] = field(default_factory=list)  # (row, reason) each

    @property
    def rejected(self) -> int:
        return sum(r.count for r in self.rejections)

    @property
    def nbytes(self) -> int:
        """Bytes of the valid rows' Arrow buffers."""
        times = 0 if self.event_time is None else self.event_time.nbytes
        return int(sum(c.nbytes for c in self.columns)) + times

    @classmethod
    def concat(cls, parts: Sequence[CheckedRows]) -> CheckedRows:
        """The rows of consecutive parts as one, each reason's first sample and total count."""
        found: dict[str, Rejection] = {}
        for rejection in (r for p in parts for r in p.rejections):
            if rejection.reason in found:
                found[rejection.reason].count += rejection.count
            else:
                found[rejection.reason] = Rejection(
                    rejection.reason, rejection.sample, rejection.count, rejection.event_time
                )
        bad_times = [bad for p in parts for bad in p.bad_times]
        kept = [p for p in parts if p.num_rows]
        if not kept:
            return cls([], None, 0, list(found.values()), bad_times)
        columns = [pa.concat_arrays(list(c)) for c in zip(*(p.columns for p in kept), strict=True)]
        event_time = None
        if any(p.event_time is not None for p in kept):
            event_time = pa.concat_arrays(
                [p.event_time if p.event_time is not None else pa.nulls(p.num_rows, pa.int64())
                 for p in kept]
            )  # fmt: skip
        rows = sum(p.num_rows for p in kept)
        return cls(columns, event_time, rows, list(found.values()), bad_times)

    def to_table(self, fields: Sequence[str]) -> pa.Table:
        """The valid rows as a table (rejections are not kept: they were answered)."""
        columns = dict(zip(fields, self.columns, strict=True)) if self.num_rows else {}
        if self.event_time is not None:
            columns[EVENT_TIME] = self.event_time
        return pa.table(columns)

    @classmethod
    def from_table(cls, table: pa.Table, fields: Sequence[str]) -> CheckedRows:
        if table.num_rows == 0:
            return cls([], None, 0)
        columns = [table.column(name).combine_chunks() for name in fields]
        event_time = (
            table.column(EVENT_TIME).combine_chunks() if EVENT_TIME in table.column_names else None
        )
        return cls(columns, event_time, table.num_rows)


@dataclass
class _Verdicts:
    """Per-row rejection of an Arrow table; each row keeps the first reason found for it."""

    bad: Mask
    found: dict[str, tuple[int, int]] = field(default_factory=dict)  # reason -> (first, count)
    timing: bool = False  # the checks now running judge the rows' event times
    bad_times: list[tuple[Mask, str]] = field(default_factory=list)  # rows, reason

    def reject(self, mask: Mask, reason: str) -> None:
        new = mask & ~self.bad
        count = int(new.sum())
        if count:
            first = int(np.argmax(new))
            if reason in self.found:
                before, n = self.found[reason]
                first, count = min(first, before), count + n
            self.found[reason] = (first, count)
            self.bad |= new
            if self.timing:
                self.bad_times.append((new, reason))


def _mask(array: pa.Array) -> Mask:
    return np.asarray(array.fill_null(False).to_numpy(zero_copy_only=False), dtype=np.bool_)


def _single_column(table: pa.Table, name: str, verdicts: _Verdicts) -> pa.Array | None:
    """The column `name` as one array, or None when absent (or rejected for appearing twice)."""
    indices = table.schema.get_all_field_indices(name)
    if not indices:
        return None
    if len(indices) > 1:
        verdicts.reject(
            np.ones(table.num_rows, np.bool_), f"field {name!r} appears {len(indices)} times"
        )
        return None
    column = table.column(indices[0]).combine_chunks()
    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    return column


def _as_int64(column: pa.Array, name: str, verdicts: _Verdicts) -> pa.Array | None:
    kind = column.type
    if pa.types.is_integer(kind):
        if kind == pa.uint64():
            too_big = pc.greater(column, pa.scalar(_INT64_MAX, pa.uint64()))
            verdicts.reject(_mask(too_big), f"field {name!r} is out of the 64-bit integer range")
        return column.cast(pa.int64(), safe=kind != pa.uint64())
    return None


def _convert(column: pa.Array, kind: str, name: str, verdicts: _Verdicts) -> pa.Array | None:
    """`column` as the Arrow type of a `kind` field, or None when its type does not fit."""
    arrow_type = ARROW_TYPES[kind]
    source = column.type
    if source == arrow_type:
        return column
    if kind == "str" and pa.types.is_large_string(source):
        # Narrowed only after its UTF-8 is checked (the cast does not look at the bytes).
        return column
    if kind == "int":
        return _as_int64(column, name, verdicts)
    if kind == "float" and (pa.types.is_floating(source) or pa.types.is_integer(source)):
        # Like float(int) on the JSON path: large integers round to the nearest double.
        return column.cast(pa.float64(), safe=pa.types.is_floating(source))
    if kind == "str" and str(source) == "string_view":
        return column.cast(pa.string())
    return None


def _invalid_utf8(column: pa.Array, name: str) -> Mask | None:
    """Rows of a string column whose bytes are not UTF-8 (None when all are); IngestRefused
    when the column is broken in another way (offsets outside its data)."""
    try:
        column.validate(full=True)
        return None
    except pa.ArrowInvalid:
        pass
    raw = column.view(pa.large_binary() if pa.types.is_large_string(column.type) else pa.binary())
    try:
        raw.validate(full=True)
    except pa.ArrowInvalid as exc:
        raise IngestRefused(
            grpc.StatusCode.INVALID_ARGUMENT, f"column {name!r} is not a valid Arrow array: {exc}"
        ) from None
    return np.fromiter((v is not None and not _is_utf8(v) for v in raw.to_pylist()), np.bool_)


def _is_utf8(value: bytes) -> bool:
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _check_values(
    column: pa.Array, kind: str, name: str, non_finite: bool, verdicts: _Verdicts
) -> pa.Array:
    """Reject the rows whose values cannot be processed; `column` has its field's type
    (a large string column is narrowed here, once its UTF-8 is checked)."""
    if kind == "str":
        bad = _invalid_utf8(column, name)
        if bad is not None:
            verdicts.reject(bad, f"field {name!r} is not valid UTF-8")
        return column.cast(pa.string()) if column.type != pa.string() else column
    try:
        column.validate(full=True)
    except pa.ArrowInvalid as exc:
        raise IngestRefused(
            grpc.StatusCode.INVALID_ARGUMENT, f"column {name!r} is not a valid Arrow array: {exc}"
        ) from None
    if kind == "float" and not non_finite:
        verdicts.reject(_mask(pc.invert(pc.is_finite(column))), non_finite_reason(name))
    return column


def _event_time(table: pa.Table, verdicts: _Verdicts, nulls_bad: bool) -> pa.Array | None:
    column = _single_column(table, EVENT_TIME, verdicts)
    if column is None:
        return None
    if nulls_bad:
        verdicts.reject(_mask(column.is_null()), NULL_EVENT_TIME)
    source = column.type
    converted: pa.Array | None
    if pa.types.is_null(source):
        return None
    if pa.types.is_timestamp(source):
        try:  # from ns, dropping the sub-microsecond part is fine; s/ms can overflow
            as_us = column.cast(pa.timestamp("us", source.tz), safe=source.unit != "ns")
        except pa.ArrowInvalid:
            reason = f"field {EVENT_TIME!r} is out of the 64-bit integer range"
            verdicts.reject(~_mask(column.is_null()), reason)
            return None
        converted = as_us.cast(pa.int64())
    else:
        converted = _as_int64(column, EVENT_TIME, verdicts)
    if converted is None:
        reason = f"field {EVENT_TIME!r} should be int, got {source}"
        verdicts.reject(~_mask(column.is_null()), reason)
    return converted


def check_table(
    table: pa.Table,
    fields: Mapping[str, str],
    non_finite: Collection[str] = (),
    times: EventTimeCheck = EventTimeCheck(),
) -> CheckedRows:
    """Vectorized check of an Arrow table: whole-column type checks, per-row null and value
    checks. Columns that are not the job's are dropped unseen. The event time is judged first,
    so a row it rejects is a bad event time whatever else is wrong with it."""
    table = table.select(
        [i for i, f in enumerate(table.schema) if f.name in fields or f.name == EVENT_TIME]
    )
    n = table.num_rows
    verdicts = _Verdicts(bad=np.zeros(n, np.bool_), timing=True)
    event_time = _event_time(table, verdicts, times.nulls_bad and times.field is None)
    converted: dict[str, pa.Array | None] = {}
    for name in sorted(fields, key=lambda name: name != times.field):
        verdicts.timing = name == times.field
        converted[name] = _check_column(table, name, fields[name], name in non_finite, verdicts)
    time_reasons = {reason for _, reason in verdicts.bad_times}
    rejections = [
        Rejection(reason, _row(table, first), count, reason in time_reasons)
        for reason, (first, count) in verdicts.found.items()
    ]
    bad_times = [
        (row, reason)
        for mask, reason in verdicts.bad_times
        for row in _rows(table, np.flatnonzero(mask))
    ]
    keep = ~verdicts.bad
    kept = int(keep.sum())
    if kept == 0:
        return CheckedRows([], None, 0, rejections, bad_times)
    columns = [c for name in fields if (c := converted[name]) is not None]  # all, if kept
    if kept < n:
        selection = pa.array(keep)
        columns = [c.filter(selection) for c in columns]
        event_time = None if event_time is None else event_time.filter(selection)
    return CheckedRows(columns, event_time, kept, rejections, bad_times)


def _check_column(
    table: pa.Table, name: str, kind: str, non_finite: bool, verdicts: _Verdicts
) -> pa.Array | None:
    """Field `name` as its Arrow type, its bad rows rejected; None when its type does not fit
    (every row rejected)."""
    n = table.num_rows
    column = _single_column(table, name, verdicts)
    if column is None:
        verdicts.reject(np.ones(n, np.bool_), f"missing field {name!r}")
        return None
    verdicts.reject(_mask(column.is_null()), f"missing field {name!r}")
    as_field = _convert(column, kind, name, verdicts)
    if as_field is None:
        verdicts.reject(np.ones(n, np.bool_), f"field {name!r} should be {kind}, got {column.type}")
        return None
    return _check_values(as_field, kind, name, non_finite, verdicts)


def _row(table: pa.Table, index: int) -> Any:
    try:
        return table.slice(index, 1).to_pylist()[0]
    except (pa.ArrowException, ValueError):  # a column type with no Python equivalent
        return f"row {index}"


def _rows(table: pa.Table, indices: npt.NDArray[np.intp]) -> list[Any]:
    try:
        rows: list[Any] = table.take(pa.array(indices)).to_pylist()
        return rows
    except (pa.ArrowException, ValueError):  # a column type with no Python equivalent
        return [f"row {index}" for index in indices.tolist()]


def _event_time_problem(row: Any, times: EventTimeCheck) -> str | None:
    """The problem of a JSON row's event time (its field's, or its `event_time`'s)."""
    if not isinstance(row, Mapping):
        return None  # no record at all: why_invalid says so
    if times.field is not None and (problem := event_time_problem(row, times.field)):
        return problem
    value = row.get(EVENT_TIME)
    if value is None:
        return NULL_EVENT_TIME if times.nulls_bad and EVENT_TIME in row else None
    return why_invalid({EVENT_TIME: value}, {EVENT_TIME: "int"})


def check_rows(
    rows: Sequence[Any],
    fields: Mapping[str, str],
    non_finite: Collection[str] = (),
    times: EventTimeCheck = EventTimeCheck(),
) -> CheckedRows:
    """Per-row check of decoded JSON rows (the event time first, as `check_table`)."""
    valid: list[Mapping[str, Any]] = []
    found: dict[str, Rejection] = {}
    bad_times: list[tuple[Any, str]] = []
    for row in rows:
        time_problem = _event_time_problem(row, times)
        reason = time_problem or why_invalid(row, fields, non_finite)
        if time_problem is not None:
            bad_times.append((row, time_problem))
        if reason is None:
            valid.append(row)
        elif reason in found:
            found[reason].count += 1
        else:
            found[reason] = Rejection(reason, row, 1, time_problem is not None)
    if not valid:
        return CheckedRows([], None, 0, list(found.values()), bad_times)
    checked = check_records(valid, fields, non_finite)
    columns = [checked.columns[name] for name in fields]
    stamps = [row.get(EVENT_TIME) for row in valid]
    event_time = None if all(t is None for t in stamps) else pa.array(stamps, pa.int64())
    return CheckedRows(columns, event_time, len(valid), list(found.values()), bad_times)


def _decode(
    fmt: str,
    payload: memoryview,
    fields: Mapping[str, str],
    non_finite: Collection[str],
    limits: IngestLimits,
    times: EventTimeCheck,
) -> CheckedRows:
    if len(payload) > limits.max_request_bytes:
        raise _too_big(f"{len(payload):,} bytes of payload", "max_request_bytes", limits)
    if fmt == "arrow":
        try:
            table = pa.ipc.open_stream(pa.py_buffer(payload)).read_all()
        except (pa.ArrowException, ValueError, OSError) as exc:
            raise IngestRefused(
                grpc.StatusCode.INVALID_ARGUMENT, f"payload is not an Arrow IPC stream: {exc}"
            ) from None
        if table.num_rows > limits.max_request_rows:
            raise _too_big(f"{table.num_rows:,} rows", "max_request_rows", limits)
        return check_table(table, fields, non_finite, times)
    try:
        parts = [
            check_rows(rows, fields, non_finite, times) for rows in _json_rows(payload, limits)
        ]
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting too deep
        raise IngestRefused(
            grpc.StatusCode.INVALID_ARGUMENT, f"payload is not JSON: {exc}"
        ) from None
    return CheckedRows.concat(parts)


def _too_big(what: str, limit: str, limits: IngestLimits) -> IngestRefused:
    return IngestRefused(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"the push has {what}, over this endpoint's {limit} ({getattr(limits, limit):,}); "
        "split it into several pushes",
    )


def _json_rows(payload: memoryview, limits: IngestLimits) -> Iterator[list[Any]]:
    """The rows of a JSON array, JSON_CHUNK_ROWS at a time: only a chunk of them is ever held
    as Python objects. ValueError if it is not JSON; IngestRefused if it is not an array or
    has more rows than the limit."""
    text = str(payload, "utf-8")
    decoder = json.JSONDecoder()
    at = _skip_space(text, 0)
    if not text.startswith("[", at):
        value, _ = decoder.raw_decode(text, at)
        raise IngestRefused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"JSON payload must be an array of row objects, got {type(value).__name__}",
        )
    at = _skip_space(text, at + 1)
    rows: list[Any] = []
    count = 0
    closed = text.startswith("]", at)
    if closed:
        at += 1
    while not closed:
        row, at = decoder.raw_decode(text, at)
        rows.append(row)
        count += 1
        if count > limits.max_request_rows:
            raise _too_big(
                f"more than {limits.max_request_rows:,} rows", "max_request_rows", limits
            )
        at = _skip_space(text, at)
        if text.startswith(",", at):
            at = _skip_space(text, at + 1)
            if len(rows) >= JSON_CHUNK_ROWS:
                yield rows
                rows = []
        elif text.startswith("]", at):
            at += 1
            closed = True
        else:
            raise ValueError(f"expected ',' or ']' at character {at}")
    if _skip_space(text, at) != len(text):
        raise ValueError(f"extra data after the array at character {at}")
    yield rows


def _skip_space(text: str, at: int) -> int:
    """The position of the first character from `at` on that is not JSON whitespace."""
    space = _JSON_SPACE.match(text, at)
    assert space is not None  # `*` matches the empty string too
    return space.end()


# --- the service -----------------------------------------------------------------------------


@dataclass
class _Staged:
    """The parts of one open transaction: validated rows waiting for Commit."""

    parts: dict[str, CheckedRows] = field(default_factory=dict)
    touched: float = field(default_factory=time.monotonic)

    @property
    def nbytes(self) -> int:
        return sum(rows.nbytes for rows in self.parts.values())


class IngestService:
    """Accepts pushed rows into a bounded queue of record batches for one source instance."""

    def __init__(
        self,
        fields: Mapping[str, str],
        source_id: int,
        max_pending: int,
        on_reject: Callable[[str, Any, int], None],
        push_timeout: float = 30.0,
        staged_ttl: float = STAGED_TTL,
        durable: IngestLog | None = None,
        position: int | None = None,
        limits: IngestLimits = IngestLimits(),
        non_finite: Collection[str] = (),
        event_times: EventTimeCheck = EventTimeCheck(),
        on_bad_times: Callable[[list[Any], list[str]], None] = lambda rows, reasons: None,
    ) -> None:
        """With `durable`, accepted rows are logged there before they are acknowledged, and the
        service starts from what the log holds: after a recovery (`position`, the checkpoint's
        sequence number) the rows from there on are taken first. `non_finite` names the float
        fields that may hold NaN and infinities. Rows rejected for their event time
        (`event_times`) go to `on_bad_times` with their reasons, not to `on_reject`."""
        if max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {max_pending}")
        self.fields = dict(fields)
        self.limits = limits
        self.non_finite = frozenset(non_finite)
        self.source_id = source_id
        self.max_pending = max_pending
        self.push_timeout = push_timeout
        self.staged_ttl = staged_ttl
        self._on_reject = on_reject
        self.event_times = event_times
        self._on_bad_times = on_bad_times
        self._schema = record_schema(self.fields)
        self._cv = threading.Condition()
        self._queue: deque[pa.RecordBatch] = deque()
        self._next_seq = 0
        self._closed = False
        # Ids of applied batches and committed transactions, oldest first.
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._in_flight: set[str] = set()
        self._staged: dict[str, _Staged] = {}
        # Why transactions were dropped before their commit (expired, or pushed out).
        self._dropped: OrderedDict[str, str] = OrderedDict()
        self._log = durable
        self._replay: deque[pa.RecordBatch] = deque()
        self.client_backlogs = ClientBacklogs()
        if durable is not None:
            # Rows cannot be taken (nor replayed) before the log is read: storage that cannot
            # be reached now is waited for.
            reopened = retrying(lambda: durable.reopen(position), "reading the ingest log")
            self._next_seq = reopened.next_seq
            self._seen = reopened.seen
            self._replay.extend(reopened.replay)
            for transaction, parts in reopened.staged.items():
                self._staged[transaction] = _Staged(
                    {p: CheckedRows.from_table(t, list(self.fields)) for p, t in parts.items()}
                )

    def handler(self) -> grpc.GenericRpcHandler[Any, Any]:
        return grpc.method_handlers_generic_handler(
            INGEST_SERVICE,
            {
                "Push": grpc.unary_unary_rpc_method_handler(self._serve(self.push)),
                "Commit": grpc.unary_unary_rpc_method_handler(self._serve(self.commit)),
                "Abort": grpc.unary_unary_rpc_method_handler(self._serve(self.abort)),
            },
        )

    @property
    def next_seq(self) -> int:
        """The sequence number of the next row taken: the source's position."""
        with self._cv:
            if self._replay:
                return int(self._replay[0].column(SEQ)[0].as_py())
            if self._queue:
                return int(self._queue[0].column(SEQ)[0].as_py())
            return self._next_seq

    def trim(self, position: int) -> None:
        """A checkpoint with this source at `position` completed: the log may let go of the
        rows below it."""
        if self._log is None:
            return
        with self._cv:
            try:
                self._log.trim(position)
            except IngestLogError as exc:  # the rows stay; the next checkpoint tries again
                log.warning("cannot trim the ingest log: %s", exc)

    def take(self, timeout: float) -> pa.RecordBatch | None:
        """The next accepted batch, or None when none arrives within `timeout` seconds."""
        with self._cv:
            if self._replay:
                return self._replay.popleft()
            if not self._cv.wait_for(lambda: self._queue, timeout):
                return None
            batch = self._queue.popleft()
            self._cv.notify_all()
            return batch

    def pending(self) -> int:
        """Accepted batches not yet taken."""
        with self._cv:
            return len(self._replay) + len(self._queue)

    def pending_rows(self) -> int:
        """Accepted rows not yet taken: the source's backlog."""
        with self._cv:
            return sum(batch.num_rows for batch in (*self._replay, *self._queue))

    def staged_rows(self) -> int:
        """Rows staged by open transactions."""
        with self._cv:
            return sum(r.num_rows for t in self._staged.values() for r in t.parts.values())

    def close(self) -> None:
        """Stop accepting; later (and waiting) pushes get UNAVAILABLE. `take` still drains."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def push(
        self,
        body: bytes,
        active: Callable[[], bool] = lambda: True,
        time_left: float | None = None,
    ) -> dict[str, Any]:
        """Handle one Push body and return the reply; IngestRefused when refused as a whole.

        `active` says whether the caller still waits for the answer and `time_left` is its
        deadline in seconds: a push whose caller gave up is not accepted.
        """
        self._refuse_if_closed()
        header, payload = unpack_request(body)
        if header.backlog is not None:
            self.client_backlogs.report(header.backlog, time.monotonic())
        rows = _decode(
            header.format, payload, self.fields, self.non_finite, self.limits, self.event_times
        )
        if header.transaction is not None:
            assert header.part is not None
            done = self._stage(header.transaction, header.part, rows)
            self._report(rows)
            return _reply(0, rows.rejected, _reasons(rows), duplicate=done, first_seq=None)
        deadline = self._deadline(time_left)
        once = None if header.batch_id is None else f"batch {header.batch_id}"
        with self._cv:
            if (duplicate := self._begin_once(once, deadline, active)) is not None:
                return duplicate
            try:
                first_seq = self._enqueue([rows], deadline, active, once)
                if once is not None:
                    self._remember(once)
            finally:
                self._end_once(once)
        self._report(rows)
        return _reply(rows.num_rows, rows.rejected, _reasons(rows), False, first_seq)

    def commit(
        self,
        body: bytes,
        active: Callable[[], bool] = lambda: True,
        time_left: float | None = None,
    ) -> dict[str, Any]:
        """Apply the named staged parts of a transaction at once, and the transaction only once.

        Body: `{"transaction": str, "parts": [str, ...]}`. Parts staged under the transaction
        but not named (a failed task attempt's) are dropped. A part that is not staged here
        (this endpoint restarted and lost it) refuses the commit with FAILED_PRECONDITION, and
        nothing is applied.
        """
        self._refuse_if_closed()
        request = _json_object(body, "commit request")
        transaction = _optional_name(request, "transaction")
        parts = request.get("parts")
        if transaction is None or not isinstance(parts, list):
            raise IngestRefused(
                grpc.StatusCode.INVALID_ARGUMENT,
                "commit request needs 'transaction' (a string) and 'parts' (a list)",
            )
        deadline = self._deadline(time_left)
        with self._cv:
            once = f"transaction {transaction}"
            if (duplicate := self._begin_once(once, deadline, active)) is not None:
                return duplicate
            try:
                staged = self._staged.get(transaction, _Staged())
                missing = sorted(str(p) for p in parts if p not in staged.parts)
                if missing:
                    why = self._dropped.get(
                        transaction, "the endpoint restarted or the parts expired"
                    )
                    raise IngestRefused(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"parts {missing} of transaction {transaction!r} are not staged here "
                        f"({why}); retry the whole batch",
                    )
                chosen = [staged.parts[p] for p in dict.fromkeys(parts)]
                first_seq = self._enqueue(chosen, deadline, active, once)
                self._staged.pop(transaction, None)
                self._remember(once)
                self._unstage(transaction)
            finally:
                self._end_once(once)
        accepted = sum(r.num_rows for r in chosen)
        return _reply(accepted, 0, [], duplicate=False, first_seq=first_seq)

    def abort(
        self,
        body: bytes,
        active: Callable[[], bool] = lambda: True,
        time_left: float | None = None,
    ) -> dict[str, Any]:
        """Drop what a transaction staged. Body: `{"transaction": str}`."""
        transaction = _optional_name(_json_object(body, "abort request"), "transaction")
        if transaction is None:
            raise IngestRefused(
                grpc.StatusCode.INVALID_ARGUMENT, "abort request needs 'transaction'"
            )
        with self._cv:
            dropped = self._staged.pop(transaction, _Staged())
            self._unstage(transaction)
        return {"dropped": len(dropped.parts)}

    def _stage(self, transaction: str, part: str, rows: CheckedRows) -> bool:
        """Stage a part (replacing an earlier attempt's); True if the transaction is done."""
        with self._cv:
            self._refuse_if_closed()
            self._expire_staged()
            if f"transaction {transaction}" in self._seen:
                return True
            self._make_room(transaction, part, rows.nbytes)
            if self._log is not None:
                try:
                    self._log.stage(transaction, part, rows.to_table(list(self.fields)))
                except IngestLogError as exc:
                    raise IngestRefused(
                        grpc.StatusCode.UNAVAILABLE, f"cannot keep the part durably: {exc}"
                    ) from None
            staged = self._staged.setdefault(transaction, _Staged())
            staged.parts[part] = rows
            staged.touched = time.monotonic()
            self._dropped.pop(transaction, None)
            return False

    # Called with self._cv held.
    def _make_room(self, transaction: str, part: str, nbytes: int) -> None:
        """Keep the staged bytes within the limit once `part` is staged: refuse a transaction
        that alone would exceed it; drop the least recently staged others to make room."""
        cap = self.limits.max_staged_bytes
        own = self._staged.get(transaction, _Staged())
        mine = nbytes + sum(r.nbytes for p, r in own.parts.items() if p != part)
        if mine > cap:
            raise IngestRefused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"transaction {transaction!r} would stage {mine:,} bytes, more than this "
                f"endpoint holds (max_staged_bytes is {cap:,}); write smaller batches",
            )
        others = sorted((s.touched, t) for t, s in self._staged.items() if t != transaction)
        total = mine + sum(self._staged[t].nbytes for _, t in others)
        for _, victim in others:
            if total <= cap:
                break
            total -= self._staged[victim].nbytes
            self._drop(
                victim,
                f"dropped uncommitted to make room for newer staging: max_staged_bytes is {cap:,}",
            )

    # Called with self._cv held.
    def _drop(self, transaction: str, why: str) -> None:
        log.warning("dropping transaction %r: %s", transaction, why)
        del self._staged[transaction]
        self._unstage(transaction)
        self._dropped[transaction] = why
        while len(self._dropped) > REMEMBERED_DROPS:
            self._dropped.popitem(last=False)

    # Called with self._cv held.
    def _expire_staged(self) -> None:
        """Forget transactions nobody committed or aborted (a Spark driver that died)."""
        now = time.monotonic()
        for transaction in [
            t for t, s in self._staged.items() if now - s.touched > self.staged_ttl
        ]:
            self._drop(transaction, f"not committed within {self.staged_ttl:.0f} s")

    # Called with self._cv held.
    def _unstage(self, transaction: str) -> None:
        if self._log is not None:
            try:
                self._log.unstage(transaction)
            except IngestLogError as exc:  # left over; the next start deletes them
                log.warning("cannot delete the staged parts of %r: %s", transaction, exc)

    def _deadline(self, time_left: float | None) -> float:
        wait = self.push_timeout if time_left is None else min(self.push_timeout, time_left)
        return time.monotonic() + wait

    # Called with self._cv held.
    def _begin_once(
        self, once_id: str | None, deadline: float, active: Callable[[], bool]
    ) -> dict[str, Any] | None:
        """Claim an id applied at most once: the duplicate reply if it was applied before."""
        if once_id is None:
            return None
        while once_id in self._in_flight:  # the same id, sent twice at once
            self._wait(deadline, active)
        if once_id in self._seen:
            return _reply(0, 0, [], duplicate=True, first_seq=None)
        self._in_flight.add(once_id)
        return None

    # Called with self._cv held.
    def _end_once(self, once_id: str | None) -> None:
        if once_id is not None:
            self._in_flight.discard(once_id)
            self._cv.notify_all()

    def _report(self, rows: CheckedRows) -> None:
        try:
            if rows.bad_times:
                self._on_bad_times([r for r, _ in rows.bad_times], [w for _, w in rows.bad_times])
        except Exception:  # the rows are accepted; a broken callback must not undo that
            log.exception("on_bad_times failed")
        for rejection in rows.rejections:
            if rejection.event_time:
                continue  # with its rows, just above
            try:
                self._on_reject(rejection.reason, rejection.sample, rejection.count)
            except Exception:  # the rows are accepted; a broken callback must not undo that
                log.exception("on_reject failed for %r", rejection.reason)

    # Called with self._cv held.
    def _enqueue(
        self,
        parts: Sequence[CheckedRows],
        deadline: float,
        active: Callable[[], bool],
        once: str | None,
    ) -> int | None:
        """Queue the rows of `parts` together (one batch each): the bound is checked once, so
        a transaction is applied whole even when it is larger than the queue. With a durable
        log they are logged first, under their once-id, and only then queued."""
        self._refuse_if_closed()
        parts = [rows for rows in parts if rows.num_rows]
        if not parts:
            return None
        while len(self._queue) >= self.max_pending:
            self._wait(deadline, active)
        first_seq = self._next_seq
        stamp = now_us()
        batches, seq = [], first_seq
        for rows in parts:
            batches.append(self._batch(rows, seq, stamp))
            seq += rows.num_rows
        if self._log is not None:
            try:
                self._log.append(first_seq, batches, once)
            except IngestLogError as exc:
                raise IngestRefused(
                    grpc.StatusCode.UNAVAILABLE, f"cannot log the rows durably: {exc}"
                ) from None
        self._queue.extend(batches)
        self._next_seq = seq
        self._cv.notify_all()
        return first_seq

    # Called with self._cv held.
    def _wait(self, deadline: float, active: Callable[[], bool]) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise IngestRefused(
                grpc.StatusCode.RESOURCE_EXHAUSTED, "keyshift is backpressuring; retry"
            )
        if not active():
            raise IngestRefused(grpc.StatusCode.CANCELLED, "the client went away")
        self._cv.wait(min(left, 0.5))  # wake now and then to notice a client that went away
        self._refuse_if_closed()

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise IngestRefused(grpc.StatusCode.UNAVAILABLE, "job is draining")

    def _remember(self, once_id: str) -> None:
        self._seen[once_id] = None
        while len(self._seen) > REMEMBERED_BATCH_IDS:
            self._seen.popitem(last=False)

    def _batch(self, rows: CheckedRows, first_seq: int, stamp: int) -> pa.RecordBatch:
        n = rows.num_rows
        ingest = pa.array(np.full(n, stamp, dtype=np.int64))
        event = ingest if rows.event_time is None else rows.event_time.fill_null(stamp)
        return pa.RecordBatch.from_arrays(
            [
                *rows.columns,
                event,
                ingest,
                pa.array(np.full(n, self.source_id, dtype=np.int32)),
                pa.array(np.arange(first_seq, first_seq + n, dtype=np.int64)),
                pa.array(np.zeros(n, dtype=np.int32)),
            ],
            schema=self._schema,
        )

    @staticmethod
    def _serve(
        method: Callable[[bytes, Callable[[], bool], float | None], dict[str, Any]],
    ) -> Callable[[bytes, grpc.ServicerContext], bytes]:
        def serve(request: bytes, context: grpc.ServicerContext) -> bytes:
            time_left: float | None = context.time_remaining()
            try:
                reply = method(request, context.is_active, time_left)
            except IngestRefused as exc:
                context.abort(exc.code, str(exc))
            return json.dumps(reply).encode()

        return serve


def _reasons(rows: CheckedRows) -> list[str]:
    return [r.reason for r in rows.rejections[:MAX_REASONS]]


def _reply(
    accepted: int, rejected: int, reasons: list[str], duplicate: bool, first_seq: int | None
) -> dict[str, Any]:
    return {
        "accepted": accepted,
        "rejected": rejected,
        "reasons": reasons,
        "duplicate": duplicate,
        "first_seq": first_seq,
    }
