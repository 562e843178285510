"""Keyed state: key group -> key -> value, with per-key and per-group access counts (hotness).

Two stores share one interface. `AggregateState` keeps running count/sum/min/max per key in
numpy columns and updates them a whole batch at a time; `ProcessState` keeps one Python value per
key for a user's per-record function (as bytes, by `keyshift.runtime.state_values`: plain data
as msgpack, pickle only in a job whose state bytes are authenticated). Both snapshot and restore
by key group or by key as Arrow batches, which is what live migration moves. Used by the keyed
stage instances.
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from keyshift.runtime.key_index import SlotKeys
from keyshift.runtime.records import EVENT_TIME, GROUP, INGEST_TIME, SEQ, SOURCE
from keyshift.runtime.state_values import ValueCodec

GROUP_COL = "group"
KEY_COL = "key"
HITS_COL = "hits"


class KeyedState(Protocol):
    """What migration and metrics need from a keyed store."""

    @property
    def key_count(self) -> int: ...

    def bytes_estimate(self) -> int: ...

    def group_hits(self) -> np.ndarray: ...

    def snapshot_groups(self, groups: Iterable[int]) -> pa.RecordBatch: ...

    def index_groups(self, groups: Iterable[int]) -> None:
        """A move out will snapshot and drop these groups a chunk at a time: a store that
        finds a group's keys by a pass over all of them may find these groups' at once."""

    def snapshot_keys(self, keys: Sequence[Any]) -> pa.RecordBatch: ...

    def restore(self, snapshot: pa.RecordBatch) -> None: ...

    def drop_groups(self, groups: Iterable[int]) -> int: ...

    def drop_keys(self, keys: Sequence[Any]) -> int: ...

    def group_sizes(self) -> np.ndarray: ...

    def changes(self, groups: Iterable[int]) -> StateChanges: ...

    def clear_changes(self) -> None: ...


@dataclass(frozen=True)
class StateChanges:
    """What changed in some key groups since `clear_changes`: for incremental checkpoints."""

    upserts: pa.RecordBatch  # the changed keys' rows, as snapshot_groups gives them
    deleted: dict[int, list[Any]]  # per group, keys whose state was deleted
    restored: set[int]  # groups that received state by `restore` (a migration): no delta
    # is known for them, so their next checkpoint must be a full one


@dataclass(frozen=True)
class Update:
    """The output of applying one batch: one row per key that changed, as an Arrow batch."""

    batch: pa.RecordBatch
    records: int


@functools.cache  # asked for every batch
def aggregate_output_schema(function: str, key_type: pa.DataType) -> pa.Schema:
    """The updates an aggregate emits: the key's new value after each batch that touched it."""
    value_type = pa.int64() if function == "count" else pa.float64()
    return pa.schema(
        [
            pa.field(KEY_COL, key_type),
            pa.field("value", value_type),
            pa.field("n", pa.int64()),
            pa.field(EVENT_TIME, pa.int64()),
            pa.field(INGEST_TIME, pa.int64()),
            # Records applied to the key so far, wherever it lived: the latest update of a
            # key is its highest version, even if a migration interleaved two owners'
            # updates at the sink.
            pa.field("version", pa.int64()),
            pa.field(GROUP, pa.int32()),
        ]
    )


def aggregate_values(
    function: str, count: np.ndarray, total: np.ndarray, low: np.ndarray, high: np.ndarray
) -> np.ndarray:
    """The value an aggregate shows for keys with these running columns."""
    if function == "count":
        return count
    if function == "sum":
        return total
    if function == "min":
        return low
    if function == "max":
        return high
    result: np.ndarray = total / count
    return result


def empty_update(schema: pa.Schema) -> Update:
    return Update(batch=pa.RecordBatch.from_pylist([], schema=schema), records=0)


@dataclass(frozen=True)
class Reduced:
    """A value field reduced per key."""

    sums: np.ndarray
    mins: np.ndarray
    maxs: np.ndarray


