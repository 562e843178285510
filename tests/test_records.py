"""Tests of keyshift.runtime.records: the record schema, the wire encoding, and splitting a batch
by owner instance.
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyshift.runtime.records import (
    EVENT_TIME,
    GROUP,
    INGEST_TIME,
    METADATA_FIELDS,
    RESERVED_FIELDS,
    SEQ,
    SOURCE,
    decode,
    encode,
    now_us,
    record_schema,
    split_by_owner,
)

FIELDS = {"user": "str", "clicks": "int", "amount": "float", "mobile": "bool"}


def make_batch(n: int, seed: int = 0) -> pa.RecordBatch:
    rng = np.random.default_rng(seed)
    return pa.RecordBatch.from_arrays(
        [
            pa.array([f"user-{i % 7}-é" for i in range(n)], type=pa.string()),
            pa.array(rng.integers(-(2**62), 2**62, size=n), type=pa.int64()),
            pa.array(rng.normal(size=n), type=pa.float64()),
            pa.array(rng.integers(0, 2, size=n).astype(bool), type=pa.bool_()),
            pa.array(rng.integers(0, 2**50, size=n), type=pa.int64()),
            pa.array(rng.integers(0, 2**50, size=n), type=pa.int64()),
            pa.array(rng.integers(0, 1000, size=n).astype(np.int32), type=pa.int32()),
            pa.array(np.arange(n, dtype=np.int64)),
            pa.array(rng.integers(0, 4096, size=n).astype(np.int32), type=pa.int32()),
        ],
        schema=record_schema(FIELDS),
    )


def test_record_schema_fields_then_metadata() -> None:
    schema = record_schema(FIELDS)
    assert schema.names == [*FIELDS, EVENT_TIME, INGEST_TIME, SOURCE, SEQ, GROUP]
    assert [f.type for f in schema] == [
        pa.string(),
        pa.int64(),
        pa.float64(),
        pa.bool_(),
        pa.int64(),
        pa.int64(),
        pa.int32(),
        pa.int64(),
        pa.int32(),
    ]
    assert set(METADATA_FIELDS) | {GROUP} == RESERVED_FIELDS


def test_now_us_is_wall_clock_microseconds() -> None:
    before = time.time()
    stamp = now_us()
    after = time.time()
    assert isinstance(stamp, int)
    assert before * 1e6 - 1000 <= stamp <= after * 1e6 + 1000


@pytest.mark.parametrize("n", [0, 1, 1000])
def test_encode_decode_roundtrip(n: int) -> None:
    batch = make_batch(n, seed=n)
    payload = encode(batch)
    assert isinstance(payload, bytes)
    decoded = decode(payload)
    assert decoded.schema == batch.schema
    assert decoded.num_rows == n
    assert decoded.equals(batch)
    assert decoded.to_pydict() == batch.to_pydict()
    assert decode(memoryview(payload)).equals(batch)


def test_encode_keeps_nulls_and_slices() -> None:
    schema = record_schema({"key": "int", "value": "float"})
    batch = pa.RecordBatch.from_pydict(
        {
            "key": [1, None, 3, 4],
            "value": [None, 2.5, float("nan"), -0.0],
            EVENT_TIME: [1, 2, 3, 4],
            INGEST_TIME: [5, 6, 7, 8],
            SOURCE: [0, 0, 1, 1],
            SEQ: [10, 11, 12, 13],
            GROUP: [9, 8, 7, 6],
        },
        schema=schema,
    )
    decoded = decode(encode(batch))
    assert decoded.column("key").to_pylist() == [1, None, 3, 4]
    values = decoded.column("value").to_pylist()
    assert values[0] is None and values[1] == 2.5 and np.isnan(values[2])
    assert str(values[3]) == "-0.0"
    sliced = batch.slice(1, 2)
    decoded_slice = decode(encode(sliced))
    assert decoded_slice.num_rows == 2
    assert decoded_slice.column(SEQ).to_pylist() == [11, 12]
    assert decoded_slice.schema == sliced.schema
    slice_values = decoded_slice.column("value").to_pylist()
    assert slice_values[0] == 2.5 and np.isnan(slice_values[1])
    for name in sliced.schema.names:
        if name != "value":
            assert decoded_slice.column(name).to_pylist() == sliced.column(name).to_pylist()


def expected_split(
    batch: pa.RecordBatch, owners: np.ndarray, parallelism: int
) -> dict[int, list[int]]:
    """Seq numbers each owner should get, in the batch's order (computed row by row)."""
    seqs = batch.column(SEQ).to_pylist()
    parts: dict[int, list[int]] = {}
    for seq, owner in zip(seqs, owners.tolist(), strict=True):
        parts.setdefault(owner, []).append(seq)
    return dict(sorted(parts.items()))


