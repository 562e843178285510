"""Timers of a keyed `process` stage: event-time and processing-time timers per key, as
Flink's KeyedProcessFunction and TimerService have them, kept as keyed state.

A process function that names an `on_timer` function is called as `function(state, record,
timers)`; through `timers` (a `TimerService`) it registers and deletes timers for the key of
the record it is called with. When one is due, `on_timer(state, key, timestamp, kind, timers)`
is called with the key's state and returns `(state, output or None)` as the process function
does (and may register more timers). An event-time timer (`kind` "event") is due when the
instance's watermark reaches its timestamp, a processing-time timer ("processing") when the
wall clock does; timestamps are epoch microseconds, as event times are.

Timers are keyed state: a key's timers are stored in the key's own value, beside its state
(`[state, event timers, processing timers]`, sorted lists), so they live in the key's group in
the memory and RocksDB stores alike, move with the group under every rescale strategy (and
with a key fetched on demand), and are checkpointed, incrementally, and restored with it. The
store is the record; `TimerQueue` is an index beside it (timestamp -> keys), rebuilt from the
store after a restore and for the groups a move brought in, which only says where to look: a
timer fires by being taken out of its key's value in the same update that runs `on_timer`, so
an entry whose timer was deleted, or has already fired, does nothing. Hence exactly once:

- a move: the old owner fires no timer of a group from the moment it starts moving out (the
  group is not its own any more); the new owner fires none until the group is wholly in (its
  `in_done`), then every one due, before it releases the watermark hold downstream;
- a recovery: a checkpoint holds the timers not fired when it was taken; output sent after it
  is truncated, so those fire once more, once, from the restored state (a restored watermark
  already past them fires them at its next step).

Bad input is never a crash: an event-time timer on a stage whose source has no event time, or
a timestamp that is not an integer, is refused by `TimerService` and counted as an invalid
record (`keyshift_invalid_records_total`, reason "timer"), and the function goes on.

Called by `keyshift.runtime.keyed_stage` only.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable
from typing import Any, Literal, Protocol

import numpy as np
import pyarrow as pa

from keyshift.runtime.records import EVENT_TIME, GROUP, INGEST_TIME, SEQ, SOURCE, now_us
from keyshift.runtime.state import GROUP_COL, KEY_COL
from keyshift.runtime.state_values import ValueCodec

TimerKind = Literal["event", "processing"]
EVENT: TimerKind = "event"
PROCESSING: TimerKind = "processing"
KINDS: tuple[TimerKind, ...] = (EVENT, PROCESSING)
INVALID_REASON = "timer"

TimedFunction = Callable[[Any, dict[str, Any], "TimerService"], tuple[Any, Any]]
OnTimer = Callable[[Any, Any, int, TimerKind, "TimerService"], tuple[Any, Any]]


class TimedStore(Protocol):
    """What timers need of a process store (memory or RocksDB)."""

    def apply(self, batch: pa.RecordBatch, key_field: str) -> tuple[list[dict[str, Any]], int]: ...


class TimerService:
    """What a process function sees of its key's timers during one call."""

    def __init__(self, event_time: bool) -> None:
        self._event_time = event_time
        self.current_watermark: int | None = None
        self.current_processing_time = 0
        self._timers: dict[TimerKind, list[int]] = {EVENT: [], PROCESSING: []}
        self.added: list[tuple[TimerKind, int]] = []  # registered since `bind`
        self.invalid: list[str] = []  # why registrations were refused, since last taken

    def bind(self, timers: dict[TimerKind, list[int]]) -> None:
        self._timers = timers
        self.added = []

    def register_event_time_timer(self, timestamp: int) -> None:
        """Call `on_timer` for this key once the watermark reaches `timestamp` (µs)."""
        if not self._event_time:
            self._refuse(
                "an event-time timer on a stage whose source has no event time "
                "(give the source `event_time` settings, or use a processing-time timer)"
            )
        elif self._valid(timestamp):
            self._insert(EVENT, int(timestamp))

    def register_processing_time_timer(self, timestamp: int) -> None:
        """Call `on_timer` for this key once the wall clock reaches `timestamp` (µs)."""
        if self._valid(timestamp):
            self._insert(PROCESSING, int(timestamp))

    def _insert(self, kind: TimerKind, timestamp: int) -> None:
        timers = self._timers[kind]
        if timestamp not in timers:
            bisect.insort(timers, timestamp)
            self.added.append((kind, timestamp))

    def delete_event_time_timer(self, timestamp: int) -> None:
        _remove(self._timers[EVENT], timestamp)

    def delete_processing_time_timer(self, timestamp: int) -> None:
        _remove(self._timers[PROCESSING], timestamp)

    def event_time_timers(self) -> tuple[int, ...]:
        """This key's event-time timers that have not fired, earliest first."""
        return tuple(self._timers[EVENT])

    def processing_time_timers(self) -> tuple[int, ...]:
        return tuple(self._timers[PROCESSING])

    def _valid(self, timestamp: Any) -> bool:
        # bool is an int to Python, never a time; numpy integers are welcome.
        if isinstance(timestamp, bool) or not isinstance(timestamp, int | np.integer):
            self._refuse(f"a timer timestamp must be integer epoch µs, got {timestamp!r}")
            return False
        if not -(1 << 62) < int(timestamp) < (1 << 62):
            self._refuse(f"a timer timestamp out of range: {timestamp}")
            return False
        return True

    def _refuse(self, reason: str) -> None:
        self.invalid.append(reason)


def _remove(timers: list[int], timestamp: int) -> None:
    if timestamp in timers:
        timers.remove(timestamp)


