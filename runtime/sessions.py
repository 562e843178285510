"""Session windows per key in the keyed stage: a key's records less than the gap apart in event
time are one session, a record that bridges two sessions merges them, and a session fires once
when the instance's watermark passes its end (its last record's time plus the gap), with the
built-in aggregates or a user's reduce/process over its records, and is updated by records
within the stage's allowed lateness.

A session's bounds depend on its key's other records, so sessions are not expanded into
composite keys as tumbling and sliding windows are (`keyshift.runtime.windows`): a key's
sessions are one value of a process-state store (memory or RocksDB) under the key itself,
`[[start, end, n, accumulator, fired], ...]` sorted by start, and `SessionFunction` is the
store's per-record function. So session state is keyed state like any other: in its key's
group, counted in the group's hotness, moved live with every strategy (a key fetched on demand
brings its sessions), checkpointed incrementally and restored, on both backends.

Firing goes through the store, as timers do (`keyshift.runtime.timers`): an index beside it (a
`TimerQueue`: time -> keys) says which keys to look at, rebuilt from the store after a restore,
a move in or an aborted move out; a due key is a row applied to the store, which fires its
sessions the watermark has passed in the same update that marks them fired (or deletes them).
Every unfired session has an entry at or before its end: a record that only makes a session
longer adds none (the session's earlier entry, when due, indexes it again at its new end).
Whether a session fired is stored with it, so a stale index entry does nothing and a session
fires once: the old owner of a moving group fires nothing of it from the start of the move, the
new owner nothing before the group is in (then all that is due), and a recovery restores the
checkpoint's unfired sessions, whose output after it was truncated.

Lateness is judged after merging, as Flink does, against the group's threshold (`GroupFloors`:
the highest of the instance's watermark and the watermark of the instance the group came from):
a record whose merged session's end plus the allowed lateness is at or below it is too late
(counted, written to the late-records log with the merged session's start, the state left as
it was), while an old record that lands in a session still open is taken. With allowed lateness
L a fired session stays until the watermark reaches its end + L; a record for it meanwhile
sends the updated session's result at once. An update may have grown the session (a record
that bridged it and another): its result replaces the earlier results of that key whose bounds
it covers.

Called by `keyshift.runtime.keyed_stage` only.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import reduce as fold
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from keyshift.runtime.job import WindowOperator, resolve_function
from keyshift.runtime.records import EVENT_TIME, GROUP, now_us
from keyshift.runtime.state import GROUP_COL, KEY_COL, aggregate_values
from keyshift.runtime.state_values import ValueCodec
from keyshift.runtime.timers import EVENT, TimedStore, TimerQueue
from keyshift.runtime.windows import (
    WINDOW_START,
    GroupFloors,
    WindowStore,
    visible,
    window_output_schema,
    window_value_type,
)

# A stored session: [start, end, n, accumulator, fired], end exclusive (last record + gap).
START, END, COUNT, ACC, FIRED = range(5)


class SessionStore(WindowStore, TimedStore, Protocol):
    """A process-state store whose function is a `SessionFunction` (memory or RocksDB)."""

    codec: ValueCodec


@dataclass
class Fired:
    """Sessions whose results are due, in the order they fired."""

    keys: list[Any] = field(default_factory=list)
    groups: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    # A built-in aggregate's running [sum, min, max]; a user's function's result as JSON.
    values: list[Any] = field(default_factory=list)


class SessionFunction:
    """The per-record function of a session stage's store: a record merges into its key's
    sessions; a row applied while `firing` fires the key's due sessions. What it found (fired
    sessions, records too late) waits here for `SessionWindows` to take."""

    def __init__(
        self,
        gap_us: int,
        lateness_us: int,
        aggregate: str | None,
        field: str | None,
        reduce: Callable[[Any, Any], Any] | None,
        process: Callable[[list[Any]], Any] | None,
        key_field: str,
        max_key_groups: int,
    ) -> None:
        self.gap_us = gap_us
        self.lateness_us = lateness_us
        self.aggregate = aggregate
        self.field = field
        self.reduce = reduce
        self.process = process
        self.key_field = key_field
        # Per group, the event time below which a session is complete: set before each apply.
        self.thresholds = np.full(max_key_groups, np.iinfo(np.int64).min, dtype=np.int64)
        self.firing = False
        self.queue = TimerQueue()
        self.fired = Fired()
        self.late: list[dict[str, Any]] = []

    @classmethod
    def of(cls, op: WindowOperator, key_field: str, max_key_groups: int) -> SessionFunction:
        return cls(
            op.gap_us(),
            op.allowed_lateness_us(),
            op.aggregate,
            op.field,
            resolve_function(op.reduce) if op.reduce is not None else None,
            resolve_function(op.process) if op.process is not None else None,
            key_field,
            max_key_groups,
        )

    def __call__(self, stored: Any, record: dict[str, Any]) -> tuple[Any, None]:
        sessions: list[list[Any]] = stored if stored is not None else []
        key, group = record[self.key_field], record[GROUP]
        limit = int(self.thresholds[group])
        if self.firing:
            kept = self._fire(sessions, key, group, limit)
        else:
            kept = self._add(sessions, key, group, limit, record)
        return kept or None, None

    def _add(
        self, sessions: list[list[Any]], key: Any, group: int, limit: int, record: dict[str, Any]
    ) -> list[list[Any]]:
        at = int(record[EVENT_TIME])
        end = at + self.gap_us
        merged = [at, end, 1, self._accumulator(record), False]
        before, after = [], []
        # Sessions never overlap one another, so only those the record's own one overlaps
        # merge (their union with it has no holes), and the rest stay in order around it.
        indexed = False
        for session in sessions:
            if session[START] >= end:
                after.append(session)
            elif session[END] <= at:
                before.append(session)
            else:
                # An unfired part has an index entry at or before its end: when it comes due,
                # `_fire` finds the merged session not due yet and indexes it at its own end.
                indexed |= not session[FIRED]
                merged = self._merge(session, merged)
        if merged[END] + self.lateness_us <= limit:
            self.late.append({WINDOW_START: merged[START]} | record)
            return sessions
        if merged[END] <= limit:  # within the lateness of a fired session: updated at once
            self._emit(key, group, merged)
        elif not indexed:
            self.queue.add(EVENT, merged[END], key, group)
        return [*before, merged, *after]

    def _fire(self, sessions: list[list[Any]], key: Any, group: int, limit: int) -> list[list[Any]]:
        kept = []
        for session in sessions:
            if not session[FIRED]:
                if session[END] > limit:  # merged into a later end since it was indexed
                    self.queue.add(EVENT, session[END], key, group)
                    kept.append(session)
                    continue
                self._emit(key, group, session)
            if session[END] + self.lateness_us > limit:  # fired, kept for its lateness
                kept.append(session)
        return kept

    def _emit(self, key: Any, group: int, session: list[Any]) -> None:
        session[FIRED] = True
        if self.lateness_us:
            self.queue.add(EVENT, session[END] + self.lateness_us, key, group)
        fired = self.fired
        fired.keys.append(key)
        fired.groups.append(group)
        fired.starts.append(session[START])
        fired.ends.append(session[END])
        fired.counts.append(session[COUNT])
        fired.values.append(session[ACC] if self.aggregate is not None else self._result(session))

    def _accumulator(self, record: dict[str, Any]) -> Any:
        """A one-record session's: [sum, min, max] of the field for an aggregate (nothing for
        a count), the record (or its field) for a user's function."""
        if self.aggregate is not None:
            if self.aggregate == "count":
                return None
            value = float(record[self.field])  # type: ignore[index]  # the job has a field
            return [value, value, value]
        return [record[self.field] if self.field is not None else visible(record)]

    def _merge(self, a: list[Any], b: list[Any]) -> list[Any]:
        first, second = (a, b) if a[START] <= b[START] else (b, a)
        acc: Any
        if self.aggregate is None:
            acc = [*first[ACC], *second[ACC]]
        elif first[ACC] is None:
            acc = None
        else:
            (s1, lo1, hi1), (s2, lo2, hi2) = first[ACC], second[ACC]
            acc = [s1 + s2, min(lo1, lo2), max(hi1, hi2)]
        end = max(a[END], b[END])
        return [first[START], end, a[COUNT] + b[COUNT], acc, False]

    def _result(self, session: list[Any]) -> str:
        items = session[ACC]
        if self.reduce is not None:
            return json.dumps(fold(self.reduce, items, None))
        assert self.process is not None  # a session without an aggregate has a function
        return json.dumps(self.process(items))

    def index(self, snapshot: pa.RecordBatch, codec: ValueCodec) -> None:
        """Index the sessions held in a snapshot of the store: when each fires or leaves."""
        keys = snapshot.column(KEY_COL).to_pylist()
        groups = snapshot.column(GROUP_COL).to_pylist()
        for key, group, blob in zip(
            keys, groups, snapshot.column("state").to_pylist(), strict=True
        ):
            for session in codec.decode(blob):
                due = session[END] + (self.lateness_us if session[FIRED] else 0)
                self.queue.add(EVENT, due, key, group)

    def take(self) -> tuple[Fired, list[dict[str, Any]]]:
        fired, late = self.fired, self.late
        self.fired, self.late = Fired(), []
        return fired, late


