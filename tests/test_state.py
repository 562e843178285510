"""Tests of keyshift.runtime.state: keyed aggregates and per-record process state against plain
Python dictionaries computed independently, and the snapshot/restore/drop pairs migration uses.
"""

from __future__ import annotations

import functools
import itertools
import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyshift.runtime.keyspace import key_groups
from keyshift.runtime.records import record_schema
from keyshift.runtime.rocksdb_state import (
    RocksAggregateState,
    RocksProcessState,
    open_database,
    prepare_directory,
)
from keyshift.runtime.state import (
    GROUP_COL,
    HITS_COL,
    KEY_COL,
    AggregateState,
    ProcessFunction,
    ProcessState,
)
from keyshift.runtime.state_values import ValueCodec

FUNCTIONS = ["count", "sum", "min", "max", "mean"]
G = 64  # key groups in these tests: small, so groups hold several keys each


def make_batch(
    keys: Sequence[Any],
    values: Sequence[float],
    *,
    first_seq: int = 0,
    source: int = 0,
    event_times: Sequence[int] | None = None,
    ingest_times: Sequence[int] | None = None,
    max_key_groups: int = G,
) -> pa.RecordBatch:
    """A batch as the source stage sends it: fields, metadata, and each key's group."""
    key_kind = "str" if keys and isinstance(keys[0], str) else "int"
    n = len(keys)
    key_array = pa.array(list(keys), type=pa.string() if key_kind == "str" else pa.int64())
    seqs = list(range(first_seq, first_seq + n))
    return pa.RecordBatch.from_arrays(
        [
            key_array,
            pa.array(list(values), type=pa.float64()),
            pa.array(list(event_times) if event_times is not None else seqs, type=pa.int64()),
            pa.array(list(ingest_times) if ingest_times is not None else seqs, type=pa.int64()),
            pa.array([source] * n, type=pa.int32()),
            pa.array(seqs, type=pa.int64()),
            pa.array(key_groups(key_array, max_key_groups), type=pa.int32()),
        ],
        schema=record_schema({"key": key_kind, "value": "float"}),
    )


@functools.cache
def group_of(key: Any, max_key_groups: int = G) -> int:
    array = pa.array([key], type=pa.string() if isinstance(key, str) else pa.int64())
    return int(key_groups(array, max_key_groups)[0])


@dataclass
class Truth:
    """Running aggregates per key, kept with plain Python."""

    count: dict[Any, int] = field(default_factory=lambda: defaultdict(int))
    total: dict[Any, float] = field(default_factory=lambda: defaultdict(float))
    low: dict[Any, float] = field(default_factory=dict)
    high: dict[Any, float] = field(default_factory=dict)

    def add(self, key: Any, value: float) -> None:
        self.count[key] += 1
        self.total[key] += value
        self.low[key] = min(self.low.get(key, value), value)
        self.high[key] = max(self.high.get(key, value), value)

    def value(self, function: str, key: Any) -> float | int:
        if function == "count":
            return self.count[key]
        if function == "sum":
            return self.total[key]
        if function == "min":
            return self.low[key]
        if function == "max":
            return self.high[key]
        return self.total[key] / self.count[key]

    def values(self, function: str) -> dict[Any, float | int]:
        return {k: self.value(function, k) for k in self.count}


def quarter_values(rng: random.Random, n: int) -> list[float]:
    """Multiples of 0.25 in [-100, 100]: their sums are exact in float64 in any order."""
    return [rng.randint(-400, 400) / 4 for _ in range(n)]