def unwrap(stored: Any) -> tuple[Any, dict[TimerKind, list[int]]]:
    """A timed stage's stored value as (the function's state, its timers by kind)."""
    if stored is None:
        return None, {EVENT: [], PROCESSING: []}
    state, event, processing = stored
    return state, {EVENT: event, PROCESSING: processing}


def wrap(state: Any, timers: dict[TimerKind, list[int]]) -> Any:
    """What the store keeps: nothing once neither state nor timers are left."""
    if state is None and not timers[EVENT] and not timers[PROCESSING]:
        return None
    return [state, timers[EVENT], timers[PROCESSING]]


class TimerQueue:
    """Per kind, which keys (and their groups) have a timer at which timestamp: an index of
    the store, earliest first."""

    def __init__(self) -> None:
        self._entries: dict[TimerKind, dict[int, dict[Any, int]]] = {EVENT: {}, PROCESSING: {}}
        self._heaps: dict[TimerKind, list[int]] = {EVENT: [], PROCESSING: []}

    def add(self, kind: TimerKind, timestamp: int, key: Any, group: int) -> None:
        entries = self._entries[kind]
        if timestamp not in entries:
            entries[timestamp] = {}
            heapq.heappush(self._heaps[kind], timestamp)
        entries[timestamp][key] = group

    def next_due(self, kind: TimerKind) -> int | None:
        heap = self._heaps[kind]
        return heap[0] if heap else None

    def take_due(
        self, kind: TimerKind, limit: int, ready: np.ndarray
    ) -> list[tuple[int, Any, int]]:
        """(timestamp, key, group) of every entry at or before `limit`, in time order, out of
        the index: those of groups in `ready`; the others' entries are dropped (a group that
        moved away, or one still moving in, which is indexed again once it is in)."""
        heap, entries = self._heaps[kind], self._entries[kind]
        due: list[tuple[int, Any, int]] = []
        while heap and heap[0] <= limit:
            timestamp = heapq.heappop(heap)
            due += [(timestamp, k, g) for k, g in entries.pop(timestamp).items() if ready[g]]
        return due


class KeyedTimers:
    """The timers of one keyed instance: wraps the user's functions into the store's
    per-record function, and turns due timers into updates of their keys."""

    def __init__(
        self,
        function: TimedFunction,
        on_timer: OnTimer,
        key_field: str,
        key_type: pa.DataType,
        event_time: bool,
    ) -> None:
        self.function = function
        self.on_timer = on_timer
        self.key_field = key_field
        self.key_type = key_type
        self.service = TimerService(event_time)
        self.queue = TimerQueue()
        self._firing: TimerKind | None = None

    def __call__(self, stored: Any, record: dict[str, Any]) -> tuple[Any, Any]:
        """The store's per-record function: a record, or (while `fire` runs) a due timer,
        whose timestamp is the row's sequence number."""
        state, timers = unwrap(stored)
        self.service.bind(timers)
        key = record[self.key_field]
        out = None
        firing = self._firing
        if firing is None:
            state, out = self.function(state, record, self.service)
        elif record[SEQ] in timers[firing]:
            timers[firing].remove(record[SEQ])
            state, out = self.on_timer(state, key, record[SEQ], firing, self.service)
        # else: deleted, or fired already (a stale index entry): nothing to do
        for kind, timestamp in self.service.added:
            self.queue.add(kind, timestamp, key, record[GROUP])
        return wrap(state, timers), out

    def at(self, watermark: int | None) -> None:
        """The times the functions see as now."""
        self.service.current_watermark = watermark
        self.service.current_processing_time = now_us()

    def fire(
        self, store: TimedStore, kind: TimerKind, limit: int, ready: np.ndarray
    ) -> list[dict[str, Any]]:
        """Run `on_timer` for every timer of `kind` at or before `limit` of a ready group, in
        time order, through the store (which takes each out of its key's value in the same
        update); their outputs. A timer's output has its timestamp as event time (for a
        processing-time timer, the watermark if there is one), source -1 and the timestamp as
        sequence number."""
        next_due = self.queue.next_due(kind)
        if next_due is None or next_due > limit:
            return []
        due = self.queue.take_due(kind, limit, ready)
        if not due:
            return []
        times = [t for t, _, _ in due]
        mark = self.service.current_watermark
        events = times if kind == EVENT or mark is None else [mark] * len(due)
        now = now_us()
        rows = pa.RecordBatch.from_pydict(
            {
                self.key_field: pa.array([k for _, k, _ in due], self.key_type),
                EVENT_TIME: pa.array(events, pa.int64()),
                INGEST_TIME: pa.array([now] * len(due), pa.int64()),
                SOURCE: pa.array([-1] * len(due), pa.int32()),
                SEQ: pa.array(times, pa.int64()),
                GROUP: pa.array([g for _, _, g in due], pa.int32()),
            }
        )
        self._firing = kind
        try:
            outputs, _ = store.apply(rows, self.key_field)
        finally:
            self._firing = None
        return outputs

    def index(self, snapshot: pa.RecordBatch, codec: ValueCodec) -> None:
        """Index the timers held in a snapshot of the store (after a restore, a move in)."""
        keys = snapshot.column(KEY_COL).to_pylist()
        groups = snapshot.column(GROUP_COL).to_pylist()
        for key, group, blob in zip(
            keys, groups, snapshot.column("state").to_pylist(), strict=True
        ):
            _, timers = unwrap(codec.decode(blob))
            for kind in KINDS:
                for timestamp in timers[kind]:
                    self.queue.add(kind, timestamp, key, group)

    def take_invalid(self) -> list[str]:
        invalid, self.service.invalid = self.service.invalid, []
        return invalid
