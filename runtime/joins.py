"""Joins of a keyed stage's two inputs on their key: the window join (records of both sides in
the same tumbling event-time window) and the interval join (left.ts + lower <= right.ts <=
left.ts + upper), as Flink's DataStream joins have them.

The senders wrap each side's records into one schema (`wrap`, run by
`keyshift.runtime.edge_router`: the key, the side, the record as JSON, with the record's
metadata), so a join stage reads one stream whatever its inputs, and a sender feeding both
sides sends both on its one stream to each instance. The join itself is a process function
with event-time timers (`keyshift.runtime.timers`): a key's value holds each side's records
that may still match, its timers say when they stop mattering, so join state is keyed state
like any other: in the key's group, moved live with every strategy, checkpointed and restored
with it, and each timer fires once across a rescale or a recovery.

- `WindowJoin` keeps, per window, both sides' records; the window's timer (its end) sends
  every pair, once, when the watermark passes the end, and forgets the window.
- `IntervalJoin` sends a pair as soon as its second record arrives (the first is in the
  state), and drops a record once the watermark makes later matches impossible (past the last
  time a partner could have: left.ts + upper, right.ts - lower), by one timer per key at the
  earliest such time of its records.

A record too late for its join (its window fired, or its time behind the watermark: partners
it should have met may be gone) is not joined: `late` says which, and the keyed stage counts
them and writes them to the late-records log as windows' late records are. Each output row
is one pair: its value the pair's (or the join function's result, as JSON), its event time the
window's last µs or the later record's time.

Called by `keyshift.runtime.keyed_stage` (the functions) and `keyshift.runtime.edge_router`
(`wrap`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

from keyshift.runtime.job import (
    FieldType,
    IntervalJoinOperator,
    JoinOperator,
    WindowJoinOperator,
    resolve_function,
)
from keyshift.runtime.job_graph import JOIN_RECORD, JOIN_SIDE, KEY_FIELD
from keyshift.runtime.records import ARROW_TYPES, EVENT_TIME, GROUP, METADATA_FIELDS
from keyshift.runtime.timers import TimerKind, TimerService

Record = dict[str, Any]
PairFunction = Callable[[Record, Record], Any]
# What a join's function returns per call: the pairs it matched, as (event time, value).
Matches = list[tuple[int, Any]]
LEFT, RIGHT = 0, 1


def wrap(
    batch: pa.RecordBatch, side: int, key_by: str, fields: dict[str, FieldType]
) -> pa.RecordBatch:
    """One side's records (of schema `fields`, with their metadata) as the join stage reads
    them: their key, `side`, and the record as JSON."""
    records = batch.select(list(fields)).to_pylist()
    columns: dict[str, pa.Array] = {
        KEY_FIELD: batch.column(key_by).cast(ARROW_TYPES[fields[key_by]]),
        JOIN_SIDE: pa.array(np.full(batch.num_rows, side, dtype=np.int64)),
        JOIN_RECORD: pa.array([json.dumps(r) for r in records], pa.string()),
    }
    for name in (*METADATA_FIELDS, GROUP):
        columns[name] = batch.column(name)
    return pa.RecordBatch.from_pydict(columns)


def unwrap(record: Record) -> tuple[int, int, Record]:
    """(side, event time, the side's record with its event_time) of a wrapped record."""
    at = int(record[EVENT_TIME])
    return int(record[JOIN_SIDE]), at, {**json.loads(record[JOIN_RECORD]), EVENT_TIME: at}


class _Join:
    """What both joins share: the user's pair function, and a pair's output."""

    def __init__(self, function: str | None) -> None:
        self.pair: PairFunction | None = None if function is None else resolve_function(function)

    def matched(self, at: int, left: Record, right: Record, out: Matches) -> None:
        value = [left, right] if self.pair is None else self.pair(left, right)
        if value is not None:
            out.append((at, value))


class WindowJoin(_Join):
    """Per key, [window start, left records, right records] of each open window; a window's
    timer at its end sends its pairs (every left with every right, in arrival order)."""

    def __init__(self, op: WindowJoinOperator) -> None:
        super().__init__(op.function)
        self.size_us = op.size_us()

    def start(self, at: int) -> int:
        return at // self.size_us * self.size_us

    def late(self, times: np.ndarray, threshold: int | np.ndarray) -> np.ndarray:
        """Records whose window the threshold (watermark) has passed: it has fired."""
        ends: np.ndarray = (times // self.size_us + 1) * self.size_us
        return ends <= threshold

    def __call__(self, state: Any, record: Record, timers: TimerService) -> tuple[Any, None]:
        side, at, item = unwrap(record)
        windows: list[list[Any]] = state or []
        start = self.start(at)
        window = next((w for w in windows if w[0] == start), None)
        if window is None:
            window = [start, [], []]
            windows.append(window)
            timers.register_event_time_timer(start + self.size_us)
        window[1 + side].append(item)
        return windows, None

    def on_timer(
        self, state: Any, key: Any, timestamp: int, kind: TimerKind, timers: TimerService
    ) -> tuple[Any, Matches | None]:
        out: Matches = []
        kept = []
        for window in state or []:
            start, lefts, rights = window
            if start + self.size_us > timestamp:
                kept.append(window)
                continue
            end = start + self.size_us
            for left in lefts:
                for right in rights:
                    self.matched(end - 1, left, right, out)
        return kept or None, out or None


class IntervalJoin(_Join):
    """Per key, [left records, right records] as [time, record] that may still match; a pair
    is sent when its second record arrives."""

    def __init__(self, op: IntervalJoinOperator) -> None:
        super().__init__(op.function)
        self.lower_us, self.upper_us = op.bounds_us()

    def late(self, times: np.ndarray, threshold: int | np.ndarray) -> np.ndarray:
        """Records behind the threshold (watermark): partners they should meet may be gone."""
        late: np.ndarray = times < threshold
        return late

    def expiry(self, side: int, at: int) -> int:
        """When a record stops mattering: once the watermark is past the last time a partner
        of it could have (later records are at or after the watermark)."""
        last = at + self.upper_us if side == LEFT else at - self.lower_us
        return last + 1

    def __call__(self, state: Any, record: Record, timers: TimerService) -> tuple[Any, Any]:
        side, at, item = unwrap(record)
        sides: list[list[list[Any]]] = state or [[], []]
        out: Matches = []
        if side == LEFT:
            low, high = at + self.lower_us, at + self.upper_us
            for t, right in sides[RIGHT]:
                if low <= t <= high:
                    self.matched(max(at, t), item, right, out)
        else:
            low, high = at - self.upper_us, at - self.lower_us
            for t, left in sides[LEFT]:
                if low <= t <= high:
                    self.matched(max(at, t), left, item, out)
        sides[side].append([at, item])
        # One timer per key, at its earliest expiry, rather than one per record: a key's
        # records mostly come in time order, so most need none of their own.
        expiry = self.expiry(side, at)
        pending = timers.event_time_timers()
        if not pending or expiry < pending[0]:
            timers.register_event_time_timer(expiry)
        return sides, out or None

    def on_timer(
        self, state: Any, key: Any, timestamp: int, kind: TimerKind, timers: TimerService
    ) -> tuple[Any, None]:
        # Everything the watermark has made useless goes now, not only what this timer was for:
        # the next timer is then after the watermark, not due already.
        now = max(timestamp, timers.current_watermark or timestamp)
        sides = [
            [[t, r] for t, r in (state or [[], []])[side] if self.expiry(side, t) > now]
            for side in (LEFT, RIGHT)
        ]
        if not sides[LEFT] and not sides[RIGHT]:
            for stale in timers.event_time_timers():  # for records gone already
                timers.delete_event_time_timer(stale)
            return None, None
        left = [self.expiry(LEFT, t) for t, _ in sides[LEFT]]
        earliest = min(left + [self.expiry(RIGHT, t) for t, _ in sides[RIGHT]])
        pending = timers.event_time_timers()
        if not pending or earliest < pending[0]:
            timers.register_event_time_timer(earliest)
        return sides, None


Join = WindowJoin | IntervalJoin


def make_join(op: JoinOperator) -> Join:
    return WindowJoin(op) if isinstance(op, WindowJoinOperator) else IntervalJoin(op)


def pairs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A join's output rows (one per call, its value the call's matches) as one row per pair,
    with the pair's event time, its value as JSON."""
    out = []
    for row in rows:
        for at, value in row["value"]:
            out.append({**row, "value": json.dumps(value), EVENT_TIME: at})
    return out