class SessionWindows(GroupFloors):
    """The sessions of one keyed instance, over its process-state store (`EventWindows`)."""

    def __init__(
        self,
        function: SessionFunction,
        key_field: str,
        key_type: pa.DataType,
        state: SessionStore,
        max_key_groups: int,
    ) -> None:
        super().__init__(max_key_groups)
        self.function = function
        self.key_field = key_field
        self.key_type = key_type
        self.state = state
        self.out_schema = window_output_schema(function.aggregate, key_type)

    def expand(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        return batch  # a session is found in its key's state, not by its record alone

    def too_late(self, batch: pa.RecordBatch, threshold: np.ndarray) -> np.ndarray:
        # An old record may still land in a session that is open: the state decides.
        return np.zeros(batch.num_rows, dtype=bool)

    def as_records(self, rows: pa.RecordBatch) -> pa.RecordBatch:
        return rows

    def absorb(
        self, rows: pa.RecordBatch, thresholds: np.ndarray
    ) -> tuple[pa.RecordBatch | None, pa.RecordBatch | None]:
        self.function.thresholds = thresholds
        self.state.apply(rows, self.key_field)
        fired, late = self.function.take()
        late_rows = None
        if late:
            schema = rows.schema
            if WINDOW_START not in schema.names:
                schema = schema.append(pa.field(WINDOW_START, pa.int64()))
            late_rows = pa.RecordBatch.from_pylist(late, schema=schema)
        return self.results(fired), late_rows

    def rebuild(self, groups: Iterable[int], watermark: int | None) -> None:
        """Index the sessions `groups` hold; whether each fired is stored with it."""
        self.function.index(self.state.snapshot_groups(groups), self.state.codec)

    def fire(self, watermark: int, owned: np.ndarray) -> pa.RecordBatch | None:
        """The results of the owned groups' sessions the watermark has passed, through the
        store (which marks them fired, or deletes them, in the same update); fired sessions
        whose lateness is over leave it."""
        due = self.function.queue.take_due(EVENT, watermark, owned)
        if not due:
            return None
        keys: dict[Any, int] = {key: group for _, key, group in due}
        rows = pa.RecordBatch.from_pydict(
            {
                self.key_field: pa.array(list(keys), self.key_type),
                GROUP: pa.array(list(keys.values()), pa.int32()),
            }
        )
        self.function.thresholds = self.thresholds(watermark, owned)
        self.function.firing = True
        try:
            self.state.apply(rows, self.key_field)
        finally:
            self.function.firing = False
        fired, _ = self.function.take()
        return self.results(fired)

    def results(self, fired: Fired) -> pa.RecordBatch | None:
        """Fired sessions as window results: key, bounds, value and count; event time the
        end less 1 µs, version the count."""
        if not fired.keys:
            return None
        counts = np.asarray(fired.counts, dtype=np.int64)
        ends = np.asarray(fired.ends, dtype=np.int64)
        aggregate = self.function.aggregate
        values: pa.Array
        if aggregate is None:
            values = pa.array(fired.values, pa.string())
        else:
            running = np.array(
                [acc if acc is not None else (0.0, 0.0, 0.0) for acc in fired.values],
                dtype=np.float64,
            ).reshape(-1, 3)
            computed = aggregate_values(
                aggregate, counts, running[:, 0], running[:, 1], running[:, 2]
            )
            values = pa.array(computed).cast(window_value_type(aggregate))
        columns: list[Any] = [
            pa.array(fired.keys, self.key_type),
            pa.array(fired.starts, pa.int64()),
            pa.array(ends),
            values,
            pa.array(counts),
            pa.array(ends - 1),
            pa.array(np.full(len(ends), now_us(), dtype=np.int64)),
            pa.array(counts),
            pa.array(fired.groups, pa.int32()),
        ]
        return pa.RecordBatch.from_arrays(columns, schema=self.out_schema)