@dataclass(frozen=True)
class BatchAggregate:
    """One batch pre-aggregated per key, in the batch's sorted key order: what every aggregate
    backend applies to its state at once (one lookup and one write per key, not per record)."""

    keys: Any  # int64 numpy array for integer keys, else a list
    groups: np.ndarray
    counts: np.ndarray
    reduced: Reduced | None  # None when no value field is aggregated (count)
    event: np.ndarray  # the latest event time per key
    ingest: np.ndarray  # the earliest ingest time per key

    @classmethod
    def of(
        cls, batch: pa.RecordBatch, key_field: str, value_field: str | None, numeric: bool
    ) -> BatchAggregate:
        n = batch.num_rows
        key_col = batch.column(key_field)
        dictionary: pa.Array | None = None
        if numeric:
            codes = key_col.to_numpy()
        else:
            encoded = key_col.dictionary_encode()
            codes = encoded.indices.to_numpy().astype(np.int64)
            dictionary = encoded.dictionary
        order = np.argsort(codes)
        sorted_codes = codes[order]
        starts = np.concatenate(([0], np.flatnonzero(sorted_codes[1:] != sorted_codes[:-1]) + 1))
        keys: Any = sorted_codes[starts]
        if dictionary is not None:
            keys = dictionary.take(pa.array(keys)).to_pylist()
        reduced = None
        if value_field is not None:
            vals = batch.column(value_field).to_numpy(zero_copy_only=False).astype(np.float64)
            vals = vals[order]
            reduced = Reduced(
                np.add.reduceat(vals, starts),
                np.minimum.reduceat(vals, starts),
                np.maximum.reduceat(vals, starts),
            )
        return cls(
            keys=keys,
            groups=batch.column(GROUP).to_numpy()[order[starts]],
            counts=np.diff(np.append(starts, n)),
            reduced=reduced,
            event=np.maximum.reduceat(batch.column(EVENT_TIME).to_numpy()[order], starts),
            ingest=np.minimum.reduceat(batch.column(INGEST_TIME).to_numpy()[order], starts),
        )

    def take(self, order: np.ndarray) -> BatchAggregate:
        """The same keys in another order."""
        keys = (
            self.keys[order]
            if isinstance(self.keys, np.ndarray)
            else [self.keys[i] for i in order.tolist()]
        )
        reduced = None
        if self.reduced is not None:
            r = self.reduced
            reduced = Reduced(r.sums[order], r.mins[order], r.maxs[order])
        return BatchAggregate(
            keys, self.groups[order], self.counts[order], reduced, self.event[order],
            self.ingest[order],
        )  # fmt: skip

    def update(
        self, schema: pa.Schema, values: np.ndarray, versions: np.ndarray, groups: np.ndarray
    ) -> Update:
        """The output rows: each touched key's new value after this batch."""
        out = pa.RecordBatch.from_arrays(
            [
                pa.array(self.keys, type=schema.field(KEY_COL).type),
                pa.array(values),
                pa.array(self.counts),
                pa.array(self.event),
                pa.array(self.ingest),
                pa.array(versions),
                pa.array(groups),
            ],
            schema=schema,
        )
        return Update(batch=out, records=int(self.counts.sum()))