def int_keys(rng: random.Random, n: int, distinct: int = 40) -> list[int]:
    return [rng.randint(-distinct // 2, distinct // 2) * 7919 for _ in range(n)]


def str_keys(rng: random.Random, n: int, distinct: int = 40) -> list[str]:
    return [f"user-{rng.randrange(distinct)}" for _ in range(n)]


def value_field(function: str) -> str | None:
    return None if function == "count" else "value"


AggregateStore = AggregateState | RocksAggregateState
ProcessStore = ProcessState | RocksProcessState
# The backend `new_state` makes: the `backend` fixture runs each aggregate test on each one.
_backend: dict[str, Path] = {}


@pytest.fixture(params=["memory", "rocksdb"])
def backend(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    if request.param == "rocksdb":
        _backend["rocksdb"] = tmp_path_factory.mktemp("rocksdb")
    yield request.param
    _backend.clear()


def _new_database() -> Any:
    root = _backend["rocksdb"]
    owner = f"keyed-{len(list(root.iterdir()))}"
    return open_database(
        prepare_directory(root / owner, owner), block_cache_mb=8, write_buffer_mb=1
    )


def new_state(function: str, key_type: pa.DataType | None = None) -> AggregateStore:
    if "rocksdb" not in _backend:
        return AggregateState(function, G, key_type or pa.int64())
    return RocksAggregateState(function, G, key_type or pa.int64(), _new_database(), True)


def new_process_state(function: ProcessFunction, key_type: pa.DataType) -> ProcessStore:
    codec = ValueCodec(allow_pickle=False)
    if "rocksdb" not in _backend:
        return ProcessState(function, G, key_type, codec)
    return RocksProcessState(function, G, key_type, _new_database(), codec, True)


# ------------------------------------------------------------------------------------------
# AggregateState: values and per-batch updates


@pytest.mark.usefixtures("backend")
@pytest.mark.parametrize("function", FUNCTIONS)
@pytest.mark.parametrize("key_kind", ["int", "str"])
def test_aggregate_matches_dict_truth_over_batches(function: str, key_kind: str) -> None:
    rng = random.Random(f"{function}-{key_kind}")
    key_type = pa.int64() if key_kind == "int" else pa.string()
    state = new_state(function, key_type)
    truth = Truth()
    applied = 0
    seq = 0
    for size in [1, 17, 250, 0, 90, 3]:
        keys = int_keys(rng, size) if key_kind == "int" else str_keys(rng, size)
        values = quarter_values(rng, size)
        event = [rng.randint(0, 10_000) for _ in range(size)]
        ingest = [rng.randint(0, 10_000) for _ in range(size)]
        batch = make_batch(keys, values, first_seq=seq, event_times=event, ingest_times=ingest)
        seq += size
        for k, v in zip(keys, values, strict=True):
            truth.add(k, v)
        update = state.apply(batch, "key", value_field(function))
        applied += size

        assert update.records == size
        out = update.batch
        assert out.schema == state.output_schema()
        assert out.schema.field("key").type == key_type
        expected_value_type = pa.int64() if function == "count" else pa.float64()
        assert out.schema.field("value").type == expected_value_type
        rows = out.to_pylist()
        assert len(rows) == len(set(keys))
        by_key = {r["key"]: r for r in rows}
        assert set(by_key) == set(keys)
        for k, row in by_key.items():
            positions = [i for i, key in enumerate(keys) if key == k]
            assert row["value"] == truth.value(function, k)
            assert row["n"] == len(positions)
            assert row["event_time"] == max(event[i] for i in positions)
            assert row["ingest_time"] == min(ingest[i] for i in positions)
            assert row["_group"] == group_of(k)

    assert state.items() == truth.values(function)
    assert state.key_count == len(truth.count)
    for k in truth.count:
        assert state.get(k) == truth.value(function, k)
    assert state.get("absent" if key_kind == "str" else 10**12) is None

    hits = state.group_hits()
    assert hits.shape == (G,)
    assert int(hits.sum()) == applied
    per_group = np.zeros(G, dtype=np.int64)
    for k, c in truth.count.items():
        per_group[group_of(k)] += c
    assert hits.tolist() == per_group.tolist()


@pytest.mark.usefixtures("backend")
def test_count_with_a_field_still_counts() -> None:
    state = new_state("count")
    state.apply(make_batch([1, 1, 2], [5.0, 6.0, 7.0]), "key", "value")
    assert state.items() == {1: 2, 2: 1}
    assert isinstance(state.get(1), int)


@pytest.mark.usefixtures("backend")
def test_integer_value_field_is_aggregated_as_float() -> None:
    keys, values = [3, 3, 4], [10, -2, 7]
    batch = pa.RecordBatch.from_arrays(
        [
            pa.array(keys, type=pa.int64()),
            pa.array(values, type=pa.int64()),
            *[pa.array([0, 1, 2], type=pa.int64())] * 2,
            pa.array([0, 0, 0], type=pa.int32()),
            pa.array([0, 1, 2], type=pa.int64()),
            pa.array(key_groups(pa.array(keys), G), type=pa.int32()),
        ],
        schema=record_schema({"key": "int", "value": "int"}),
    )
    for function, expected in [("sum", {3: 8.0, 4: 7.0}), ("min", {3: -2.0, 4: 7.0})]:
        state = new_state(function)
        out = state.apply(batch, "key", "value").batch
        assert state.items() == expected
        assert out.schema.field("value").type == pa.float64()


@pytest.mark.usefixtures("backend")
def test_empty_batch_changes_nothing() -> None:
    state = new_state("sum")
    state.apply(make_batch([1, 2], [1.0, 2.0]), "key", "value")
    update = state.apply(make_batch([], []), "key", "value")
    assert update.records == 0
    assert update.batch.num_rows == 0
    assert update.batch.schema == state.output_schema()
    assert state.items() == {1: 1.0, 2: 2.0}
    assert int(state.group_hits().sum()) == 2


@pytest.mark.usefixtures("backend")
def test_many_keys_grow_the_columns() -> None:
    rng = random.Random(3)
    state = new_state("max")
    truth = Truth()
    for start in range(0, 5000, 1000):
        keys = list(range(start, start + 1000)) + int_keys(rng, 500, distinct=8000)
        values = quarter_values(rng, len(keys))
        state.apply(make_batch(keys, values), "key", "value")
        for k, v in zip(keys, values, strict=True):
            truth.add(k, v)
    assert state.key_count == len(truth.count) > 5000
    assert state.items() == truth.values("max")
    assert state.bytes_estimate() > 0


@pytest.mark.usefixtures("backend")
@settings(max_examples=40, deadline=None)
@given(
    function=st.sampled_from(FUNCTIONS),
    string_keys=st.booleans(),
    records=st.lists(
        st.tuples(st.integers(-6, 6), st.integers(-400, 400)), min_size=0, max_size=80
    ),
    cuts=st.lists(st.integers(0, 80), max_size=6),
)
def test_any_split_into_batches_gives_the_dict_truth(
    function: str, string_keys: bool, records: list[tuple[int, int]], cuts: list[int]
) -> None:
    keys: list[Any] = [f"k{k}" if string_keys else k for k, _ in records]
    values = [v / 4 for _, v in records]
    bounds = sorted({0, len(records), *(c for c in cuts if c <= len(records))})
    state = new_state(function, pa.string() if string_keys else pa.int64())
    truth = Truth()
    for lo, hi in itertools.pairwise(bounds):
        update = state.apply(make_batch(keys[lo:hi], values[lo:hi], first_seq=lo), "key", "value")
        for k, v in zip(keys[lo:hi], values[lo:hi], strict=True):
            truth.add(k, v)
        assert {r["key"]: r["value"] for r in update.batch.to_pylist()} == {
            k: truth.value(function, k) for k in set(keys[lo:hi])
        }
        assert sum(update.batch.column("n").to_pylist()) == hi - lo
    assert state.items() == truth.values(function)
    assert int(state.group_hits().sum()) == len(records)


# ------------------------------------------------------------------------------------------
# AggregateState: snapshot, restore, drop


def filled(function: str, seed: int, key_kind: str = "int") -> tuple[AggregateStore, Truth]:
    rng = random.Random(seed)
    state = new_state(function, pa.int64() if key_kind == "int" else pa.string())
    truth = Truth()
    for _ in range(4):
        keys = int_keys(rng, 200, 120) if key_kind == "int" else str_keys(rng, 200, 120)
        values = quarter_values(rng, 200)
        state.apply(make_batch(keys, values), "key", value_field(function))
        for k, v in zip(keys, values, strict=True):
            truth.add(k, v)
    return state, truth


@pytest.mark.usefixtures("backend")
@pytest.mark.parametrize("function", FUNCTIONS)
@pytest.mark.parametrize("key_kind", ["int", "str"])
def test_snapshot_restore_drop_moves_groups(function: str, key_kind: str) -> None:
    old, truth = filled(function, seed=11, key_kind=key_kind)
    new = new_state(function, old.key_type)
    moving = list(range(0, G, 3))
    moving_keys = {k for k in truth.count if group_of(k) in moving}
    staying_keys = set(truth.count) - moving_keys
    assert moving_keys and staying_keys

    snap = old.snapshot_groups(iter(moving))
    assert snap.num_rows == len(moving_keys)
    assert {GROUP_COL, KEY_COL, HITS_COL, "count", "sum", "min", "max"} <= set(snap.schema.names)
    for row in snap.to_pylist():
        k = row[KEY_COL]
        assert row[GROUP_COL] == group_of(k)
        assert row[HITS_COL] == row["count"] == truth.count[k]
        if function != "count":
            assert (row["sum"], row["min"], row["max"]) == (
                truth.total[k],
                truth.low[k],
                truth.high[k],
            )

    new.restore(snap)
    assert old.drop_groups(moving) == len(moving_keys)

    assert set(new.items()) == moving_keys
    assert set(old.items()) == staying_keys
    assert {**old.items(), **new.items()} == truth.values(function)
    assert old.key_count + new.key_count == len(truth.count)
    assert old.snapshot_groups(moving).num_rows == 0

    expected_hits = np.zeros(G, dtype=np.int64)
    for k, c in truth.count.items():
        expected_hits[group_of(k)] += c
    in_moving = np.isin(np.arange(G), moving)
    assert old.group_hits()[in_moving].tolist() == [0] * int(in_moving.sum())
    assert old.group_hits()[~in_moving].tolist() == expected_hits[~in_moving].tolist()
    assert new.group_hits()[in_moving].tolist() == expected_hits[in_moving].tolist()
    assert new.group_hits()[~in_moving].tolist() == [0] * int((~in_moving).sum())
    assert (old.group_hits() + new.group_hits()).tolist() == expected_hits.tolist()

    # Records keep arriving, routed by group: the two halves still add up to the truth.
    rng = random.Random(99)
    keys = int_keys(rng, 300, 150) if key_kind == "int" else str_keys(rng, 300, 150)
    values = quarter_values(rng, 300)
    to_new = [group_of(k) in moving for k in keys]
    for owner, mine in ((new, True), (old, False)):
        picked = [i for i, flag in enumerate(to_new) if flag == mine]
        owner.apply(
            make_batch([keys[i] for i in picked], [values[i] for i in picked]),
            "key",
            value_field(function),
        )
    for k, v in zip(keys, values, strict=True):
        truth.add(k, v)
    assert not set(old.items()) & set(new.items())
    assert {**old.items(), **new.items()} == truth.values(function)
    assert int(old.group_hits().sum() + new.group_hits().sum()) == 1100


@pytest.mark.usefixtures("backend")
def test_a_move_out_indexes_its_groups_and_takes_them_chunk_by_chunk_as_a_scan_would() -> None:
    """`index_groups` before a move out: fetched keys leave the moving groups and their slots
    go to new keys of staying groups, and a moving group gets a key (then no index serves it);
    each chunk's snapshot and drop are still exactly what a store without the index gives."""
    indexed, _ = filled("sum", seed=31)
    plain, _ = filled("sum", seed=31)
    moving = list(range(0, G, 2))
    indexed.index_groups(moving)
    fetched = sorted(k for k in indexed.items() if group_of(k) in moving)[:40]
    rng = random.Random(7)
    staying = [k for k in (rng.randrange(10**6, 10**7) for _ in range(400)) if group_of(k) % 2]
    late = next(k for k in range(10**7, 10**8) if group_of(k) == moving[3])
    for state in (indexed, plain):
        assert state.drop_keys(fetched) == len(fetched)
        state.apply(make_batch([*staying, late], [1.0] * (len(staying) + 1)), "key", "value")
    for chunk in (moving[i : i + 5] for i in range(0, len(moving), 5)):
        got, want = indexed.snapshot_groups(chunk), plain.snapshot_groups(chunk)
        assert sorted(got.to_pylist(), key=str) == sorted(want.to_pylist(), key=str), chunk
        assert indexed.drop_groups(chunk) == plain.drop_groups(chunk)
    assert indexed.items() == plain.items()
    assert all(group_of(k) % 2 for k in indexed.items())


@pytest.mark.usefixtures("backend")
def test_restore_of_present_key_raises_and_changes_nothing() -> None:
    a, _ = filled("sum", seed=1)
    b = new_state("sum")
    b.apply(make_batch([7919 * 3, 5], [1.0, 2.0]), "key", "value")
    before = b.items()
    hits_before = b.group_hits().copy()
    snap = a.snapshot_keys([7919 * 3, 7919 * 4])
    assert snap.num_rows == 2
    with pytest.raises(ValueError, match="duplicate state"):
        b.restore(snap)
    assert b.items() == before
    assert b.group_hits().tolist() == hits_before.tolist()
    # Restoring the same snapshot twice is also refused.
    c = new_state("sum")
    c.restore(snap)
    with pytest.raises(ValueError):
        c.restore(snap)


@pytest.mark.usefixtures("backend")
def test_snapshot_keys_takes_present_keys_only() -> None:
    state, truth = filled("mean", seed=5)
    present = sorted(truth.count)[:5]
    snap = state.snapshot_keys([*present, 123456789])
    assert sorted(snap.column(KEY_COL).to_pylist()) == present
    other = new_state("mean")
    other.restore(snap)
    assert other.items() == {k: truth.value("mean", k) for k in present}
    assert state.snapshot_keys([]).num_rows == 0
    # A snapshot does not remove anything.
    assert state.items() == truth.values("mean")


@pytest.mark.usefixtures("backend")
def test_restore_then_apply_continues_from_snapshot() -> None:
    a = new_state("min")
    a.apply(make_batch([1, 1, 2], [5.0, 3.0, 9.0]), "key", "value")
    b = new_state("min")
    b.restore(a.snapshot_groups(range(G)))
    a.drop_groups(range(G))
    assert a.key_count == 0 and a.items() == {}
    b.apply(make_batch([1, 2, 2], [4.0, 10.0, 8.0]), "key", "value")
    assert b.items() == {1: 3.0, 2: 8.0}


@pytest.mark.usefixtures("backend")
@pytest.mark.parametrize("function", FUNCTIONS)
def test_slots_are_reused_cleanly_after_drop(function: str) -> None:
    state, truth = filled(function, seed=21)
    dropped_groups = list(range(0, G, 2))
    dropped = {k for k in truth.count if group_of(k) in dropped_groups}
    assert state.drop_groups(dropped_groups) == len(dropped)
    assert state.drop_groups(dropped_groups) == 0
    for k in dropped:
        assert state.get(k) is None
        for table in (truth.count, truth.total, truth.low, truth.high):
            table.pop(k, None)

    # Dropped keys come back fresh, new keys take the freed slots; nothing leaks between them.
    rng = random.Random(22)
    keys = sorted(dropped)[:10] + [10**9 + i for i in range(len(dropped) + 50)]
    keys += int_keys(rng, 100, 120)
    values = quarter_values(rng, len(keys))
    update = state.apply(make_batch(keys, values), "key", value_field(function))
    for k, v in zip(keys, values, strict=True):
        truth.add(k, v)
    assert state.items() == truth.values(function)
    assert {r["key"]: r["value"] for r in update.batch.to_pylist()} == {
        k: truth.value(function, k) for k in set(keys)
    }
    snap = {r[KEY_COL]: r for r in state.snapshot_keys(keys).to_pylist()}
    for k in set(keys):
        assert snap[k][HITS_COL] == truth.count[k]
    assert int(state.group_hits().sum()) == sum(truth.count.values())


# ------------------------------------------------------------------------------------------
# ProcessState


def running_seqs(state: list[int] | None, record: dict[str, Any]) -> tuple[Any, Any]:
    """Keep the sequence numbers seen per key; a negative value clears the key."""
    if record["value"] < 0:
        return None, "cleared"
    seqs = [*(state or []), record["seq"]]
    return seqs, len(seqs)


def quiet_when_even(state: int | None, record: dict[str, Any]) -> tuple[Any, Any]:
    """Count records per key; output only on odd counts."""
    count = (state or 0) + 1
    return count, (count if count % 2 else None)


def process_truth(
    keys: Sequence[Any], values: Sequence[float], seqs: Sequence[int], state: dict[Any, list[int]]
) -> list[tuple[Any, Any, int]]:
    outputs: list[tuple[Any, Any, int]] = []
    for k, v, s in zip(keys, values, seqs, strict=True):
        if v < 0:
            state.pop(k, None)
            outputs.append((k, "cleared", s))
        else:
            state.setdefault(k, []).append(s)
            outputs.append((k, len(state[k]), s))
    return outputs


@pytest.mark.usefixtures("backend")
@pytest.mark.parametrize("key_kind", ["int", "str"])
def test_process_state_outputs_in_order_and_state_matches(key_kind: str) -> None:
    rng = random.Random(key_kind)
    key_type = pa.int64() if key_kind == "int" else pa.string()
    state = new_process_state(running_seqs, key_type)
    truth: dict[Any, list[int]] = {}
    seq = 0
    for size in [5, 60, 0, 33]:
        keys = int_keys(rng, size, 12) if key_kind == "int" else str_keys(rng, size, 12)
        values = [rng.choice([1.0, 2.0, 3.0, -1.0]) for _ in range(size)]
        batch = make_batch(keys, values, first_seq=seq, source=3)
        expected = process_truth(keys, values, list(range(seq, seq + size)), truth)
        outputs, n = state.apply(batch, "key")
        assert n == size
        assert [(o["key"], o["value"], o["seq"]) for o in outputs] == expected
        for o in outputs:
            assert o["source"] == 3
            assert o["event_time"] == o["ingest_time"] == o["seq"]
            assert o["_group"] == group_of(o["key"])
        seq += size
    assert state.items() == truth
    assert state.key_count == len(truth)
    for k, seqs in truth.items():
        assert state.get(k) == seqs
    # Hotness counts the records of live keys since they were last cleared.
    assert int(state.group_hits().sum()) == sum(len(seqs) for seqs in truth.values())
    assert state.bytes_estimate() > 0


@pytest.mark.usefixtures("backend")
def test_process_state_none_deletes_key() -> None:
    state = new_process_state(running_seqs, pa.int64())
    state.apply(make_batch([4, 4, 9], [1.0, 1.0, 1.0]), "key")
    assert state.get(4) == [0, 1]
    outputs, _ = state.apply(make_batch([4], [-1.0], first_seq=3), "key")
    assert [o["value"] for o in outputs] == ["cleared"]
    assert state.get(4) is None
    assert state.key_count == 1
    assert state.items() == {9: [2]}
    assert state.snapshot_keys([4]).num_rows == 0
    # The key starts over.
    state.apply(make_batch([4], [1.0], first_seq=4), "key")
    assert state.get(4) == [4]
    snap = state.snapshot_keys([4]).to_pylist()
    assert [(r[KEY_COL], r[HITS_COL]) for r in snap] == [(4, 1)]


@pytest.mark.usefixtures("backend")
def test_process_state_none_output_emits_nothing() -> None:
    state = new_process_state(quiet_when_even, pa.int64())
    outputs, n = state.apply(make_batch([1, 1, 1, 2], [0.0] * 4), "key")
    assert n == 4
    assert [(o["key"], o["value"]) for o in outputs] == [(1, 1), (1, 3), (2, 1)]
    assert state.items() == {1: 3, 2: 1}


@pytest.mark.usefixtures("backend")
@pytest.mark.parametrize("key_kind", ["int", "str"])
def test_process_state_snapshot_restore_roundtrip(key_kind: str) -> None:
    rng = random.Random(7)
    key_type = pa.int64() if key_kind == "int" else pa.string()
    old = new_process_state(running_seqs, key_type)
    keys = int_keys(rng, 400, 60) if key_kind == "int" else str_keys(rng, 400, 60)
    values = [1.0] * 400
    old.apply(make_batch(keys, values), "key")
    truth: dict[Any, list[int]] = {}
    process_truth(keys, values, list(range(400)), truth)
    hits = {k: len(v) for k, v in truth.items()}

    moving = list(range(1, G, 2))
    moving_keys = {k for k in truth if group_of(k) in moving}
    assert moving_keys and moving_keys != set(truth)
    snap = old.snapshot_groups(moving)
    assert snap.num_rows == len(moving_keys)
    assert {(r[KEY_COL], r[GROUP_COL], r[HITS_COL]) for r in snap.to_pylist()} == {
        (k, group_of(k), hits[k]) for k in moving_keys
    }
    new = new_process_state(running_seqs, key_type)
    new.restore(snap)
    assert old.drop_groups(moving) == len(moving_keys)

    assert new.items() == {k: truth[k] for k in moving_keys}
    assert old.items() == {k: v for k, v in truth.items() if k not in moving_keys}
    assert int(old.group_hits().sum() + new.group_hits().sum()) == 400
    for g in moving:
        assert old.group_hits()[g] == 0
        assert new.group_hits()[g] == sum(hits[k] for k in moving_keys if group_of(k) == g)

    # The state moved is a copy: more records at the new owner extend it there only.
    k = next(iter(moving_keys))
    new.apply(make_batch([k], [1.0], first_seq=400), "key")
    assert new.get(k) == [*truth[k], 400]
    assert old.get(k) is None

    with pytest.raises(ValueError, match="duplicate state"):
        new.restore(snap)

    by_key = old.snapshot_keys(
        [next(iter(set(truth) - moving_keys)), "nope" if key_kind == "str" else -5]
    )
    assert by_key.num_rows == 1


@pytest.mark.usefixtures("backend")
def test_process_state_group_hits_zero_after_dropping_group_with_cleared_keys() -> None:
    state = new_process_state(running_seqs, pa.int64())
    state.apply(make_batch([8, 8, 8], [1.0, -1.0, 1.0]), "key")
    group = group_of(8)
    assert state.drop_groups([group]) == 1
    assert state.group_hits()[group] == 0
