"""Keyed state in an embedded RocksDB (through rocksdict): state larger than memory.

Layout: a key is its key group (4 bytes, big-endian) followed by the key's bytes (an integer as
8 big-endian bytes with the sign bit flipped, so the order holds; a string as UTF-8), so each
key group is one contiguous range that moves and checkpoints read in one scan. A value starts
with the key's hits (8 bytes), then holds an aggregate's count, sum, min and max, or a process
function's value as `keyshift.runtime.state_values` encodes it. What stays in memory is small
and per group: hits (hot-first ordering needs them), key counts, and, with checkpoints on, the
keys changed since the last checkpoint. Each batch costs one multi-get and one write batch for
its distinct keys (an aggregate's batch is pre-aggregated per key first), not a call per record.
Snapshots have the memory backends' columns, so migration chunks and checkpoint shards are the
same whichever backend wrote them.

The database is a cache of the job's state, never its record: an instance starts on an empty
one and gets its groups from a checkpoint or a migration, so the write-ahead log is off and a
database left by a crashed incarnation of the same instance is wiped at start. A directory that
is not such a database is refused, never reused. Used by the keyed stage when its
`state.backend` is `rocksdb` (`keyshift.runtime.keyed_stage`).
"""

from __future__ import annotations

import itertools
import json
import shutil
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import rocksdict

from keyshift.runtime.keyspace import key_groups
from keyshift.runtime.records import GROUP
from keyshift.runtime.state import (
    GROUP_COL,
    HITS_COL,
    KEY_COL,
    BatchAggregate,
    ProcessFunction,
    StateChanges,
    Update,
    aggregate_output_schema,
    aggregate_values,
    empty_update,
    process_output,
)
from keyshift.runtime.state_values import ValueCodec

GROUP_BYTES = 4
_INT_KEY = np.dtype([("group", ">u4"), ("key", ">u8")])
_VALUE = np.dtype(
    [("hits", "<i8"), ("count", "<i8"), ("sum", "<f8"), ("min", "<f8"), ("max", "<f8")]
)
_EMPTY = np.array([(0, 0, 0.0, np.inf, -np.inf)], dtype=_VALUE).tobytes()
HITS_BYTES = 8
_SIGN = np.uint64(1 << 63)
MARKER = "keyshift-state.json"
DATABASE = "db"
# SST files of moving groups, beside the database: written by an old owner, ingested by a new one.
TRANSFER = "transfer"
# Keys per write batch when a checkpoint's ranges are copied in: a batch is held whole in memory,
# 4 MiB of 4 KiB values (65,536 keys of such values were 256 MiB).
COPY_CHUNK = 1024
# The change marks live in memory, and RocksDB state is there to outgrow it: past this many
# keys marked since the last checkpoint, marking stops until the next one, and a hand-over
# then pushes every group whole (its changes are no longer known).
MAX_MARKED_KEYS = 65_536
SST_FILE_MB = 8  # the size compaction cuts its output files at


class RocksStateError(RuntimeError):
    """A state directory that cannot be used: not writable, or holding something else."""


def _multi_get(db: rocksdict.Rdict, keys: list[bytes]) -> list[bytes | None]:
    """One multi-get: the value of each key, None where absent."""
    if not keys:
        return []
    found: list[bytes | None] = db.get(keys)  # type: ignore[arg-type,assignment]
    return found


def _split(buffer: bytes, width: int) -> list[bytes]:
    return [buffer[i : i + width] for i in range(0, len(buffer), width)]


def _prefix(group: int) -> bytes:
    return group.to_bytes(GROUP_BYTES, "big")