def check_split(batch: pa.RecordBatch, owners: np.ndarray, parallelism: int) -> None:
    parts = split_by_owner(batch, owners, parallelism)
    got_owners = [o for o, _ in parts]
    assert got_owners == sorted(set(got_owners)), "one part per owner, in owner order"
    assert all(0 <= o < parallelism for o in got_owners)
    if batch.num_rows == 0:
        assert parts == [], "an empty batch is sent nowhere"
        return
    if parallelism == 1:
        assert len(parts) == 1 and parts[0][0] == 0 and parts[0][1].equals(batch)
        return
    for _, part in parts:
        assert part.schema == batch.schema
        assert part.num_rows > 0
    got = {o: part.column(SEQ).to_pylist() for o, part in parts}
    assert got == expected_split(batch, owners, parallelism)
    # Every row exactly once, and whole rows travel together.
    all_seqs = [s for _, part in parts for s in part.column(SEQ).to_pylist()]
    assert sorted(all_seqs) == batch.column(SEQ).to_pylist()
    rows = {r[SEQ]: r for r in batch.to_pylist()}
    for _, part in parts:
        for row in part.to_pylist():
            assert row == rows[row[SEQ]]


@pytest.mark.parametrize("parallelism", [1, 2, 3, 8])
def test_split_by_owner_keeps_order_and_covers_every_row_once(parallelism: int) -> None:
    batch = make_batch(500, seed=parallelism)
    owners = np.random.default_rng(parallelism).integers(0, parallelism, size=500)
    check_split(batch, owners, parallelism)


def test_split_skips_owners_without_rows() -> None:
    batch = make_batch(6)
    owners = np.array([3, 0, 3, 3, 0, 3])
    parts = split_by_owner(batch, owners, 5)
    assert [o for o, _ in parts] == [0, 3]
    assert [p.column(SEQ).to_pylist() for _, p in parts] == [[1, 4], [0, 2, 3, 5]]


def test_split_with_one_owner_gives_the_batch_itself() -> None:
    batch = make_batch(10)
    parts = split_by_owner(batch, np.zeros(10, dtype=np.int64), 1)
    assert len(parts) == 1 and parts[0][0] == 0 and parts[0][1].equals(batch)


def test_split_of_empty_batch() -> None:
    assert split_by_owner(make_batch(0), np.array([], dtype=np.int64), 4) == []


def test_split_works_with_int32_owners_from_an_assignment() -> None:
    batch = make_batch(300, seed=9)
    groups = batch.column(GROUP).to_numpy()
    owner_of_group = (np.arange(4096) % 3).astype(np.int32)
    check_split(batch, owner_of_group[groups], 3)


@settings(max_examples=60, deadline=None)
@given(
    parallelism=st.integers(1, 6),
    data=st.data(),
)
def test_split_property(parallelism: int, data: st.DataObject) -> None:
    owners = data.draw(st.lists(st.integers(0, parallelism - 1), max_size=80))
    batch = make_batch(len(owners), seed=len(owners))
    check_split(batch, np.array(owners, dtype=np.int64), parallelism)