class AggregateState:
    """Running aggregates per key in numpy columns, updated a batch at a time."""

    _INITIAL = 1024

    def __init__(self, function: str, max_key_groups: int, key_type: pa.DataType) -> None:
        self.function = function
        self.max_key_groups = max_key_groups
        self.key_type = key_type
        self._keys = SlotKeys(key_type)
        self._index = self._keys.index()
        self._size = 0  # slots handed out so far, live or free
        self._free: list[int] = []
        self._count = np.zeros(0, dtype=np.int64)
        self._sum = np.zeros(0, dtype=np.float64)
        self._min = np.zeros(0)
        self._changed = np.zeros(0, dtype=np.bool_)  # slots updated since clear_changes
        self._restored: set[int] = set()
        self._expired: dict[int, set[Any]] = {}  # per group, keys expire_keys deleted
        self._max = np.zeros(0)
        self._hits = np.zeros(0, dtype=np.int64)
        self._group = np.zeros(0, dtype=np.int32)
        self._group_hits = np.zeros(max_key_groups, dtype=np.int64)
        # `index_groups`: per group, its slots when indexed (a slot dropped since may hold a
        # key of another group now: each use checks). A group given a new slot since is
        # indexed no more, so an indexed group's slots are all in its entry.
        self._indexed: dict[int, np.ndarray] = {}
        self._is_indexed = np.zeros(max_key_groups, dtype=np.bool_)
        self._grow(self._INITIAL)

    @property
    def key_count(self) -> int:
        return len(self._index)

    def bytes_estimate(self) -> int:
        # Six 8-byte columns, the group, the key and its index entry.
        per_key = 6 * 8 + 4 + (16 if self._keys.numeric else 100)
        return len(self._index) * per_key

    def group_hits(self) -> np.ndarray:
        return self._group_hits

    def _grow(self, needed: int) -> None:
        size = len(self._count)
        if needed <= size:
            return
        new = max(needed, size * 2)
        extra = new - size
        self._count = np.concatenate([self._count, np.zeros(extra, dtype=np.int64)])
        self._sum = np.concatenate([self._sum, np.zeros(extra)])
        self._min = np.concatenate([self._min, np.full(extra, np.inf)])
        self._max = np.concatenate([self._max, np.full(extra, -np.inf)])
        self._hits = np.concatenate([self._hits, np.zeros(extra, dtype=np.int64)])
        self._group = np.concatenate([self._group, np.full(extra, -1, dtype=np.int32)])
        self._changed = np.concatenate([self._changed, np.zeros(extra, dtype=np.bool_)])
        self._keys.grow(new)

    def _allocate(self, keys: Any, groups: np.ndarray) -> np.ndarray:
        n = len(groups)
        slots = np.empty(n, dtype=np.int64)
        reuse = min(len(self._free), n)
        if reuse:
            slots[:reuse] = self._free[-reuse:]
            del self._free[-reuse:]
        if n > reuse:
            self._grow(self._size + n - reuse)
            slots[reuse:] = np.arange(self._size, self._size + n - reuse)
            self._size += n - reuse
        self._index.insert(keys, slots)
        self._keys.set(slots, keys)
        self._group[slots] = groups
        if self._indexed:
            self._unindex(groups[self._is_indexed[groups]])
        return slots

    def index_groups(self, groups: Iterable[int]) -> None:
        """Find the slots of `groups` in one pass: a move of many groups out of a large state
        then snapshots and drops each chunk without a pass over every key (150 ms a chunk at
        13 M keys, most of a move's time)."""
        wanted = np.zeros(self.max_key_groups, dtype=np.bool_)
        wanted[np.fromiter(groups, dtype=np.int64)] = True
        live = self._live_slots()
        slots = live[wanted[self._group[live]]]
        # Groups fit 16 bits (at most 65,536 of them), which numpy sorts by radix: 8x faster.
        slots = slots[np.argsort(self._group[slots].astype(np.uint16), kind="stable")]
        owners = self._group[slots]
        starts = np.flatnonzero(np.diff(owners, prepend=-1))
        self._indexed.update((int(g), np.empty(0, dtype=np.int64)) for g in np.flatnonzero(wanted))
        self._indexed.update(zip(owners[starts].tolist(), np.split(slots, starts[1:]), strict=True))
        self._is_indexed |= wanted

    def _unindex(self, groups: np.ndarray) -> None:
        for group in np.unique(groups).tolist():
            self._indexed.pop(group, None)
        self._is_indexed[groups] = False

    def _slots(self, keys: Any, groups: np.ndarray) -> np.ndarray:
        slots = self._index.lookup(keys)
        missing = np.flatnonzero(slots < 0)
        if len(missing):
            slots[missing] = self._allocate(SlotKeys.subset(keys, missing), groups[missing])
        return slots

    def values(self, slots: np.ndarray) -> np.ndarray:
        return aggregate_values(
            self.function, self._count[slots], self._sum[slots], self._min[slots], self._max[slots]
        )

    def apply(self, batch: pa.RecordBatch, key_field: str, value_field: str | None) -> Update:
        """Apply every record of `batch`; return one output row per key it touched."""
        if batch.num_rows == 0:
            return empty_update(self.output_schema())
        part = BatchAggregate.of(
            batch, key_field, self._value_field(value_field), self._keys.numeric
        )
        slots = self._slots(part.keys, part.groups)
        self._count[slots] += part.counts
        self._hits[slots] += part.counts
        self._changed[slots] = True
        if part.reduced is not None:
            self._sum[slots] += part.reduced.sums
            self._min[slots] = np.minimum(self._min[slots], part.reduced.mins)
            self._max[slots] = np.maximum(self._max[slots], part.reduced.maxs)
        self._group_hits += np.bincount(
            batch.column(GROUP).to_numpy(), minlength=self.max_key_groups
        )
        return part.update(
            self.output_schema(), self.values(slots), self._hits[slots], self._group[slots]
        )

    def _value_field(self, value_field: str | None) -> str | None:
        return None if self.function == "count" else value_field

    def output_schema(self) -> pa.Schema:
        return aggregate_output_schema(self.function, self.key_type)

    def _live_slots(self) -> np.ndarray:
        return np.flatnonzero(self._group[: self._size] >= 0)

    def _snapshot_slots(self, slots: np.ndarray) -> pa.RecordBatch:
        return pa.RecordBatch.from_arrays(
            [
                pa.array(self._group[slots]),
                self._keys.arrow(self._keys.take(slots)),
                pa.array(self._hits[slots]),
                pa.array(self._count[slots]),
                pa.array(self._sum[slots]),
                pa.array(self._min[slots]),
                pa.array(self._max[slots]),
            ],
            names=[GROUP_COL, KEY_COL, HITS_COL, "count", "sum", "min", "max"],
        )

    def _group_slots(self, groups: Iterable[int]) -> np.ndarray:
        wanted = np.fromiter(groups, dtype=np.int32)
        if len(wanted) and self._is_indexed[wanted].all():
            indexed = np.concatenate([self._indexed[g] for g in wanted.tolist()])
            found: np.ndarray = indexed[np.isin(self._group[indexed], wanted)]
            return found
        live = self._live_slots()
        result: np.ndarray = live[np.isin(self._group[live], wanted)]
        return result

    def _key_slots(self, keys: Sequence[Any]) -> np.ndarray:
        query = np.asarray(keys, dtype=np.int64) if self._keys.numeric else list(keys)
        slots = self._index.lookup(query)
        return slots[slots >= 0]

    def snapshot_groups(self, groups: Iterable[int]) -> pa.RecordBatch:
        return self._snapshot_slots(self._group_slots(groups))

    def snapshot_keys(self, keys: Sequence[Any]) -> pa.RecordBatch:
        return self._snapshot_slots(self._key_slots(keys))

    def restore(self, snapshot: pa.RecordBatch) -> None:
        """Add the keys of a snapshot; a key already present is an ownership error."""
        key_col = snapshot.column(KEY_COL)
        keys: Any = key_col.to_numpy() if self._keys.numeric else key_col.to_pylist()
        present = np.flatnonzero(self._index.lookup(keys) >= 0)
        if len(present):
            example = SlotKeys.subset(keys, present[:1])[0]
            raise ValueError(
                f"restore would duplicate state of {len(present)} keys, e.g. {example!r}"
            )
        groups = snapshot.column(GROUP_COL).to_numpy()
        slots = self._allocate(keys, groups)
        hits = snapshot.column(HITS_COL).to_numpy()
        self._hits[slots] = hits
        self._count[slots] = snapshot.column("count").to_numpy()
        self._sum[slots] = snapshot.column("sum").to_numpy()
        self._min[slots] = snapshot.column("min").to_numpy()
        self._max[slots] = snapshot.column("max").to_numpy()
        np.add.at(self._group_hits, groups, hits)
        self._restored.update(np.unique(groups).tolist())

    def _drop_slots(self, slots: np.ndarray) -> None:
        self._index.remove(self._keys.take(slots))
        np.subtract.at(self._group_hits, self._group[slots], self._hits[slots])
        self._group[slots] = -1
        self._count[slots] = 0
        self._sum[slots] = 0.0
        self._min[slots] = np.inf
        self._max[slots] = -np.inf
        self._hits[slots] = 0
        self._changed[slots] = False
        self._free.extend(slots.tolist())

    def drop_groups(self, groups: Iterable[int]) -> int:
        wanted = np.fromiter(groups, dtype=np.int32)
        slots = self._group_slots(wanted)
        self._drop_slots(slots)
        if self._indexed:
            self._unindex(wanted)
        return len(slots)

    def drop_keys(self, keys: Sequence[Any]) -> int:
        slots = self._key_slots(keys)
        self._drop_slots(slots)
        return len(slots)

    def expire_keys(self, keys: Sequence[Any]) -> int:
        """Delete keys whose state is done with (a window that fired); unlike `drop_keys` (a
        key that moved away), the next incremental checkpoint records their deletion."""
        slots = self._key_slots(keys)
        taken = self._keys.take(slots)
        gone = taken.tolist() if isinstance(taken, np.ndarray) else taken
        for group, key in zip(self._group[slots].tolist(), gone, strict=True):
            self._expired.setdefault(group, set()).add(key)
        self._drop_slots(slots)
        return len(slots)

    def changes(self, groups: Iterable[int]) -> StateChanges:
        """Keys leave an aggregate with their whole group, or expire (`expire_keys`)."""
        wanted = list(groups)
        slots = self._group_slots(wanted)
        deleted = {g: sorted(self._expired[g]) for g in wanted if self._expired.get(g)}
        return StateChanges(
            self._snapshot_slots(slots[self._changed[slots]]), deleted, set(self._restored)
        )

    def clear_changes(self) -> None:
        self._changed[:] = False
        self._restored.clear()
        self._expired.clear()

    def group_sizes(self) -> np.ndarray:
        """Keys per key group."""
        live = self._live_slots()
        return np.bincount(self._group[live], minlength=self.max_key_groups)

    def get(self, key: Any) -> float | int | None:
        slots = self._key_slots([key])
        return self.values(slots).tolist()[0] if len(slots) else None

    def items(self) -> dict[Any, float | int]:
        live = self._live_slots()
        keys = self._keys.take(live)
        key_list = keys.tolist() if isinstance(keys, np.ndarray) else keys
        return dict(zip(key_list, self.values(live).tolist(), strict=True))


