"""Event-time windows per key in the keyed stage: tumbling and sliding (hopping) windows with
the built-in aggregates or a user's reduce/process over the window's records, fired once when
the instance's watermark passes a window's end, and updated by late records within the stage's
allowed lateness.

What a window keeps is its `WindowContents`: an aggregate's running columns in the aggregate
store (`AggregateContents`), or a user's function's [records, accumulator] as one value of a
process-state store (`FunctionContents`: `WindowFunction` folds each record with `reduce`, or
keeps the records for `process`, which is called when the window's result is read).

Window state is keyed state like any other: each (key, window) is one entry of the stage's
store under a composite string key (`key`, the unit separator, the window's start),
in the key group of its key, so it counts towards the group's hotness, moves live with every
strategy and is checkpointed and restored with the group. Records are expanded into one row
per window they fall in (vectorised) as they reach the keyed instance; the migration machinery
then parks, forwards and fetches those rows by their composite key, as it does plain keys.

Which windows wait to fire is an index kept beside the store (window end -> composite keys and
their groups), rebuilt from the store after a restore and for the groups a move brought in
or an aborted move out brought back (as from an instance at the watermark they left at: a
window that came due while they were away was never sent, and fires then).
Without allowed lateness a fired window is deleted from the store (with a tombstone for
incremental checkpoints), so a recovery that restores a checkpoint taken after it does not
fire it again, and one taken before it fires it once more into an output log truncated to that
checkpoint. With allowed lateness L a fired window stays in the store (a second index: end + L
-> its keys) until the watermark reaches end + L; a record for it meanwhile is applied and the
window's updated result sent at once (more records in it: a higher `n` and `version`, which
replaces the earlier result by key and window downstream). Records for a window whose end + L
the watermark has passed are too late: the keyed stage counts them and hands them to the
job's late-records log.

Whether a window in the store has fired is never stored with it: it has iff its end is at or
below the group's threshold, the highest of the instance's watermark and the watermark of the
instance the group came from (`hand_over`: a move tells the new owner its watermark first, and
a restore tells each group the watermark its instance had at the checkpoint). So a window the
old owner fired is late at the new owner too, never fired twice.

Session windows (`keyshift.runtime.sessions`) share this module's group floors, output schema
and record view, and implement `EventWindows` as `KeyedWindows` does; the keyed stage
(`keyshift.runtime.keyed_stage`) drives both through it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from keyshift.runtime.job import WindowOperator, resolve_function
from keyshift.runtime.keyspace import key_groups
from keyshift.runtime.records import EVENT_TIME, GROUP, INGEST_TIME, SEQ, SOURCE, now_us
from keyshift.runtime.state import GROUP_COL, KEY_COL, aggregate_values
from keyshift.runtime.state_values import ValueCodec

SEPARATOR = "\x1f"  # between a key and its window's start in a composite key
WINDOW_START, WINDOW_END = "window_start", "window_end"
# A user's window function's store is keyed by this column of the records it is given: the
# composite key, while the records keep their own key for the function to read.
WINDOW_KEY = "_window_key"
# What a window function's records do not show: the runtime's own columns.
_INTERNAL = (WINDOW_KEY, GROUP, SOURCE, SEQ, INGEST_TIME)


@dataclass(frozen=True)
class WindowShape:
    """Windows of `size_us` every `slide_us` (equal for tumbling windows), in event time."""

    size_us: int
    slide_us: int

    def __post_init__(self) -> None:
        if self.size_us <= 0 or self.slide_us <= 0:
            raise ValueError(f"window size and slide must be > 0 µs, got {self}")
        if self.slide_us > self.size_us:
            raise ValueError(f"a slide ({self.slide_us} µs) larger than the size leaves gaps")

    def assign(self, times: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(row, window start) for every window each event time falls in: start <= t <
        start + size, starts at multiples of the slide."""
        per_record = -(-self.size_us // self.slide_us)
        rows = np.repeat(np.arange(len(times)), per_record)
        back = np.tile(np.arange(per_record, dtype=np.int64), len(times)) * self.slide_us
        starts = (times[rows] // self.slide_us) * self.slide_us - back
        inside = starts + self.size_us > times[rows]
        return rows[inside], starts[inside]


def window_value_type(aggregate: str | None) -> pa.DataType:
    """The type of a window's value: a count's int, another aggregate's float, a user's
    function's result as JSON text."""
    if aggregate is None:
        return pa.string()
    return pa.int64() if aggregate == "count" else pa.float64()


def window_output_schema(aggregate: str | None, key_type: pa.DataType) -> pa.Schema:
    """What a window sends downstream when it fires: its key, bounds, value and record count;
    its event time is its end less 1 µs, its version the records in it."""
    value_type = window_value_type(aggregate)
    return pa.schema(
        [
            pa.field(KEY_COL, key_type),
            pa.field(WINDOW_START, pa.int64()),
            pa.field(WINDOW_END, pa.int64()),
            pa.field("value", value_type),
            pa.field("n", pa.int64()),
            pa.field(EVENT_TIME, pa.int64()),
            pa.field(INGEST_TIME, pa.int64()),
            pa.field("version", pa.int64()),
            pa.field(GROUP, pa.int32()),
        ]
    )


class WindowStore(Protocol):
    """What windows need of a store (memory or RocksDB; aggregate or process state)."""

    def snapshot_groups(self, groups: Iterable[int]) -> pa.RecordBatch: ...

    def snapshot_keys(self, keys: Sequence[Any]) -> pa.RecordBatch: ...

    def expire_keys(self, keys: Sequence[Any]) -> int: ...


class _Update(Protocol):
    @property
    def batch(self) -> pa.RecordBatch: ...


class AggregateStore(WindowStore, Protocol):
    def apply(self, batch: pa.RecordBatch, key_field: str, value_field: str | None) -> _Update: ...


class FunctionStore(WindowStore, Protocol):
    codec: ValueCodec

    def apply(self, batch: pa.RecordBatch, key_field: str) -> tuple[list[dict[str, Any]], int]: ...


class WindowContents(Protocol):
    """What a window keeps of its records and how its result is read: a built-in aggregate's
    running columns, or a user's function's accumulator."""

    @property
    def aggregate(self) -> str | None:
        """The built-in aggregate; None for a user's function."""
        ...

    def add(
        self, rows: pa.RecordBatch, key_field: str, as_records: Callable[[pa.RecordBatch], Any]
    ) -> tuple[pa.Array, np.ndarray]:
        """Expanded rows into their windows; the composite keys and groups of those changed."""
        ...

    def values(self, snapshot: pa.RecordBatch) -> tuple[pa.Array, np.ndarray]:
        """The windows' values and record counts, from a snapshot of their keys."""
        ...


@dataclass(frozen=True)
class AggregateContents:
    """A built-in aggregate of `field` per window, vectorised over the aggregate store."""

    aggregate: str
    field: str | None
    state: AggregateStore

    def add(
        self, rows: pa.RecordBatch, key_field: str, as_records: Callable[[pa.RecordBatch], Any]
    ) -> tuple[pa.Array, np.ndarray]:
        update = self.state.apply(rows, key_field, self.field).batch
        return update.column(KEY_COL), update.column(GROUP).to_numpy()

    def values(self, snapshot: pa.RecordBatch) -> tuple[pa.Array, np.ndarray]:
        count = snapshot.column("count").to_numpy()
        values = aggregate_values(
            self.aggregate,
            count,
            snapshot.column("sum").to_numpy(),
            snapshot.column("min").to_numpy(),
            snapshot.column("max").to_numpy(),
        )
        return pa.array(values).cast(window_value_type(self.aggregate)), count


@dataclass(frozen=True)
class WindowFunction:
    """A user's reduce or process as the per-record function of a process-state store: each
    window's state is [records in it, accumulator], the accumulator folded by `reduce` or the
    list of the window's records for `process` (called when the window's result is read)."""

    reduce: Callable[[Any, Any], Any] | None
    process: Callable[[list[Any]], Any] | None
    field: str | None

    @classmethod
    def of(cls, op: WindowOperator) -> WindowFunction:
        reduce = resolve_function(op.reduce) if op.reduce is not None else None
        process = resolve_function(op.process) if op.process is not None else None
        return cls(reduce, process, op.field)

    def __call__(self, state: list[Any] | None, record: dict[str, Any]) -> tuple[list[Any], bool]:
        n, acc = state if state is not None else (0, None)
        item = record[self.field] if self.field is not None else visible(record)
        if self.reduce is not None:
            acc = self.reduce(acc, item)
        else:
            acc = acc if acc is not None else []
            acc.append(item)
        return [n + 1, acc], True  # an output per record: the store says which windows changed

    def result(self, state: list[Any]) -> Any:
        return state[1] if self.process is None else self.process(state[1])


def visible(record: dict[str, Any]) -> dict[str, Any]:
    """A record as a user's window function sees it: without the runtime's own columns."""
    return {name: value for name, value in record.items() if name not in _INTERNAL}


@dataclass(frozen=True)
class FunctionContents:
    """A user's reduce or process per window (`WindowFunction`) over a process-state store."""

    function: WindowFunction
    state: FunctionStore
    aggregate: None = None

    def add(
        self, rows: pa.RecordBatch, key_field: str, as_records: Callable[[pa.RecordBatch], Any]
    ) -> tuple[pa.Array, np.ndarray]:
        records = as_records(rows).append_column(WINDOW_KEY, rows.column(key_field))
        outputs, _ = self.state.apply(records, WINDOW_KEY)
        changed = {out[KEY_COL]: out[GROUP] for out in outputs}
        groups = np.fromiter(changed.values(), np.int64, len(changed))
        return pa.array(list(changed), pa.string()), groups

    def values(self, snapshot: pa.RecordBatch) -> tuple[pa.Array, np.ndarray]:
        states = [self.state.codec.decode(blob) for blob in snapshot.column("state").to_pylist()]
        results = [json.dumps(self.function.result(state)) for state in states]
        counts = np.fromiter((state[0] for state in states), np.int64, len(states))
        return pa.array(results, pa.string()), counts


def window_contents(op: WindowOperator, state: Any) -> WindowContents:
    """What `op`'s windows keep, over the store `make_state` made for it."""
    if op.aggregate is not None:
        return AggregateContents(op.aggregate, op.field, state)
    assert isinstance(state.function, WindowFunction)  # make_state's store for a user's function
    return FunctionContents(state.function, state)


def composite_groups(key_type: pa.DataType, max_key_groups: int, keys: Sequence[str]) -> np.ndarray:
    """The key groups of composite keys: their key's, where the senders routed its records (a
    store that finds keys by their group is given this, `functools.partial`'d)."""
    composite = pa.array(keys, pa.string())
    originals = pc.list_element(pc.split_pattern(composite, SEPARATOR), 0).cast(key_type)
    return key_groups(originals, max_key_groups)


def _starts(keys: pa.Array) -> np.ndarray:
    parts = pc.split_pattern(keys, SEPARATOR)
    starts: np.ndarray = pc.list_element(parts, 1).cast(pa.int64()).to_numpy(zero_copy_only=False)
    return starts


class EventWindows(Protocol):
    """What the keyed stage needs of its windows: tumbling and sliding (`KeyedWindows`) or
    sessions (`keyshift.runtime.sessions.SessionWindows`)."""

    out_schema: pa.Schema

    def expand(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """Records as the rows the store keeps them in."""
        ...

    def too_late(self, batch: pa.RecordBatch, threshold: np.ndarray) -> np.ndarray:
        """A mask of the rows too late for their windows whatever the state holds."""
        ...

    def as_records(self, rows: pa.RecordBatch) -> pa.RecordBatch:
        """Rows as the records they came from, each with its window's start."""
        ...

    def absorb(
        self, rows: pa.RecordBatch, thresholds: np.ndarray
    ) -> tuple[pa.RecordBatch | None, pa.RecordBatch | None]:
        """Rows into their windows, fired or not by the per-group `thresholds`: the updated
        results of windows that had fired, and the records found too late (as records)."""
        ...

    def hand_over(self, groups: np.ndarray, watermark: int) -> None: ...

    def threshold(self, watermark: int | None, groups: np.ndarray) -> np.ndarray: ...

    def thresholds(self, watermark: int | None, ready: np.ndarray) -> np.ndarray: ...

    def rebuild(self, groups: Iterable[int], watermark: int | None) -> None:
        """Index the windows `groups` hold (after a restore, or a move in)."""
        ...

    def fire(self, watermark: int, owned: np.ndarray) -> pa.RecordBatch | None:
        """The results of the windows of owned groups the watermark has passed."""
        ...


def take_back(windows: EventWindows, groups: np.ndarray, left_at: int | None) -> None:
    """Groups whose move out was aborted, back from it as from an instance at `left_at` (the
    watermark they left at): windows that came due while they were away (`fire` dropped their
    index entries then) are unfired, and fire at the next `fire`."""
    if left_at is not None:
        windows.hand_over(groups, left_at)
    windows.rebuild(groups.tolist(), None)


class GroupFloors:
    """Per key group, the watermark of the instance that handed it over (a move, a restore):
    its windows that had fired there are late here, whatever this instance's own watermark
    says."""

    def __init__(self, max_key_groups: int) -> None:
        self.handed_over = np.full(max_key_groups, np.iinfo(np.int64).min, dtype=np.int64)

    def hand_over(self, groups: np.ndarray, watermark: int) -> None:
        """Groups moving here from an instance at `watermark`."""
        self.handed_over[groups] = np.maximum(self.handed_over[groups], watermark)

    def threshold(self, watermark: int | None, groups: np.ndarray) -> np.ndarray:
        """Per row (of these groups), the event time below which a window is complete."""
        floor: np.ndarray = self.handed_over[groups]
        return floor if watermark is None else np.maximum(floor, watermark)

    def thresholds(self, watermark: int | None, ready: np.ndarray) -> np.ndarray:
        """Per group, the event time below which a window is complete here. A group still
        moving in (not `ready`) has fired nothing here yet: only its old owner's fires count
        for it (its own wait for in_done)."""
        floor = self.handed_over
        if watermark is None:
            return floor
        result: np.ndarray = np.where(ready, np.maximum(floor, watermark), floor)
        return result


class KeyedWindows(GroupFloors):
    """The windows of one keyed instance over its aggregate store (string composite keys)."""

    def __init__(
        self,
        shape: WindowShape,
        contents: WindowContents,
        key_field: str,
        key_type: pa.DataType,
        state: WindowStore,
        max_key_groups: int,
        lateness_us: int = 0,
    ) -> None:
        super().__init__(max_key_groups)
        self.shape = shape
        self.lateness_us = lateness_us
        self.contents = contents
        self.key_field = key_field
        self.key_type = key_type
        self.state = state
        self.pending: dict[int, dict[str, int]] = {}  # window end -> composite key -> group
        # Fired windows kept for late records: end + lateness -> composite key -> group.
        self.retained: dict[int, dict[str, int]] = {}
        self.out_schema = window_output_schema(contents.aggregate, key_type)

    def expand(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """One row per (record, window it falls in), keyed by the composite key."""
        rows, starts = self.shape.assign(batch.column(EVENT_TIME).to_numpy())
        taken = batch.take(pa.array(rows))
        keys = pc.binary_join_element_wise(
            taken.column(self.key_field).cast(pa.string()),
            pa.array(starts).cast(pa.string()),
            SEPARATOR,
        )
        index = taken.schema.get_field_index(self.key_field)
        return taken.set_column(index, self.key_field, keys)

    def add(self, rows: pa.RecordBatch) -> tuple[pa.Array, np.ndarray]:
        """Expanded rows into their windows' state; the composite keys and groups of the
        windows they changed."""
        return self.contents.add(rows, self.key_field, self.as_records)

    def as_records(self, rows: pa.RecordBatch) -> pa.RecordBatch:
        """Expanded rows as the records they came from, each with its window's start (unless
        a record has a field of that name, the results of a window upstream: its own stays)."""
        composite = rows.column(self.key_field)
        index = rows.schema.get_field_index(self.key_field)
        originals = pc.list_element(pc.split_pattern(composite, SEPARATOR), 0)
        records = rows.set_column(index, self.key_field, originals.cast(self.key_type))
        if WINDOW_START in records.schema.names:
            return records
        return records.append_column(WINDOW_START, pa.array(_starts(composite)))

    def absorb(
        self, rows: pa.RecordBatch, thresholds: np.ndarray
    ) -> tuple[pa.RecordBatch | None, pa.RecordBatch | None]:
        """Expanded rows into their windows; the updated results of those that had fired
        (within their lateness: `too_late` took the others out before)."""
        keys, groups = self.add(rows)
        fired = self.track(keys, groups, thresholds[groups])
        return (self.results(pc.unique(fired).to_pylist()) if len(fired) else None), None

    def ends(self, keys: pa.Array) -> np.ndarray:
        """The end of each composite key's window."""
        ends: np.ndarray = _starts(keys) + self.shape.size_us
        return ends

    def too_late(self, batch: pa.RecordBatch, threshold: np.ndarray) -> np.ndarray:
        """A mask of the expanded rows whose window's end + allowed lateness the threshold has
        passed: their window is gone (or going), they can change no result."""
        result: np.ndarray = self.ends(batch.column(self.key_field)) + self.lateness_us <= threshold
        return result

    def track(self, keys: pa.Array, groups: np.ndarray, threshold: np.ndarray) -> pa.Array:
        """Windows that hold state now: those the threshold has not passed wait to fire, the
        others have fired and are kept until their lateness ends. Returns the latter's keys."""
        ends = self.ends(keys)
        fired = ends <= threshold
        lists = keys.to_pylist()
        for end, key, group, done in zip(
            ends.tolist(), lists, groups.tolist(), fired.tolist(), strict=True
        ):
            if done:
                self.retained.setdefault(end + self.lateness_us, {})[key] = group
            else:
                self.pending.setdefault(end, {})[key] = group
        return keys.filter(pa.array(fired))

    def rebuild(self, groups: Iterable[int], watermark: int | None) -> None:
        """Index the windows `groups` hold (after a restore, or a move in), as fired or not by
        `watermark` (None: by the groups' old owners' alone)."""
        snapshot = self.state.snapshot_groups(groups)
        if snapshot.num_rows:
            owners = snapshot.column(GROUP_COL).to_numpy()
            self.track(snapshot.column(KEY_COL), owners, self.threshold(watermark, owners))

    def fire(self, watermark: int, owned: np.ndarray) -> pa.RecordBatch | None:
        """Every window of an owned group whose end the watermark has reached: their results;
        without allowed lateness they leave the store, with it they stay until it ends. Windows
        of groups no longer owned (moved away) leave the indexes."""
        self._expire(watermark, owned)
        due = _due(self.pending, watermark, owned)
        if not due:
            return None
        keys = [key for key, _ in due]
        out = self.results(keys)
        if self.lateness_us:
            ends = self.ends(pa.array(keys, pa.string())) + self.lateness_us
            for (key, group), end in zip(due, ends.tolist(), strict=True):
                self.retained.setdefault(end, {})[key] = group
        else:
            self.state.expire_keys(keys)
        return out

    def _expire(self, watermark: int, owned: np.ndarray) -> None:
        """Fired windows whose lateness the watermark has passed leave the store."""
        due = _due(self.retained, watermark, owned)
        if due:
            self.state.expire_keys([key for key, _ in due])

    def results(self, keys: Sequence[str]) -> pa.RecordBatch:
        """The windows' results as they stand in the store."""
        snapshot = self.state.snapshot_keys(keys)
        composite = snapshot.column(KEY_COL)
        starts = _starts(composite)
        ends = starts + self.shape.size_us
        originals = pc.list_element(pc.split_pattern(composite, SEPARATOR), 0)
        values, count = self.contents.values(snapshot)
        columns: list[Any] = [
            originals.cast(self.key_type),
            pa.array(starts),
            pa.array(ends),
            values,
            pa.array(count.astype(np.int64)),
            pa.array(ends - 1),
            pa.array(np.full(len(ends), now_us(), dtype=np.int64)),
            pa.array(count.astype(np.int64)),
            snapshot.column(GROUP_COL).cast(pa.int32()),
        ]
        return pa.RecordBatch.from_arrays(columns, schema=self.out_schema)


def _due(
    index: dict[int, dict[str, int]], watermark: int, owned: np.ndarray
) -> list[tuple[str, int]]:
    """The (key, group) entries of `index` (time -> key -> group) at or below the watermark,
    out of it: those of owned groups (the others moved away), in time order."""
    due: list[tuple[str, int]] = []
    for time in sorted(t for t in index if t <= watermark):
        due += [(key, group) for key, group in index.pop(time).items() if owned[group]]
    return due