def prepare_directory(path: Path, owner: str) -> Path:
    """The database directory of `owner` below `path`, empty and marked as keyshift's.

    A database this owner left (a crash, a restart) is wiped, with any checkpoint or download
    directory beside it: its contents are older than the checkpoint or migration the instance
    is about to load. Anything else is refused."""
    marker = path / MARKER
    try:
        if path.exists():
            if marker.exists():
                try:
                    found = json.loads(marker.read_text()).get("owner")
                except (ValueError, AttributeError) as exc:
                    raise RocksStateError(
                        f"{marker} cannot be read ({exc}): whose state {path} holds is not "
                        "known; refusing to use or delete it"
                    ) from exc
                if found != owner:
                    raise RocksStateError(
                        f"{path} holds the RocksDB state of {found!r}, not of {owner!r}: "
                        "give each keyed instance its own state path"
                    )
                for child in path.iterdir():
                    if child.name != MARKER:
                        shutil.rmtree(child, ignore_errors=True)
            elif any(path.iterdir()):
                raise RocksStateError(
                    f"{path} is not empty and is not a keyshift state directory "
                    f"(no {MARKER}); refusing to use or delete it"
                )
        path.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps({"owner": owner}))
    except OSError as exc:
        raise RocksStateError(f"cannot use {path} for RocksDB state: {exc}") from exc
    return path / DATABASE


def open_database(directory: Path, block_cache_mb: int, write_buffer_mb: int) -> rocksdict.Rdict:
    """A fresh database whose memory is bounded by its block cache and write buffers."""
    options = rocksdict.Options(raw_mode=True)
    options.create_if_missing(True)
    table = rocksdict.BlockBasedOptions()
    table.set_block_cache(rocksdict.Cache(block_cache_mb << 20))
    # Index and filter blocks count against the cache instead of growing beside it. Partitioned,
    # with the top level and L0's pinned there: a lookup of a key the cache has not seen lately
    # (every new key) then reads one small partition instead of evicting data blocks for a
    # whole file's filter. 3-4x faster at 3-4 M keys with a 64 MiB cache (bench/README.md).
    table.set_cache_index_and_filter_blocks(True)
    table.set_bloom_filter(10, False)
    table.set_index_type(rocksdict.BlockBasedIndexType.two_level_index_search())
    table.set_partition_filters(True)
    table.set_pin_top_level_index_and_filter(True)
    table.set_pin_l0_filter_and_index_blocks_in_cache(True)
    options.set_block_based_table_factory(table)
    options.set_write_buffer_size(write_buffer_mb << 20)
    options.set_max_write_buffer_number(2)
    # A checkpoint uploads, and a restore downloads, one SST file at a time, whole: compaction's
    # files of 64 MiB by default were a 70 MB step in the resident memory at every upload.
    options.set_target_file_size_base(SST_FILE_MB << 20)
    writes = rocksdict.WriteOptions()
    # A property at run time, though rocksdict's stubs declare a method.
    writes.disable_wal = True  # type: ignore[method-assign,assignment]
    try:
        db = rocksdict.Rdict(str(directory), options)
    except Exception as exc:  # rocksdict raises plain Exceptions for RocksDB's errors
        raise RocksStateError(f"cannot open RocksDB state at {directory}: {exc}") from exc
    db.set_write_options(writes)
    return db


# The key groups of keys given without them (a window's composite keys: their key's group).
GroupsOf = Callable[[Sequence[Any]], np.ndarray]


