"""Record batches: the columnar unit that travels between stages, and its wire encoding.

A batch is a `pyarrow.RecordBatch` with the job's fields plus the metadata every record carries
(event time, ingest time, source id, sequence number) and the key group computed by the sender.
Used by every stage instance and by the transport.
"""

from __future__ import annotations

import json
import re
import struct
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa

EVENT_TIME = "event_time"
INGEST_TIME = "ingest_time"
SOURCE = "source"
SEQ = "seq"
GROUP = "_group"
METADATA_FIELDS = (EVENT_TIME, INGEST_TIME, SOURCE, SEQ)
RESERVED_FIELDS = frozenset((*METADATA_FIELDS, GROUP))
# Names of output log readers: they name files, so no path separators.
READER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")

ARROW_TYPES: Mapping[str, pa.DataType] = {
    "int": pa.int64(),
    "float": pa.float64(),
    "str": pa.string(),
    "bool": pa.bool_(),
}


def now_us() -> int:
    """Wall-clock microseconds: ingest and emit times are compared across processes."""
    return time.time_ns() // 1000


def record_schema(fields: Mapping[str, str]) -> pa.Schema:
    """The schema of batches between the source stage and the keyed stage."""
    return pa.schema(
        [pa.field(name, ARROW_TYPES[kind]) for name, kind in fields.items()]
        + [
            pa.field(EVENT_TIME, pa.int64()),
            pa.field(INGEST_TIME, pa.int64()),
            pa.field(SOURCE, pa.int32()),
            pa.field(SEQ, pa.int64()),
            pa.field(GROUP, pa.int32()),
        ]
    )


def encode(batch: pa.RecordBatch) -> bytes:
    """A batch with its schema, read by `decode` alone (state chunks, fetch replies)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()  # type: ignore[no-any-return]


def decode(payload: bytes | memoryview) -> pa.RecordBatch:
    return pa.ipc.open_stream(pa.py_buffer(payload)).read_next_batch()


# A data stream carries its batches' schema once, not in every message
# (keyshift.runtime.transport): writing and parsing the schema was most of what the Arrow side
# of a small batch cost.


def encode_schema(schema: pa.Schema) -> bytes:
    return schema.serialize().to_pybytes()  # type: ignore[no-any-return]


def decode_schema(payload: bytes | memoryview) -> pa.Schema:
    return pa.ipc.read_schema(pa.py_buffer(payload))


def encode_body(batch: pa.RecordBatch) -> pa.Buffer:
    """The batch without its schema: `decode_body` reads it given the schema."""
    return batch.serialize()


def decode_body(payload: bytes | memoryview, schema: pa.Schema) -> pa.RecordBatch:
    """A batch `encode_body` wrote, sharing `payload`'s memory (no copy)."""
    return pa.ipc.read_record_batch(pa.py_buffer(payload), schema)


def split_by_owner(
    batch: pa.RecordBatch, owners: np.ndarray, parallelism: int
) -> list[tuple[int, pa.RecordBatch]]:
    """Split a batch by each record's owner instance, keeping the records' order."""
    if batch.num_rows == 0:
        return []
    if parallelism == 1:
        return [(0, batch)]
    order = np.argsort(owners, kind="stable")
    counts = np.bincount(owners, minlength=parallelism)
    parts: list[tuple[int, pa.RecordBatch]] = []
    start = 0
    for owner, count in enumerate(counts.tolist()):
        if count:
            parts.append((owner, batch.take(pa.array(order[start : start + count]))))
        start += count
    return parts


def pack(header: dict[str, Any], batch: pa.RecordBatch | None = None) -> bytes:
    """A JSON header and an optional batch in one message (state chunks, fetch replies)."""
    return pack_raw(header, encode(batch) if batch is not None else b"")


def pack_raw(header: dict[str, Any], body: bytes) -> bytes:
    """A JSON header and opaque bytes in one message (a state chunk carrying an SST file)."""
    head = json.dumps(header).encode()
    return struct.pack("<I", len(head)) + head + body


def unpack_raw(message: bytes | memoryview) -> tuple[dict[str, Any], memoryview]:
    """The header and the body of a `pack_raw` (or `pack`) message."""
    view = memoryview(message)
    if len(view) < 4:
        raise ValueError(f"a message of {len(view)} bytes is too short for its header's size")
    (size,) = struct.unpack_from("<I", view)
    if 4 + size > len(view):
        raise ValueError(f"a message of {len(view)} bytes is shorter than its {size}-byte header")
    header = json.loads(bytes(view[4 : 4 + size]))
    if not isinstance(header, dict):
        raise ValueError("a message header is not a JSON object")
    return header, view[4 + size :]


def unpack(message: bytes | memoryview) -> tuple[dict[str, Any], pa.RecordBatch | None]:
    header, body = unpack_raw(message)
    return header, (decode(body) if len(body) else None)


def with_record_ids(out: pa.RecordBatch) -> pa.RecordBatch:
    """Updates as records for the stages after: a process function's carry the (source, seq)
    of the record they came from; an aggregate's update stands for all of a key's records so
    far, so it goes on with source -1 and its version as its sequence number."""
    if SOURCE in out.schema.names:
        return out
    sources = pa.array(np.full(out.num_rows, -1, dtype=np.int32))
    return out.append_column(SOURCE, sources).append_column(SEQ, out.column("version"))