ProcessFunction = Callable[[Any, dict[str, Any]], tuple[Any, Any]]


def process_output(key: Any, out: Any, record: dict[str, Any]) -> dict[str, Any]:
    """A process function's output row, with the metadata of the record that made it."""
    return {
        KEY_COL: key,
        "value": out,
        EVENT_TIME: record[EVENT_TIME],
        INGEST_TIME: record[INGEST_TIME],
        SOURCE: record[SOURCE],
        SEQ: record[SEQ],
        GROUP: record[GROUP],
    }


class ProcessState:
    """One Python value per key, updated record by record by a user's function."""

    def __init__(
        self,
        function: ProcessFunction,
        max_key_groups: int,
        key_type: pa.DataType,
        codec: ValueCodec | None = None,
    ) -> None:
        self.function = function
        # Without an explicit codec no pickle is ever written or read: plain values only.
        self.codec = codec or ValueCodec(allow_pickle=False)
        self.max_key_groups = max_key_groups
        self.key_type = key_type
        self._groups: dict[int, dict[Any, Any]] = {}
        self._hits: dict[Any, int] = {}
        self._group_hits = np.zeros(max_key_groups, dtype=np.int64)
        # Since clear_changes: keys whose state was set, keys whose state was deleted (per
        # group), and groups restored into.
        self._changed: dict[int, set[Any]] = {}
        self._deleted: dict[int, set[Any]] = {}
        self._restored: set[int] = set()

    @property
    def key_count(self) -> int:
        return len(self._hits)

    def bytes_estimate(self) -> int:
        sample = next((v for g in self._groups.values() for v in g.values()), None)
        # An estimate only: pickle sizes any value (and dumping runs no foreign code).
        per_value = len(pickle.dumps(sample)) if sample is not None else 0
        return self.key_count * (per_value + 150)

    def group_hits(self) -> np.ndarray:
        return self._group_hits

    def apply(self, batch: pa.RecordBatch, key_field: str) -> tuple[list[dict[str, Any]], int]:
        """Run the function over each record in order; return its outputs with their metadata."""
        outputs: list[dict[str, Any]] = []
        for record in batch.to_pylist():
            key = record[key_field]
            group = record[GROUP]
            per_group = self._groups.setdefault(group, {})
            state, out = self.function(per_group.get(key), record)
            if state is None:
                # Returning None deletes the key's state, as in Flink's ValueState.clear(); the
                # group's hotness keeps counting live keys only, as it does after a drop.
                if per_group.pop(key, None) is not None:
                    self._deleted.setdefault(group, set()).add(key)
                    self._changed.get(group, set()).discard(key)
                self._group_hits[group] -= self._hits.pop(key, 0)
            else:
                per_group[key] = state
                self._hits[key] = self._hits.get(key, 0) + 1
                self._group_hits[group] += 1
                self._changed.setdefault(group, set()).add(key)
                self._deleted.get(group, set()).discard(key)
            if out is not None:
                outputs.append(process_output(key, out, record))
        return outputs, batch.num_rows

    def _snapshot(self, entries: list[tuple[int, Any, Any]]) -> pa.RecordBatch:
        return pa.RecordBatch.from_arrays(
            [
                pa.array([g for g, _, _ in entries], type=pa.int32()),
                pa.array([k for _, k, _ in entries], type=self.key_type),
                pa.array([self._hits.get(k, 0) for _, k, _ in entries], type=pa.int64()),
                pa.array([self.codec.encode(v) for _, _, v in entries], type=pa.binary()),
            ],
            names=[GROUP_COL, KEY_COL, HITS_COL, "state"],
        )

    def index_groups(self, groups: Iterable[int]) -> None:
        """Each group's keys are a dict of their own here: nothing to find."""

    def snapshot_groups(self, groups: Iterable[int]) -> pa.RecordBatch:
        entries = [(g, k, v) for g in groups for k, v in self._groups.get(g, {}).items()]
        return self._snapshot(entries)

    def snapshot_keys(self, keys: Sequence[Any]) -> pa.RecordBatch:
        wanted = set(keys)
        entries = [
            (g, k, v) for g, per in self._groups.items() for k, v in per.items() if k in wanted
        ]
        return self._snapshot(entries)

    def restore(self, snapshot: pa.RecordBatch) -> None:
        groups = snapshot.column(GROUP_COL).to_pylist()
        keys = snapshot.column(KEY_COL).to_pylist()
        clash = [k for k in keys if k in self._hits]
        if clash:
            raise ValueError(
                f"restore would duplicate state of {len(clash)} keys, e.g. {clash[0]!r}"
            )
        hits = snapshot.column(HITS_COL).to_pylist()
        for g, k, h, blob in zip(
            groups, keys, hits, snapshot.column("state").to_pylist(), strict=True
        ):
            self._groups.setdefault(g, {})[k] = self.codec.decode(blob)
            self._hits[k] = h
            self._group_hits[g] += h
            self._restored.add(g)

    def drop_groups(self, groups: Iterable[int]) -> int:
        dropped = 0
        for g in groups:
            self._changed.pop(g, None)
            self._deleted.pop(g, None)
            per = self._groups.pop(g, {})
            for k in per:
                self._group_hits[g] -= self._hits.pop(k, 0)
            dropped += len(per)
        return dropped

    def drop_keys(self, keys: Sequence[Any]) -> int:
        return self._remove(keys, expired=False)

    def expire_keys(self, keys: Sequence[Any]) -> int:
        """Delete keys whose state is done with (a window that fired); unlike `drop_keys` (a
        key that moved away), the next incremental checkpoint records their deletion."""
        return self._remove(keys, expired=True)

    def _remove(self, keys: Sequence[Any], expired: bool) -> int:
        wanted = set(keys)
        removed = 0
        for g, per in self._groups.items():
            for k in wanted & per.keys():
                del per[k]
                self._group_hits[g] -= self._hits.pop(k, 0)
                self._changed.get(g, set()).discard(k)
                if expired:
                    self._deleted.setdefault(g, set()).add(k)
                removed += 1
        return removed

    def changes(self, groups: Iterable[int]) -> StateChanges:
        wanted = list(groups)
        entries = [(g, k, self._groups[g][k]) for g in wanted for k in self._changed.get(g, ())]
        deleted = {g: list(self._deleted[g]) for g in wanted if self._deleted.get(g)}
        return StateChanges(self._snapshot(entries), deleted, set(self._restored))

    def clear_changes(self) -> None:
        self._changed.clear()
        self._deleted.clear()
        self._restored.clear()

    def group_sizes(self) -> np.ndarray:
        sizes = np.zeros(self.max_key_groups, dtype=np.int64)
        for g, per in self._groups.items():
            sizes[g] = len(per)
        return sizes

    def get(self, key: Any) -> Any:
        for per in self._groups.values():
            if key in per:
                return per[key]
        return None

    def items(self) -> dict[Any, Any]:
        return {k: v for per in self._groups.values() for k, v in per.items()}