class RocksStore(ABC):
    """What both RocksDB stores share: the key layout, ranges per group, the in-memory counts
    per group, and the changes since the last checkpoint."""

    def __init__(
        self,
        max_key_groups: int,
        key_type: pa.DataType,
        db: rocksdict.Rdict,
        track_changes: bool,
        groups_of: GroupsOf | None = None,
    ) -> None:
        self.max_key_groups = max_key_groups
        self.key_type = key_type
        self._groups_of = groups_of
        self._db = db
        self._transfer = self.directory / TRANSFER
        self._numeric = pa.types.is_integer(key_type)
        self._key_count = 0
        self._group_keys = np.zeros(max_key_groups, dtype=np.int64)
        self._group_hits = np.zeros(max_key_groups, dtype=np.int64)
        # Without checkpoints nobody asks for changes: keeping them would grow with the keys.
        self._tracked = self._track = track_changes
        self._changed: dict[int, set[bytes]] = {}
        self._deleted: dict[int, set[bytes]] = {}
        self._restored: set[int] = set()
        self._marked = 0  # keys marked since the last clear (a key marked twice counts twice)

    # -- keys as bytes ------------------------------------------------------------------------

    def _encode(self, groups: np.ndarray, keys: Any) -> list[bytes]:
        if self._numeric:
            packed = np.empty(len(groups), dtype=_INT_KEY)
            packed["group"] = groups
            packed["key"] = np.asarray(keys, dtype=np.int64).view(np.uint64) ^ _SIGN
            return _split(packed.tobytes(), _INT_KEY.itemsize)
        return [_prefix(g) + k.encode() for g, k in zip(groups.tolist(), keys, strict=True)]

    def _decode(self, dbkeys: list[bytes]) -> tuple[np.ndarray, Any]:
        if self._numeric:
            packed = np.frombuffer(b"".join(dbkeys), dtype=_INT_KEY)
            keys = (packed["key"].astype(np.uint64) ^ _SIGN).view(np.int64)
            return packed["group"].astype(np.int32), keys
        groups = np.array([int.from_bytes(k[:GROUP_BYTES], "big") for k in dbkeys], np.int32)
        return groups, [k[GROUP_BYTES:].decode() for k in dbkeys]

    def _order(self, groups: np.ndarray, keys: Any) -> np.ndarray:
        """The permutation that puts these keys in the database's (byte) order."""
        if self._numeric:
            # Big-endian group, then the sign-flipped key: numeric order is byte order.
            flipped = np.asarray(keys, dtype=np.int64).view(np.uint64) ^ _SIGN
            return np.lexsort((flipped, groups))
        dbkeys = self._encode(groups, keys)
        return np.array(sorted(range(len(dbkeys)), key=dbkeys.__getitem__), dtype=np.int64)

    def _encode_keys(self, keys: Sequence[Any]) -> list[bytes]:
        """Keys whose groups are not at hand: their groups are computed as the sources do (by
        `groups_of` for keys that are not what the sources route by: a window's composite
        key is in its key's group)."""
        if self._groups_of is not None:
            groups = self._groups_of(keys)
        else:
            groups = key_groups(pa.array(keys, type=self.key_type), self.max_key_groups)
        return self._encode(groups, list(keys))

    def _present(self, dbkeys: list[bytes]) -> tuple[list[bytes], list[bytes]]:
        found = _multi_get(self._db, dbkeys)
        pairs = [(k, v) for k, v in zip(dbkeys, found, strict=True) if v is not None]
        return [k for k, _ in pairs], [v for _, v in pairs]

    def _scan(self, group: int) -> tuple[list[bytes], list[bytes]]:
        """Every key and value of one key group: one range of the database."""
        keys: list[bytes] = []
        values: list[bytes] = []
        for chunk_keys, chunk_values in _ranges(self._db, group, 1 << 62):
            keys += chunk_keys
            values += chunk_values
        return keys, values

    def _range(self, group: int) -> list[tuple[bytes, bytes]]:
        """The keys and values of one key group: as many as the group holds, read from its
        first key with no Python step per key; the neighbours of the range prove its bounds."""
        count = int(self._group_keys[group])
        prefix = _prefix(group)
        # A raw-mode database yields bytes, though rocksdict's stubs allow any key type.
        items: Iterable[tuple[bytes, bytes]] = self._db.items(from_key=prefix)  # type: ignore[assignment]
        found = list(itertools.islice(items, count + 1))
        beyond = found.pop() if len(found) > count else None
        if (
            len(found) != count
            or (
                found
                and (found[0][0][:GROUP_BYTES] != prefix or found[-1][0][:GROUP_BYTES] != prefix)
            )
            or (beyond is not None and beyond[0][:GROUP_BYTES] == prefix)
        ):
            raise RocksStateError(
                f"key group {group} does not hold the {count} keys this instance counted"
            )
        return found

    def _scan_groups(self, groups: Iterable[int]) -> tuple[list[bytes], list[bytes]]:
        keys: list[bytes] = []
        values: list[bytes] = []
        for group in (int(g) for g in groups):
            if self._group_keys[group]:
                more_keys, more_values = self._scan(group)
                keys += more_keys
                values += more_values
        return keys, values

    @abstractmethod
    def _rows(self, dbkeys: list[bytes], values: list[bytes]) -> pa.RecordBatch:
        """Snapshot rows of these keys and values, in the columns of the store's kind."""

    def _write(self, puts: Iterable[tuple[bytes, bytes]], deletes: Iterable[bytes] = ()) -> None:
        writes = rocksdict.WriteBatch(raw_mode=True)
        for key, value in puts:
            writes.put(key, value)
        for key in deletes:
            writes.delete(key)
        self._commit(writes)

    def _commit(self, writes: rocksdict.WriteBatch) -> None:
        try:
            self._db.write(writes)
        except Exception as exc:  # rocksdict raises plain Exceptions for RocksDB's errors
            # A write batch is atomic and the counts are only updated after it: a failed one
            # changed nothing. The instance stops; the job recovers from its last checkpoint
            # (its database is rebuilt then), never going on with a partial batch.
            raise RocksStateError(f"cannot write RocksDB state at {self.directory}: {exc}") from exc

    def _note(self, table: dict[int, set[bytes]], groups: np.ndarray, keys: list[bytes]) -> None:
        if self._marking():
            for group, key in zip(groups.tolist(), keys, strict=True):
                self._mark(table, group, key)

    def _marking(self) -> bool:
        """Whether changes are marked now: tracked, and within MAX_MARKED_KEYS."""
        if self._track and self._marked > MAX_MARKED_KEYS:
            self._changed.clear()
            self._deleted.clear()
            self._track = False  # till the next clear_changes
        return self._track

    def _mark(self, table: dict[int, set[bytes]], group: int, key: bytes) -> None:
        marks = table.setdefault(group, set())
        before = len(marks)
        marks.add(key)
        self._marked += len(marks) - before

    def _restore_rows(self, snapshot: pa.RecordBatch, values: list[bytes]) -> None:
        """Write a snapshot's keys with their encoded values; a key already here is an
        ownership error, and nothing is written then."""
        groups = snapshot.column(GROUP_COL).to_numpy()
        key_col = snapshot.column(KEY_COL)
        dbkeys = self._encode(groups, key_col.to_numpy() if self._numeric else key_col.to_pylist())
        present, _ = self._present(dbkeys)
        if present:
            example = self._decode(present[:1])[1][0]
            raise ValueError(
                f"restore would duplicate state of {len(present)} keys, e.g. {example!r}"
            )
        self._write(zip(dbkeys, values, strict=True))
        self._key_count += snapshot.num_rows
        np.add.at(self._group_keys, groups, 1)
        np.add.at(self._group_hits, groups, snapshot.column(HITS_COL).to_numpy())
        self._restored.update(np.unique(groups).tolist())

    # -- the KeyedState protocol ------------------------------------------------------------

    @property
    def key_count(self) -> int:
        return self._key_count

    def bytes_estimate(self) -> int:
        live = self._db.property_int_value("rocksdb.estimate-live-data-size") or 0
        memtables = self._db.property_int_value("rocksdb.cur-size-all-mem-tables") or 0
        return int(live) + int(memtables)

    def group_hits(self) -> np.ndarray:
        return self._group_hits

    def group_sizes(self) -> np.ndarray:
        return self._group_keys.copy()

    def index_groups(self, groups: Iterable[int]) -> None:  # noqa: B027 (no work, on purpose)
        """A group's keys are one range of the database: nothing to find."""

    def snapshot_groups(self, groups: Iterable[int]) -> pa.RecordBatch:
        return self._rows(*self._scan_groups(groups))

    def snapshot_keys(self, keys: Sequence[Any]) -> pa.RecordBatch:
        return self._rows(*self._present(self._encode_keys(keys)) if keys else ([], []))

    def export_groups(self, groups: Sequence[int]) -> bytes:
        """The keys and values of `groups` as the bytes of one SST file (empty when the groups
        hold no key), for `ingest_groups` at a new owner. `groups` must be ascending."""
        if not self._group_keys[np.asarray(groups, dtype=np.int64)].any():
            return b""
        self._transfer.mkdir(exist_ok=True)
        path = self._transfer / f"out-{uuid.uuid4().hex}.sst"
        writer = rocksdict.SstFileWriter(rocksdict.Options(raw_mode=True))
        try:
            writer.open(str(path))
            for group in groups:
                for key, value in self._range(int(group)):
                    writer[key] = value
            writer.finish()
            return path.read_bytes()
        finally:
            path.unlink(missing_ok=True)

    def ingest_groups(
        self, groups: Sequence[int], keys: np.ndarray, hits: np.ndarray, sst: bytes | memoryview
    ) -> None:
        """Add whole groups that `export_groups` wrote, with their key counts and hits: RocksDB
        takes the file as it is, with no work per key. No key of the file may be here already;
        the migration protocol guarantees it (a key a new owner fetched on demand is deleted at
        the old owner before its group is exported)."""
        if len(sst):
            self._transfer.mkdir(exist_ok=True)
            path = self._transfer / f"in-{uuid.uuid4().hex}.sst"
            path.write_bytes(sst)
            options = rocksdict.IngestExternalFileOptions()
            options.set_move_files(True)
            try:
                self._db.ingest_external_file([str(path)], options)
            except Exception as exc:  # rocksdict raises plain Exceptions for RocksDB's errors
                raise RocksStateError(
                    f"cannot ingest the state file of groups {list(groups)[:8]}...: {exc}"
                ) from exc
            finally:
                path.unlink(missing_ok=True)
        where = np.asarray(groups, dtype=np.int64)
        self._key_count += int(keys.sum())
        np.add.at(self._group_keys, where, keys)
        np.add.at(self._group_hits, where, hits)
        self._restored.update(where.tolist())

    def drop_groups(self, groups: Iterable[int]) -> int:
        writes = rocksdict.WriteBatch(raw_mode=True)
        doomed = []
        for group in (int(g) for g in groups):
            self._changed.pop(group, None)
            self._deleted.pop(group, None)
            if self._group_keys[group]:
                writes.delete_range(_prefix(group), _prefix(group + 1))
                doomed.append(group)
        if not doomed:
            return 0
        self._commit(writes)
        dropped = int(self._group_keys[doomed].sum())
        self._group_keys[doomed] = 0
        self._group_hits[doomed] = 0
        self._key_count -= dropped
        return dropped

    def drop_keys(self, keys: Sequence[Any]) -> int:
        """Keys leaving one at a time (fetched by a new owner): no tombstones, they moved."""
        return self._remove(keys, expired=False)

    def expire_keys(self, keys: Sequence[Any]) -> int:
        """Delete keys whose state is done with (a window that fired). Its checkpoints are
        native database snapshots, which a deletion reaches as it is; the change marks record
        it for a hand-over from a checkpoint, whose new owner preloaded the key."""
        return self._remove(keys, expired=True)

    def _remove(self, keys: Sequence[Any], expired: bool) -> int:
        present, values = self._present(self._encode_keys(keys)) if keys else ([], [])
        if not present:
            return 0
        groups, _ = self._decode(present)
        self._write((), present)
        for group, key in zip(groups.tolist(), present, strict=True):
            self._changed.get(group, set()).discard(key)
        if expired:
            self._note(self._deleted, groups, present)
        self._key_count -= len(present)
        np.subtract.at(self._group_keys, groups, 1)
        np.subtract.at(self._group_hits, groups, _hits(values))
        return len(present)

    def changes(self, groups: Iterable[int]) -> StateChanges:
        wanted = [int(g) for g in groups]
        changed = [key for g in wanted for key in sorted(self._changed.get(g, ()))]
        deleted = {
            g: list(self._decode(sorted(self._deleted[g]))[1])
            for g in wanted
            if self._deleted.get(g)
        }
        # Marks given up on (too many): every group is as if it came after the checkpoint.
        whole = set(self._restored) if self._marking() else set(range(len(self._group_keys)))
        return StateChanges(self._rows(*self._present(changed)), deleted, whole)

    def clear_changes(self) -> None:
        self._changed.clear()
        self._deleted.clear()
        self._restored.clear()
        self._track = self._tracked
        self._marked = 0

    def close(self) -> None:
        self._db.close()

    # -- native checkpoints (keyshift.runtime.rocksdb_checkpoint) ----------------------------

    @property
    def directory(self) -> Path:
        """The instance's state directory: its database, and room for checkpoint files beside
        it (on the same file system, so a checkpoint's files are hard links)."""
        return Path(self._db.path()).parent

    def checkpoint_into(self, target: Path) -> None:
        """A RocksDB checkpoint of the database in `target` (which must not exist): its
        memtables flushed, its SST files hard-linked."""
        try:
            rocksdict.Checkpoint(self._db).create_checkpoint(str(target))
        except Exception as exc:  # rocksdict raises plain Exceptions for RocksDB's errors
            raise RocksStateError(f"cannot take a RocksDB checkpoint in {target}: {exc}") from exc

    def copy_groups(self, source: Path, groups: Iterable[int]) -> int:
        """Copy the ranges of `groups` from the database at `source` (a downloaded checkpoint,
        opened read-only) into this one; the keys copied. A group that already holds keys here
        is an ownership error, and nothing of it is copied."""
        wanted = sorted(int(g) for g in groups)
        held = [g for g in wanted if self._group_keys[g]]
        if held:
            raise ValueError(f"restore would duplicate the state of key groups {held[:5]}")
        try:
            other = rocksdict.Rdict(
                str(source),
                rocksdict.Options(raw_mode=True),
                access_type=rocksdict.AccessType.read_only(),
            )
        except Exception as exc:  # rocksdict raises plain Exceptions for RocksDB's errors
            raise RocksStateError(f"cannot open the RocksDB checkpoint at {source}: {exc}") from exc
        copied = 0
        try:
            for group in wanted:
                for keys, values in _ranges(other, group, COPY_CHUNK):
                    self._write(zip(keys, values, strict=True))
                    self._group_keys[group] += len(keys)
                    self._group_hits[group] += int(_hits(values).sum())
                    copied += len(keys)
        finally:
            other.close()
        self._key_count += copied
        self._restored.update(wanted)
        return copied


