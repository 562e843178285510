"""Event-time windows per key in the keyed stage: tumbling and sliding (hopping) windows with
the built-in aggregates, fired once when the instance's watermark passes a window's end.

Window state is keyed state like any other: each (key, window) is one entry of the stage's
aggregate store under a composite string key (`key`, the unit separator, the window's start),
in the key group of its key, so it counts towards the group's hotness, moves live with every
strategy and is checkpointed and restored with the group. Records are expanded into one row
per window they fall in (vectorised) as they reach the keyed instance; the migration machinery
then parks, forwards and fetches those rows by their composite key, as it does plain keys.

Which windows wait to fire is an index kept beside the store (window end -> composite keys and
their groups), rebuilt from the store after a restore and for the groups a move brought in. A
fired window is deleted from the store (with a tombstone for incremental checkpoints), so a
recovery that restores a checkpoint taken after it does not fire it again, and one taken
before it fires it once more into an output log truncated to that checkpoint. Records for a
window whose end the watermark has passed are late: counted and dropped. An instance that
hands groups over tells the new owner its watermark first (`floor`), so a window the old owner
fired is late at the new owner too, never fired twice.

Called by `keyshift.runtime.keyed_stage` only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from keyshift.runtime.records import EVENT_TIME, GROUP, INGEST_TIME, now_us
from keyshift.runtime.state import GROUP_COL, KEY_COL, aggregate_values

SEPARATOR = "\x1f"  # between a key and its window's start in a composite key
WINDOW_START, WINDOW_END = "window_start", "window_end"


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


def window_output_schema(function: str, key_type: pa.DataType) -> pa.Schema:
    """What a window sends downstream when it fires: its key, bounds, value and record count;
    its event time is its end less 1 µs, its version the records in it."""
    value_type = pa.int64() if function == "count" else pa.float64()
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
    """What windows need of an aggregate store (memory or RocksDB)."""

    def snapshot_groups(self, groups: Iterable[int]) -> pa.RecordBatch: ...

    def snapshot_keys(self, keys: Sequence[Any]) -> pa.RecordBatch: ...

    def expire_keys(self, keys: Sequence[Any]) -> int: ...


def _starts(keys: pa.Array) -> np.ndarray:
    parts = pc.split_pattern(keys, SEPARATOR)
    starts: np.ndarray = pc.list_element(parts, 1).cast(pa.int64()).to_numpy(zero_copy_only=False)
    return starts


class KeyedWindows:
    """The windows of one keyed instance over its aggregate store (string composite keys)."""

    def __init__(
        self,
        shape: WindowShape,
        function: str,
        key_field: str,
        key_type: pa.DataType,
        state: WindowStore,
        max_key_groups: int,
    ) -> None:
        self.shape = shape
        self.function = function
        self.key_field = key_field
        self.key_type = key_type
        self.state = state
        self.pending: dict[int, dict[str, int]] = {}  # window end -> composite key -> group
        # Per group, the watermark of the instance that handed it over: its windows that had
        # fired there are late here, whatever this instance's own watermark says.
        self.handed_over = np.full(max_key_groups, np.iinfo(np.int64).min, dtype=np.int64)
        self.out_schema = window_output_schema(function, key_type)

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

    def hand_over(self, groups: np.ndarray, watermark: int) -> None:
        """Groups moving here from an instance at `watermark`."""
        self.handed_over[groups] = np.maximum(self.handed_over[groups], watermark)

    def threshold(self, watermark: int | None, groups: np.ndarray) -> np.ndarray:
        """Per row (of these groups), the event time below which a window is complete."""
        floor: np.ndarray = self.handed_over[groups]
        return floor if watermark is None else np.maximum(floor, watermark)

    def late(self, batch: pa.RecordBatch, threshold: np.ndarray) -> np.ndarray:
        """A mask of the expanded rows whose window the threshold has passed."""
        ends = _starts(batch.column(self.key_field)) + self.shape.size_us
        result: np.ndarray = ends <= threshold
        return result

    def track(self, keys: pa.Array, groups: np.ndarray) -> None:
        """Windows that hold state now wait to fire."""
        ends = _starts(keys) + self.shape.size_us
        for end, key, group in zip(ends.tolist(), keys.to_pylist(), groups.tolist(), strict=True):
            self.pending.setdefault(end, {})[key] = group

    def rebuild(self, groups: Iterable[int]) -> None:
        """Index the windows `groups` hold (after a restore, or a move in)."""
        snapshot = self.state.snapshot_groups(groups)
        if snapshot.num_rows:
            self.track(snapshot.column(KEY_COL), snapshot.column(GROUP_COL).to_numpy())

    def fire(self, watermark: int, owned: np.ndarray) -> pa.RecordBatch | None:
        """Every window of an owned group whose end the watermark has reached, out of the store:
        their results. Windows of groups no longer owned (moved away) leave the index."""
        due = sorted(end for end in self.pending if end <= watermark)
        keys: list[str] = []
        for end in due:
            keys += [k for k, group in self.pending.pop(end).items() if owned[group]]
        if not keys:
            return None
        snapshot = self.state.snapshot_keys(keys)
        self.state.expire_keys(keys)
        composite = snapshot.column(KEY_COL)
        starts = _starts(composite)
        ends = starts + self.shape.size_us
        originals = pc.list_element(pc.split_pattern(composite, SEPARATOR), 0)
        count = snapshot.column("count").to_numpy()
        values = aggregate_values(
            self.function,
            count,
            snapshot.column("sum").to_numpy(),
            snapshot.column("min").to_numpy(),
            snapshot.column("max").to_numpy(),
        )
        columns: list[Any] = [
            originals.cast(self.key_type),
            pa.array(starts),
            pa.array(ends),
            pa.array(values).cast(self.out_schema.field("value").type),
            pa.array(count.astype(np.int64)),
            pa.array(ends - 1),
            pa.array(np.full(len(ends), now_us(), dtype=np.int64)),
            pa.array(count.astype(np.int64)),
            snapshot.column(GROUP_COL).cast(pa.int32()),
        ]
        return pa.RecordBatch.from_arrays(columns, schema=self.out_schema)