def _ranges(
    db: rocksdict.Rdict, group: int, chunk: int
) -> Iterator[tuple[list[bytes], list[bytes]]]:
    """The keys and values of one key group's range, `chunk` keys at a time: RocksDB stops at
    the range's end (an upper bound), so no Python step runs per key."""
    bounds = rocksdict.ReadOptions()
    bounds.set_iterate_upper_bound(_prefix(group + 1))
    # A raw-mode database yields bytes, though rocksdict's stubs allow any key type.
    items: Iterator[tuple[bytes, bytes]] = iter(db.items(from_key=_prefix(group), read_opt=bounds))  # type: ignore[arg-type]
    while found := list(itertools.islice(items, chunk)):
        keys, values = zip(*found, strict=True)
        yield list(keys), list(values)


def _hits(values: list[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(v[:HITS_BYTES] for v in values), dtype="<i8").astype(np.int64)


class RocksAggregateState(RocksStore):
    """Running aggregates per key in RocksDB, updated a batch at a time."""

    def __init__(
        self,
        function: str,
        max_key_groups: int,
        key_type: pa.DataType,
        db: rocksdict.Rdict,
        track_changes: bool,
        groups_of: GroupsOf | None = None,
    ) -> None:
        super().__init__(max_key_groups, key_type, db, track_changes, groups_of)
        self.function = function

    def _rows(self, dbkeys: list[bytes], values: list[bytes]) -> pa.RecordBatch:
        groups, keys = self._decode(dbkeys)
        cols = np.frombuffer(b"".join(values), dtype=_VALUE)
        return pa.RecordBatch.from_arrays(
            [
                pa.array(groups, type=pa.int32()),
                pa.array(keys, type=self.key_type),
                pa.array(cols["hits"]),
                pa.array(cols["count"]),
                pa.array(cols["sum"]),
                pa.array(cols["min"]),
                pa.array(cols["max"]),
            ],
            names=[GROUP_COL, KEY_COL, HITS_COL, "count", "sum", "min", "max"],
        )

    def output_schema(self) -> pa.Schema:
        return aggregate_output_schema(self.function, self.key_type)

    def apply(self, batch: pa.RecordBatch, key_field: str, value_field: str | None) -> Update:
        """Apply every record of `batch`: one multi-get and one write batch for its keys."""
        if batch.num_rows == 0:
            return empty_update(self.output_schema())
        field = None if self.function == "count" else value_field
        part = BatchAggregate.of(batch, key_field, field, self._numeric)
        # In the database's own order, lookups and inserts walk its memtable and files forward.
        part = part.take(self._order(part.groups, part.keys))
        dbkeys = self._encode(part.groups, part.keys)
        found = _multi_get(self._db, dbkeys)
        new = np.array([v is None for v in found], dtype=bool)
        cols = np.frombuffer(
            b"".join(_EMPTY if v is None else v for v in found), dtype=_VALUE
        ).copy()
        cols["count"] += part.counts
        cols["hits"] += part.counts
        if part.reduced is not None:
            cols["sum"] += part.reduced.sums
            cols["min"] = np.minimum(cols["min"], part.reduced.mins)
            cols["max"] = np.maximum(cols["max"], part.reduced.maxs)
        self._write(zip(dbkeys, _split(cols.tobytes(), _VALUE.itemsize), strict=True))
        self._key_count += int(new.sum())
        np.add.at(self._group_keys, part.groups[new], 1)
        np.add.at(self._group_hits, part.groups, part.counts)
        self._note(self._changed, part.groups, dbkeys)
        values = aggregate_values(
            self.function, cols["count"], cols["sum"], cols["min"], cols["max"]
        )
        return part.update(self.output_schema(), values, cols["hits"], part.groups)

    def restore(self, snapshot: pa.RecordBatch) -> None:
        """Add the keys of a snapshot; a key already present is an ownership error."""
        if snapshot.num_rows == 0:
            return
        cols = np.empty(snapshot.num_rows, dtype=_VALUE)
        for name in (HITS_COL, "count", "sum", "min", "max"):
            cols[name] = snapshot.column(name).to_numpy()
        self._restore_rows(snapshot, _split(cols.tobytes(), _VALUE.itemsize))

    def _values(self, rows: pa.RecordBatch) -> np.ndarray:
        columns = (rows.column(name).to_numpy() for name in ("count", "sum", "min", "max"))
        return aggregate_values(self.function, *columns)

    def get(self, key: Any) -> float | int | None:
        rows = self.snapshot_keys([key])
        return self._values(rows).tolist()[0] if rows.num_rows else None

    def items(self) -> dict[Any, float | int]:
        rows = self.snapshot_groups(range(self.max_key_groups))
        return dict(zip(rows.column(KEY_COL).to_pylist(), self._values(rows).tolist(), strict=True))


class RocksProcessState(RocksStore):
    """One value per key in RocksDB, updated record by record by a user's function; each batch
    reads its distinct keys once and writes them back once."""

    def __init__(
        self,
        function: ProcessFunction,
        max_key_groups: int,
        key_type: pa.DataType,
        db: rocksdict.Rdict,
        codec: ValueCodec,
        track_changes: bool,
        groups_of: GroupsOf | None = None,
    ) -> None:
        super().__init__(max_key_groups, key_type, db, track_changes, groups_of)
        self.function = function
        self.codec = codec

    def _rows(self, dbkeys: list[bytes], values: list[bytes]) -> pa.RecordBatch:
        groups, keys = self._decode(dbkeys)
        return pa.RecordBatch.from_arrays(
            [
                pa.array(groups, type=pa.int32()),
                pa.array(keys, type=self.key_type),
                pa.array(_hits(values)),
                pa.array([v[HITS_BYTES:] for v in values], type=pa.binary()),
            ],
            names=[GROUP_COL, KEY_COL, HITS_COL, "state"],
        )

    def apply(self, batch: pa.RecordBatch, key_field: str) -> tuple[list[dict[str, Any]], int]:
        """Run the function over each record in order; return its outputs with their metadata.
        Returning None as the state deletes the key's state, as in ProcessState."""
        records = batch.to_pylist()
        firsts: dict[Any, int] = {}
        for record in records:
            firsts.setdefault(record[key_field], record[GROUP])
        keys = list(firsts)
        dbkeys = self._encode(np.fromiter(firsts.values(), np.int64, len(keys)), keys)
        found = _multi_get(self._db, dbkeys)
        # key -> [state, hits]; a key with no state has None there.
        current: dict[Any, list[Any]] = {
            key: [None, 0]
            if blob is None
            else [self.codec.decode(blob[HITS_BYTES:]), _hits([blob])[0]]
            for key, blob in zip(keys, found, strict=True)
        }
        existed = {key: blob is not None for key, blob in zip(keys, found, strict=True)}
        deleted: set[Any] = set()
        outputs: list[dict[str, Any]] = []
        for record in records:
            key = record[key_field]
            entry = current[key]
            state, out = self.function(entry[0], record)
            if state is None:
                if entry[0] is not None:
                    deleted.add(key)
                self._group_hits[record[GROUP]] -= entry[1]
                entry[0], entry[1] = None, 0
            else:
                entry[0] = state
                entry[1] += 1
                self._group_hits[record[GROUP]] += 1
                deleted.discard(key)
            if out is not None:
                outputs.append(process_output(key, out, record))
        puts = []
        removes = []
        for key, dbkey in zip(keys, dbkeys, strict=True):
            state, hits = current[key]
            if state is not None:
                puts.append(
                    (dbkey, int(hits).to_bytes(HITS_BYTES, "little") + self.codec.encode(state))
                )
            elif existed[key]:
                removes.append(dbkey)
        self._write(puts, removes)
        groups = np.fromiter(firsts.values(), np.int64, len(keys))
        now = np.array([current[k][0] is not None for k in keys], dtype=bool)
        before = np.array([existed[k] for k in keys], dtype=bool)
        self._key_count += int(now.sum()) - int(before.sum())
        np.add.at(self._group_keys, groups, now.astype(np.int64) - before.astype(np.int64))
        if self._marking():
            for group, key, dbkey in zip(groups.tolist(), keys, dbkeys, strict=True):
                if current[key][0] is not None:
                    self._mark(self._changed, group, dbkey)
                    self._deleted.get(group, set()).discard(dbkey)
                elif key in deleted:
                    self._mark(self._deleted, group, dbkey)
                    self._changed.get(group, set()).discard(dbkey)
        return outputs, batch.num_rows

    def restore(self, snapshot: pa.RecordBatch) -> None:
        """Add the keys of a snapshot; a key already present is an ownership error. Values
        this job's codec would refuse to decode are refused here, before they are stored."""
        if snapshot.num_rows == 0:
            return
        blobs = snapshot.column("state").to_pylist()
        self.codec.check(blobs)
        hits = snapshot.column(HITS_COL).to_numpy()
        values = [
            int(h).to_bytes(HITS_BYTES, "little") + b
            for h, b in zip(hits.tolist(), blobs, strict=True)
        ]
        self._restore_rows(snapshot, values)

    def get(self, key: Any) -> Any:
        rows = self.snapshot_keys([key])
        return self.codec.decode(rows.column("state")[0].as_py()) if rows.num_rows else None

    def items(self) -> dict[Any, Any]:
        rows = self.snapshot_groups(range(self.max_key_groups))
        return {
            key: self.codec.decode(blob)
            for key, blob in zip(
                rows.column(KEY_COL).to_pylist(), rows.column("state").to_pylist(), strict=True
            )
        }
